"""The tiny Gemma 4 TEST model the sandbox serves: labelled, tiny, shaped for vLLM's CPU backend."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from gemmaserve.sandbox.demo import sandbox_plan
from gemmaserve.sandbox.tiny_model import DEFAULT_VLLM_PYTHON, SPECIAL_TOKENS, build_tiny_model

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="session")
def tiny_model(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-gemma4"))


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


def test_tiny_model_reexecs_under_the_venv_the_sandbox_serves_from() -> None:
    # tiny_model.py may not import gemmaserve (it runs under the vLLM venv), so it repeats the path.
    assert DEFAULT_VLLM_PYTHON == f"{sandbox_plan().engine.venv}/bin/python"
