"""The vLLM CPU build: flag checks with vLLM's own parser, the tiny test model, and a real `vllm serve`."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from gemmaserve import vllm_argcheck, vllm_cpu
from gemmaserve.tiny_model import SPECIAL_TOKENS, build_tiny_model

pytestmark = pytest.mark.vllm

STARTUP_TIMEOUT_S = 240  # measured here: 39 s with --enforce-eager, 85 s with torch.compile
REQUEST_TIMEOUT_S = 60
STOP_TIMEOUT_S = 30


def tiny_model_serve_argv(model: Path, port: int) -> list[str]:
    """The `vllm serve` argv that serves the tiny test model on CPU (what the cpu profile renders)."""
    return [
        "vllm", "serve", str(model),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--served-model-name", "tiny",
        "--dtype", "bfloat16",
        "--max-model-len", "1024",
        # torch.compile adds about 45 s to a cold start and nothing a test model needs.
        "--enforce-eager",
        # Text only: no encoder profiling, no image/audio/video budget.
        "--limit-mm-per-prompt", '{"image": 0, "audio": 0, "video": 0}',
        "--reasoning-parser", "gemma4",
        "--tool-call-parser", "gemma4",
        "--enable-auto-tool-choice",
    ]  # fmt: skip


def vllm_cpu_env(state_dir: Path) -> dict[str, str]:
    """Environment for vLLM on CPU: bounded KV cache, caches and temp files under state_dir."""
    for name in ("cache", "tmp"):
        (state_dir / name).mkdir(parents=True, exist_ok=True)
    return {
        **os.environ,
        # GiB of KV cache; NUMA node 0 has only 8.7 GiB on the CI machine.
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CACHE_ROOT": str(state_dir / "cache" / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(state_dir / "cache" / "inductor"),
        "XDG_CACHE_HOME": str(state_dir / "cache"),
        "TMPDIR": str(state_dir / "tmp"),
        # Model hubs are unreachable, and nothing should phone home from a test.
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    if not vllm_cpu.is_built():
        reason = (
            f"the vLLM CPU venv {vllm_cpu.venv_path()} is missing or stale; "
            "build it with `python -m gemmaserve.vllm_cpu build`"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return vllm_cpu.venv_python()


@pytest.fixture(scope="session")
def tiny_model(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-gemma4"))


# --- flag validation with vLLM's own parser ---------------------------------------------------------

ARGCHECK_CASES = {
    "good": (["vllm", "serve", "google/gemma-4-31b-it", "--gpu-memory-utilization", "0.9",
              "--reasoning-parser", "gemma4", "--tool-call-parser", "gemma4", "--enable-auto-tool-choice"], True),
    "tiny_model_argv": (tiny_model_serve_argv(Path("/models/tiny"), 8000), True),
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
    return proc.returncode, dict(zip(names, results))


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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _http(method: str, url: str, body: dict | None = None) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _stop(process: subprocess.Popen) -> None:
    # The server runs in its own session (process group == its PID) with EngineCore and Worker children:
    # signal that group, by the PID we recorded, and escalate if it does not stop.
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=STOP_TIMEOUT_S)
    # EngineCore and Worker still carry the group id: give them a moment to finish exiting, then make sure.
    deadline = time.monotonic() + 10
    with contextlib.suppress(ProcessLookupError):
        while time.monotonic() < deadline:
            os.killpg(process.pid, 0)
            time.sleep(0.2)
        os.killpg(process.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def vllm_server(request, vllm_python: Path, tiny_model: Path, tmp_path_factory) -> str:
    state = tmp_path_factory.mktemp("vllm-state")
    port = _free_port()
    argv = tiny_model_serve_argv(tiny_model, port)
    argv[0] = str(vllm_python.parent / "vllm")
    log_path = state / "vllm.log"
    log = open(log_path, "w")
    process = subprocess.Popen(
        argv, env=vllm_cpu_env(state), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )

    def finalize() -> None:
        _stop(process)
        log.close()

    request.addfinalizer(finalize)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"vllm serve exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            if _http("GET", f"{base}/health")[0] == 200:
                return base
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail(f"vllm serve not healthy after {STARTUP_TIMEOUT_S} s:\n{log_path.read_text()[-4000:]}")


def test_serve_lists_the_model(vllm_server: str) -> None:
    status, body = _http("GET", f"{vllm_server}/v1/models")
    assert status == 200, body
    assert [model["id"] for model in json.loads(body)["data"]] == ["tiny"]


def test_serve_chat_completion(vllm_server: str) -> None:
    status, body = _http(
        "POST",
        f"{vllm_server}/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8, "temperature": 0},
    )
    assert status == 200, body
    response = json.loads(body)
    assert response["usage"]["completion_tokens"] > 0
    assert response["choices"][0]["message"]["role"] == "assistant"


# Free-form strings are constrained by a pattern: xgrammar lets raw control characters into JSON strings,
# which a model with random weights readily picks and which strict JSON rejects.
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_serve_json_schema_output_is_valid(vllm_server: str) -> None:
    status, body = _http(
        "POST",
        f"{vllm_server}/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Describe a person as JSON."}],
            "max_tokens": 200,
            "temperature": 0,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "person", "strict": True, "schema": PERSON_SCHEMA},
            },
        },
    )
    assert status == 200, body
    choice = json.loads(body)["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    person = json.loads(choice["message"]["content"])
    # The schema above, checked by hand (the test interpreter need not have jsonschema).
    assert set(person) == {"name", "age"}
    assert re.fullmatch(PERSON_SCHEMA["properties"]["name"]["pattern"], person["name"])
    assert isinstance(person["age"], int) and not isinstance(person["age"], bool)
    assert 0 <= person["age"] <= 150


def test_serve_accepts_tools(vllm_server: str) -> None:
    weather_tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
    status, body = _http(
        "POST",
        f"{vllm_server}/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Weather in Tokyo?"}],
            "tools": [weather_tool],
            "tool_choice": "auto",
            "max_tokens": 16,
            "temperature": 0,
        },
    )
    assert status == 200, body
    assert json.loads(body)["choices"][0]["message"]["role"] == "assistant"


def test_serve_metrics_report_kv_cache_usage(vllm_server: str) -> None:
    status, body = _http("GET", f"{vllm_server}/metrics")
    assert status == 200
    assert "vllm:kv_cache_usage_perc" in body


def test_tiny_model_reexecs_under_the_venv_that_vllm_cpu_builds() -> None:
    # tiny_model.py may not import gemmaserve (it runs under the vLLM venv), so it repeats the path.
    from gemmaserve import tiny_model

    assert tiny_model.DEFAULT_VLLM_PYTHON == str(vllm_cpu.venv_python())
