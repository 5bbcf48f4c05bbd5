"""The vLLM CPU build: flag checks with vLLM's own parser and the tiny test model.

Serving it for real is tested through the product path: a pyinfra deploy to a sandbox host
(tests/roles/test_deploy.py).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from gemmaserve import vllm_argcheck, vllm_cpu
from gemmaserve.tiny_model import SPECIAL_TOKENS, build_tiny_model

pytestmark = pytest.mark.vllm

STARTUP_TIMEOUT_S = 240  # measured here: 39 s with --enforce-eager, 85 s with torch.compile
REQUEST_TIMEOUT_S = 60
STOP_TIMEOUT_S = 30


@pytest.fixture(scope="session")
def tiny_model(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-gemma4"))


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
        [str(vllm_python), vllm_argcheck.__file__],
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


# --- the tiny test model --------------------------------------------------------------------------


def test_tiny_model_is_labelled_as_a_test_model(tiny_model: Path) -> None:
    assert "TEST MODEL" in (tiny_model / "README.md").read_text()
    assert json.loads((tiny_model / "gemmaserve_test_model.json").read_text())["test_model"] is True


def test_tiny_model_is_tiny(tiny_model: Path) -> None:
    parameters = json.loads((tiny_model / "gemmaserve_test_model.json").read_text())["parameters"]
    assert parameters < 1_000_000


def test_tiny_model_head_dims_fit_the_cpu_attention_backend(tiny_model: Path) -> None:
    text = json.loads((tiny_model / "config.json").read_text())["text_config"]
    head_dims = {text["head_dim"], *(layer["head_dim"] for layer in text["per_layer_config"].values())}
    assert head_dims == {32, 64}


@pytest.fixture(scope="session")
def tiny_model_token_ids(vllm_python: Path, tiny_model: Path) -> dict[str, list[int]]:
    script = (
        "import json, sys; from transformers import AutoTokenizer;"
        "t = AutoTokenizer.from_pretrained(sys.argv[1]);"
        "print(json.dumps({s: t.encode(s, add_special_tokens=False) for s in json.loads(sys.argv[2])}))"
    )
    proc = subprocess.run(
        [str(vllm_python), "-c", script, str(tiny_model), json.dumps(SPECIAL_TOKENS)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("token", SPECIAL_TOKENS)
def test_tiny_model_control_token_is_a_single_token(tiny_model_token_ids, token: str) -> None:
    assert len(tiny_model_token_ids[token]) == 1, tiny_model_token_ids[token]


# --- one real `vllm serve` ------------------------------------------------------------------------


def test_tiny_model_reexecs_under_the_venv_that_vllm_cpu_builds() -> None:
    # tiny_model.py may not import gemmaserve (it runs under the vLLM venv), so it repeats the path.
    from gemmaserve import tiny_model

    assert tiny_model.DEFAULT_VLLM_PYTHON == str(vllm_cpu.venv_python())
