"""vLLM's own parser judges flags: files/vllm_argcheck.py run under the real vLLM CPU venv."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from roles._lib.programs import program_source

pytestmark = pytest.mark.vllm

ARGCHECK = program_source("vllm", "vllm_argcheck.py")


# --- flag validation with vLLM's own parser ---------------------------------------------------------

ARGCHECK_CASES = {
    "good": (["vllm", "serve", "google/gemma-4-31b-it", "--gpu-memory-utilization", "0.9",
              "--reasoning-parser", "gemma4", "--tool-call-parser", "gemma4", "--enable-auto-tool-choice"], True),
    "cpu_profile_flags": (["/models/tiny", "--served-model-name", "tiny", "--dtype", "bfloat16", "--enforce-eager",
                           "--limit-mm-per-prompt", '{"image":0,"audio":0,"video":0}'], True),
    "without_vllm_serve_prefix": (["google/gemma-4-31b-it", "--max-model-len", "8192"], True),
    "typo": (["vllm", "serve", "google/gemma-4-31b-it", "--gpu-memory-utilisation", "0.9"], False),
    "unknown_reasoning_parser": (["serve", "google/gemma-4-31b-it", "--reasoning-parser", "gemma5"], False),
    "unknown_tool_parser": (["google/gemma-4-31b-it", "--tool-call-parser", "gemma5", "--enable-auto-tool-choice"], False),
    "auto_tool_choice_without_parser": (["google/gemma-4-31b-it", "--enable-auto-tool-choice"], False),
    "bad_value": (["google/gemma-4-31b-it", "--max-model-len", "lots"], False),
    "pinned_assistant": (["google/gemma-4-31b-it", "--speculative-config",
                          '{"method":"mtp","model":"google/gemma-4-31B-it-assistant","revision":"' + "e" * 40 + '",'
                          '"num_speculative_tokens":4}'], True),
    "unknown_speculative_key": (["google/gemma-4-31b-it", "--speculative-config",
                                 '{"method":"mtp","num_speculative_token":4}'], False),
}  # fmt: skip


@pytest.fixture(scope="module")
def argcheck_run(vllm_python: Path) -> tuple[int, dict[str, dict]]:
    # One run for all cases: importing vLLM and building its parser takes about 10 s.
    names = list(ARGCHECK_CASES)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # the script must unset it itself
    proc = subprocess.run(
        [str(vllm_python), str(ARGCHECK)],
        input=json.dumps([ARGCHECK_CASES[name][0] for name in names]),
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(names), proc.stdout + proc.stderr
    return proc.returncode, dict(zip(names, results, strict=True))


@pytest.mark.parametrize("case", list(ARGCHECK_CASES))
def test_argcheck_verdict(argcheck_run, case: str) -> None:
    _, results = argcheck_run
    expected_ok = ARGCHECK_CASES[case][1]
    assert results[case]["ok"] is expected_ok, results[case]
    assert bool(results[case]["error"]) is not expected_ok


def test_argcheck_names_the_unknown_flag(argcheck_run) -> None:
    _, results = argcheck_run
    assert "--gpu-memory-utilisation" in results["typo"]["error"]


def test_argcheck_names_an_unknown_key_of_a_json_config_flag(argcheck_run) -> None:
    """vLLM's parser keeps --speculative-config as a plain dict; the engine would refuse the key only at start."""
    _, results = argcheck_run
    error = results["unknown_speculative_key"]["error"]
    assert "--speculative-config" in error and "num_speculative_token" in error and "num_speculative_tokens" in error


def test_argcheck_exits_nonzero_when_any_argv_fails(argcheck_run) -> None:
    returncode, _ = argcheck_run
    assert returncode == 1


# --- the media allow-list: the planned flag as vLLM parses it, and what its MediaConnector then fetches --------

MEDIA_JUDGE = r"""
import json, os, sys
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
sys.path.insert(0, sys.argv[1])
from urllib3.util import parse_url
from vllm_argcheck import build_serve_parser, check_argv, normalize_argv
from vllm.multimodal.media.connector import MediaConnector
parser, serve = build_serve_parser()
out = []
for argv, urls in json.load(sys.stdin):
    error = check_argv(parser, serve, argv)
    domains = parser.parse_args(normalize_argv(argv)).allowed_media_domains
    connector = MediaConnector(allowed_media_domains=domains)
    verdicts = {}
    for url in urls:
        try:
            connector._assert_url_in_allowed_media_domains(parse_url(url))  # what load_from_url asks first
            verdicts[url] = "fetched"
        except ValueError:
            verdicts[url] = "refused"
    out.append({"error": error, "domains": domains, "verdicts": verdicts})
print(json.dumps(out))
"""
METADATA_URL = "http://169.254.169.254/computeMetadata/v1/instance/service-accounts/default/token"


def test_planned_media_allow_list_is_vllms_own(vllm_python: Path, tmp_path: Path) -> None:
    from gemmaserve.plan import NO_MEDIA_DOMAIN, plan
    from gemmaserve.spec import parse_spec

    def argv(**workload) -> list[str]:
        # No chat template: its installed path does not exist here, and vLLM's validation reads it.
        data = {"tool_calling": False, "reasoning": False, **workload}
        return (
            plan(parse_spec({"model": "31b", "accelerator": {"kind": "h200", "count": 1}, "workload": data}))
            .replicas[0]
            .argv
        )

    urls = [
        METADATA_URL,
        "https://images.example.com/a.png",
        "https://IMAGES.example.com/b.png",
        "https://evil.example/c",
    ]
    cases = [(argv(), urls), (argv(allowed_media_domains=["images.example.com", "cdn.example"]), urls)]
    judge = tmp_path / "media_judge.py"
    judge.write_text(MEDIA_JUDGE)
    proc = subprocess.run(
        [str(vllm_python), str(judge), str(ARGCHECK.parent)],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    default, listed = json.loads(proc.stdout.splitlines()[-1])
    assert default["error"] is None and listed["error"] is None, (default, listed)
    assert default["domains"] == [NO_MEDIA_DOMAIN]
    assert set(default["verdicts"].values()) == {"refused"}, default
    assert listed["domains"] == ["images.example.com", "cdn.example"]
    assert listed["verdicts"] == {
        METADATA_URL: "refused",
        "https://images.example.com/a.png": "fetched",
        "https://IMAGES.example.com/b.png": "fetched",  # urllib3 lower-cases the host before vLLM compares
        "https://evil.example/c": "refused",
    }
