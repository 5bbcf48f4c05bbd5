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


def test_argcheck_exits_nonzero_when_any_argv_fails(argcheck_run) -> None:
    returncode, _ = argcheck_run
    assert returncode == 1
