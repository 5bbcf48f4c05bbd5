"""The checkpoints users bring, served for real by vLLM's CPU build from gemmaserve's plan: a fine-tune of the tiny
test model under its own name with a LoRA adapter beside it, an INT8 W8A8 (compressed-tensors) and an AWQ 4-bit
quantization, and the same language model as a Gemma 4 Unified checkpoint. vLLM's own code first judges that the
quantized weights decode to the model's.

Each server runs exactly the plan's argv and environment (the venv's bin first on PATH, so the plan's `vllm` is the
venv's), bound to 127.0.0.1 on a free port, one at a time, stopped by its recorded PID; the OpenAI SDK asks it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from gemmaserve.plan import SHM_CACHE_ROOT, Plan, ReplicaPlan, plan
from gemmaserve.sandbox.profile import DEFAULT_DATA, TINY_MODEL_DIR
from gemmaserve.sandbox.tiny_model import build_tiny_model
from gemmaserve.sandbox.tiny_variants import ensure_variant
from gemmaserve.sources import spec_from_host_data

pytestmark = pytest.mark.vllm

FINE_TUNE, ADAPTER, UNIFIED = "tiny-gemma4-ft", "tiny-gemma4-lora", "tiny-gemma4-unified"
# Each quantized variant: its directory, what the plan reads from it, vLLM's method in its engine config line and the
# kernel its CPU build logs choosing (compressed-tensors: kernels/linear/__init__.py; AWQ: auto_awq.py).
QUANTIZED = {
    "w8a8": (
        "tiny-gemma4-w8a8",
        "compressed-tensors",
        "int8-w8a8",
        "compressed-tensors",
        ("Selected CPUInt8ScaledMMLinearKernel for CompressedTensorsW8A8Int8"),
    ),
    "awq": (
        "tiny-gemma4-awq",
        "auto_awq",
        "int4-w4a16",
        "awq",
        "Using CPUWNA16LinearKernel for AutoAWQMarlinLinearMethod",
    ),
}
# Seconds a server may take to answer /health (about 40 s alone on 2 cores; more beside other tests) and to stop.
START_TIMEOUT = 300
STOP_TIMEOUT = 60
PROMPT = [{"role": "user", "content": "What is the weather in Paris?"}]
# The first request after a start pays vLLM's CPU warm-up; the next ones show the steady answer time.
ORDINALS = ("first", "second", "third")


@pytest.fixture(scope="module")
def variants(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The variants of the tiny test model, built once per recipe next to it (a temporary directory where that
    is not writable)."""
    if not (TINY_MODEL_DIR / "gemmaserve_test_model.json").is_file():
        build_tiny_model(TINY_MODEL_DIR)
    root = TINY_MODEL_DIR.parent if os.access(TINY_MODEL_DIR.parent, os.W_OK) else tmp_path_factory.mktemp("variants")
    built = {}
    names = {
        "fine-tune": FINE_TUNE,
        "lora": ADAPTER,
        "unified": UNIFIED,
        **{variant: q[0] for variant, q in QUANTIZED.items()},
    }
    for variant, name in names.items():
        start = time.perf_counter()
        built[name], fresh = ensure_variant(variant, TINY_MODEL_DIR, root / name, log=lambda line: print(f"    {line}"))
        if fresh:
            print(f"[figure] {variant} variant of the tiny model built in {time.perf_counter() - start:.1f} s")
    return built


def served_plan(model: Path, adapters: dict[str, Path] | None = None) -> Plan:
    """The sandbox profile's plan for a checkpoint directory (and adapters), on a free loopback port. Tool calling and
    reasoning are off: their --chat-template names the file the vllm role installs on hosts, and no role ran here (the
    checkpoint's own chat template serves)."""
    data = {
        **DEFAULT_DATA,
        "gemmaserve_model": str(model),
        "gemmaserve_workload": {**DEFAULT_DATA["gemmaserve_workload"], "tool_calling": False, "reasoning": False},
        "gemmaserve_serving": {
            "base_port": free_port(),
            "lora_adapters": [{"name": name, "source": str(path)} for name, path in (adapters or {}).items()],
        },
    }
    return plan(spec_from_host_data(data, "test")).require_ok()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def serving(replica: ReplicaPlan, vllm_python: Path, log_path: Path) -> Iterator[float]:
    """`vllm serve` with the replica's argv and env until /health answers; yields the seconds that took. Stopped by
    its PID (its own process group: vLLM's engine core is a child) in every case."""
    caches = {Path(v) for v in replica.env.values() if v.startswith(f"{SHM_CACHE_ROOT}/")}
    for cache in caches:  # the vllm role creates the replica's cache directories on hosts
        cache.mkdir(parents=True, exist_ok=True)
    env = {"PATH": f"{vllm_python.parent}:/usr/local/bin:/usr/bin:/bin", "HOME": str(Path.home()), **replica.env}
    assert replica.address == "127.0.0.1" and replica.argv[0] == "vllm"
    start = time.perf_counter()
    with log_path.open("w") as log:
        server = subprocess.Popen(replica.argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        while True:
            if server.poll() is not None:
                pytest.fail(f"vLLM exited {server.returncode} before /health answered:\n{log_tail(log_path)}")
            if time.perf_counter() - start > START_TIMEOUT:
                pytest.fail(f"vLLM did not answer /health within {START_TIMEOUT} s:\n{log_tail(log_path)}")
            try:
                with opener.open(replica.health_url, timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            time.sleep(1)
        yield time.perf_counter() - start
    finally:
        stop(server)
        for cache in caches:
            shutil.rmtree(cache.parent, ignore_errors=True)


def stop(server: subprocess.Popen) -> None:
    """SIGTERM to the server's PID (it stops its engine core itself), SIGKILL to its group past STOP_TIMEOUT; then
    whatever is left in the group it leads (nothing, normally)."""
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(STOP_TIMEOUT)
    try:
        os.killpg(server.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def log_tail(path: Path, lines: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def client(replica: ReplicaPlan):
    from openai import DefaultHttpxClient, OpenAI

    # vLLM itself takes any key without --api-key (keys are HAProxy's job on hosts); plain HTTP on loopback.
    return OpenAI(
        base_url=f"{replica.url}/v1", api_key="unused", http_client=DefaultHttpxClient(trust_env=False), max_retries=0
    )


def ask(replica: ReplicaPlan, model: str) -> tuple[int, object, float]:
    """(HTTP status, parsed completion, seconds) of one greedy chat completion under `model`."""
    start = time.perf_counter()
    raw = client(replica).chat.completions.with_raw_response.create(
        model=model, messages=PROMPT, max_tokens=8, temperature=0, logprobs=True, timeout=120
    )
    return raw.status_code, raw.parse(), time.perf_counter() - start


def kv_cache_tokens(log_path: Path) -> int:
    """The KV-cache tokens vLLM's CPU worker reports (vllm/v1/core/kv_cache_utils.py, "CPU KV cache size")."""
    found = re.search(r"CPU KV cache size: ([\d,]+) tokens", log_path.read_text())
    assert found, log_tail(log_path)
    return int(found[1].replace(",", ""))


def served_models(replica: ReplicaPlan) -> set[str]:
    return {m.id for m in client(replica).models.list()}


def test_fine_tune_and_its_lora_adapter_are_served_under_their_own_names(
    variants: dict[str, Path], vllm_python: Path, tmp_path: Path
) -> None:
    planned = served_plan(variants[FINE_TUNE], {ADAPTER: variants[ADAPTER]})
    replica = planned.replicas[0]
    assert planned.model.hf_id == FINE_TUNE and planned.quantization is None
    assert f"{ADAPTER}={variants[ADAPTER]}" in replica.argv
    with serving(replica, vllm_python, tmp_path / "vllm.log") as ready:
        print(f"[figure] fine-tune + LoRA adapter (rank 8): vLLM CPU ready in {ready:.1f} s")
        assert served_models(replica) == {FINE_TUNE, ADAPTER}
        answers = {}
        for turn, model in enumerate((FINE_TUNE, ADAPTER, FINE_TUNE)):
            status, answers[model], seconds = ask(replica, model)
            print(f"[figure] {model}: chat completion of 8 tokens in {seconds:.2f} s ({ORDINALS[turn]} request)")
            assert status == 200 and answers[model].model == model
            assert answers[model].usage.completion_tokens > 0
    # The adapter changes what the model computes: the same greedy request gives other tokens or other logprobs.
    base, adapted = ([(t.token, round(t.logprob, 4)) for t in a.choices[0].logprobs.content] for a in answers.values())
    assert base != adapted
    assert f"Loaded new LoRA adapter: name '{ADAPTER}'" in (tmp_path / "vllm.log").read_text()
    # Planned exactly like its base: the KV cache the plan read from the checkpoint's config.json is vLLM's.
    assert kv_cache_tokens(tmp_path / "vllm.log") == replica.capacity.kv_cache_tokens


@pytest.mark.parametrize("variant", list(QUANTIZED))
def test_quantized_checkpoint_is_served_quantized(
    variant: str, variants: dict[str, Path], vllm_python: Path, tmp_path: Path
) -> None:
    name, method, scheme, vllm_method, kernel_line = QUANTIZED[variant]
    planned = served_plan(variants[name])
    replica = planned.replicas[0]
    assert planned.quantization is not None
    assert (planned.quantization.method, planned.quantization.scheme) == (method, scheme)
    # The plan's CPU rule (CPU_SERVED_SCHEMES) says it runs here without a warning: this test is its evidence.
    assert not [w for w in planned.warnings if "is quantized" in w], planned.warnings
    # The plan counts the packed weights: fewer bytes than the 16-bit fine-tune of the same architecture.
    assert planned.model.checkpoint_bytes < served_plan(variants[FINE_TUNE]).model.checkpoint_bytes
    with serving(replica, vllm_python, tmp_path / "vllm.log") as ready:
        print(f"[figure] {name} ({method} {scheme}): vLLM CPU ready in {ready:.1f} s")
        assert served_models(replica) == {name}
        for turn in range(2):
            status, answer, seconds = ask(replica, name)
            print(f"[figure] {name}: chat completion of 8 tokens in {seconds:.2f} s ({ORDINALS[turn]} request)")
            assert status == 200 and answer.model == name and answer.usage.completion_tokens > 0
    log = (tmp_path / "vllm.log").read_text()
    # vLLM's engine config line names the method it detected; the kernel line names the CPU GEMM it runs.
    assert f"quantization={vllm_method}," in log, log_tail(tmp_path / "vllm.log")
    assert kernel_line in log, log_tail(tmp_path / "vllm.log")
    assert kv_cache_tokens(tmp_path / "vllm.log") == replica.capacity.kv_cache_tokens


def test_unified_checkpoint_is_served_and_planned_like_its_language_model(
    variants: dict[str, Path], vllm_python: Path, tmp_path: Path
) -> None:
    """A Gemma 4 Unified checkpoint (no vision tower) planned from its own config.json: vLLM resolves the Unified
    architecture, answers, and its KV cache is the plan's, the same as the tiny model's whose language model it holds."""
    planned = served_plan(variants[UNIFIED])
    replica = planned.replicas[0]
    assert planned.model.unified and planned.quantization is None and not planned.warnings, planned.warnings
    assert replica.capacity.kv_cache_tokens == served_plan(TINY_MODEL_DIR).replicas[0].capacity.kv_cache_tokens
    with serving(replica, vllm_python, tmp_path / "vllm.log") as ready:
        print(f"[figure] {UNIFIED}: vLLM CPU ready in {ready:.1f} s")
        assert served_models(replica) == {UNIFIED}
        status, answer, seconds = ask(replica, UNIFIED)
        print(f"[figure] {UNIFIED}: chat completion of 8 tokens in {seconds:.2f} s (first request)")
        assert status == 200 and answer.model == UNIFIED and answer.usage.completion_tokens > 0
    log = (tmp_path / "vllm.log").read_text()
    assert "Resolved architecture: Gemma4UnifiedForConditionalGeneration" in log, log_tail(tmp_path / "vllm.log")
    assert kv_cache_tokens(tmp_path / "vllm.log") == replica.capacity.kv_cache_tokens


# vLLM's own decoding of each quantized layer against the tiny model's 16-bit weights: int8 x weight_scale for W8A8;
# for AWQ, auto_awq._convert_awq_to_standard_format (what the CPU build runs before its kernel) and then the standard
# layout it produces (qweight packed along the input, qzeros along the output, 4 bits in order). Each decoded weight
# must be within half a quantization step (and bf16 rounding) of the original.
DECODE_JUDGE = r"""
import json, sys, torch
from safetensors.torch import load_file
import vllm.model_executor.parameter as parameter
from vllm.model_executor.layers.quantization.auto_awq import _convert_awq_to_standard_format
# One rank, without starting vLLM's distributed groups: what the converted parameters ask at construction.
parameter.get_tensor_model_parallel_rank, parameter.get_tensor_model_parallel_world_size = (lambda: 0), (lambda: 1)
base, w8a8, awq = (load_file(p + "/model.safetensors") for p in sys.argv[1:4])
shifts = torch.arange(0, 32, 4, dtype=torch.int32)
def nibbles(packed, dim):  # packed int32 -> its 4-bit values, unpacked along dim
    values = (packed.unsqueeze(-1) >> shifts) & 15
    return values.movedim(-1, dim + 1).flatten(dim, dim + 1) if dim == 0 else values.flatten(1)
worst = {"w8a8": 0.0, "awq": 0.0}
for name, weight in base.items():
    module = name.removesuffix(".weight")
    weight = weight.float()
    if module + ".weight_scale" in w8a8:
        scale = w8a8[module + ".weight_scale"]
        error = ((w8a8[name].float() * scale - weight).abs() / scale).max().item()
        worst["w8a8"] = max(worst["w8a8"], error)
    if module + ".qweight" in awq:
        layer = torch.nn.Module()
        layer.qweight = torch.nn.Parameter(awq[module + ".qweight"], requires_grad=False)
        layer.qzeros = torch.nn.Parameter(awq[module + ".qzeros"], requires_grad=False)
        _convert_awq_to_standard_format(layer, "qweight", "qzeros", 4)
        q = nibbles(layer.qweight.data, 0)            # [in, out]
        zeros = nibbles(layer.qzeros.data, 0).t()      # [groups, out]
        scales = awq[module + ".scales"].float()       # [groups, out]
        group = q.shape[0] // scales.shape[0]
        decoded = (q - zeros.repeat_interleave(group, 0)) * scales.repeat_interleave(group, 0)
        error = ((decoded - weight.t()).abs() / scales.repeat_interleave(group, 0)).max().item()
        worst["awq"] = max(worst["awq"], error)
print(json.dumps(worst))
"""


def test_vllm_decodes_the_quantized_weights_to_the_models(variants: dict[str, Path], vllm_python: Path) -> None:
    dirs = [TINY_MODEL_DIR, *(variants[QUANTIZED[v][0]] for v in ("w8a8", "awq"))]
    proc = subprocess.run(
        [str(vllm_python), "-c", DECODE_JUDGE, *map(str, dirs)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    worst = json.loads(proc.stdout.splitlines()[-1])
    # Half a step of rounding (measured 0.500 and 0.503); AWQ's float16 scales add a little.
    assert worst["w8a8"] <= 0.51 and worst["awq"] <= 0.55, worst


def test_variants_are_cached_by_recipe(variants: dict[str, Path]) -> None:
    for name, path in variants.items():
        stamp = json.loads((path / "gemmaserve_test_model.json").read_text())
        again, built = ensure_variant(stamp["variant"], TINY_MODEL_DIR, path, log=lambda line: None)
        assert (again, built) == (path, False), name
