"""workload.quantization: fp8, vLLM's online FP8 of a 16-bit checkpoint: the flag each release takes, the weights it
leaves (the public RTX PRO 6000 rows are in tests/unit/test_kv_cache.py), and where it is refused and why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gemmaserve.catalog import CATALOG, GiB
from gemmaserve.plan import linear_weight_elements, plan
from gemmaserve.spec import SpecError, parse_spec
from tests.unit.test_checkpoint import FIXTURES, checkpoint_dir

BASE = {
    "model": "31b",
    "accelerator": {"kind": "h100-80gb", "count": 2},
    "serving": {"tensor_parallel_size": 2},
    "workload": {"max_model_len": 32768},
}


def with_fp8(data: dict, **workload) -> dict:
    return data | {"workload": data.get("workload", {}) | {"quantization": "fp8"} | workload}


def flag(result) -> list[str]:
    argv = result.replicas[0].argv
    at = argv.index("--quantization")
    return argv[at : at + 2]


@pytest.mark.parametrize(
    "version, method", [("0.19.0", "fp8"), ("0.20.0", "fp8_per_tensor"), ("0.32.0", "fp8_per_tensor")]
)
def test_each_release_is_asked_the_way_it_takes_online_fp8(version: str, method: str):
    """0.31.0 stopped taking `--quantization fp8` for a 16-bit checkpoint (Fp8Config: 'no longer supports online
    quantization'); fp8_per_tensor, the online shorthand, exists from 0.20.0 (rule online_fp8_per_tensor)."""
    result = plan(parse_spec(with_fp8(BASE | {"engine": {"vllm_version": version}}))).require_ok()
    assert flag(result) == ["--quantization", method]
    assert result.quantization.method == method and result.quantization.scheme == "fp8-online"


def test_the_weights_halve_on_every_quantized_linear_layer():
    """31B at TP2: the language model's linear weights (29.3 of its 31.3 billion parameters) at 1 byte each; the
    embeddings, norms and the vision tower stay 16-bit; what that frees goes to the KV cache."""
    plain = plan(parse_spec(BASE)).require_ok().replicas[0].capacity
    fp8 = plan(parse_spec(with_fp8(BASE))).require_ok().replicas[0].capacity
    model = CATALOG.model("31b")
    saved = linear_weight_elements(model)
    assert 29.2e9 < saved < 29.4e9
    assert fp8.weights_gib_per_device == pytest.approx(plain.weights_gib_per_device - saved / 2 / GiB, abs=0.01)
    # The V copies of the K=V layers are FP8 too: the load-time buffers shrink by half of them.
    assert fp8.profile.loaded_extra < plain.profile.loaded_extra
    freed = plain.weights_gib_per_device - fp8.weights_gib_per_device
    freed += plain.profile.loaded_extra - fp8.profile.loaded_extra
    assert fp8.available_kv_cache_gib - plain.available_kv_cache_gib == pytest.approx(freed, abs=0.01)
    assert fp8.kv_cache_tokens > 1.35 * plain.kv_cache_tokens


def test_online_fp8_compiles_its_own_graphs():
    plain, fp8 = plan(parse_spec(BASE)).require_ok(), plan(parse_spec(with_fp8(BASE))).require_ok()
    assert plain.replicas[0].cache_key != fp8.replicas[0].cache_key


def test_an_a100_runs_it_weight_only():
    result = plan(parse_spec(with_fp8({"model": "26b-a4b", "accelerator": {"kind": "a100-80gb"}}))).require_ok()
    assert any(
        w.startswith("workload.quantization = 'fp8' (fp8_per_tensor (fp8-online)): a100-80gb (compute capability 8)")
        for w in result.warnings
    )
    h100 = plan(parse_spec(with_fp8({"model": "26b-a4b", "accelerator": {"kind": "h100-80gb"}}))).require_ok()
    assert not any("weight-only" in w for w in h100.warnings)


def refusal(data: dict) -> str:
    result = plan(parse_spec(data))
    assert not result.ok
    return result.refusals[0]


def test_where_it_cannot_run_it_is_refused_with_the_reason(tmp_path: Path):
    tpu = refusal(with_fp8({"model": "e2b", "accelerator": {"kind": "tpu-v6e", "count": 4}}))
    assert tpu.startswith("workload.quantization = 'fp8': tpu-inference 0.32.0 quantizes no 16-bit Gemma 4 weights")
    cpu = refusal(with_fp8({"model": "tiny", "accelerator": {"kind": "cpu"}}))
    assert "runs FP8 weights only on CPUs with AMX" in cpu
    # E2B/E4B's towers (768 and 3072 wide) are quantized too since 0.23.0, which gemmaserve does not count.
    e4b = {"model": "e4b", "accelerator": {"kind": "l4"}}
    assert "quantizes its vision and audio towers" in refusal(with_fp8(e4b))
    older = plan(parse_spec(with_fp8(e4b | {"engine": {"vllm_version": "0.22.1"}}))).require_ok()
    assert flag(older) == ["--quantization", "fp8_per_tensor"]
    # A checkpoint that is quantized already.
    nvfp4 = json.loads((FIXTURES / "published" / "nvidia--Gemma-4-31B-IT-NVFP4.config.json").read_text())
    root = checkpoint_dir(tmp_path / "nvfp4", nvfp4, CATALOG.model("31b").checkpoint_bytes // 3)
    already = refusal(with_fp8({"model": str(root), "accelerator": {"kind": "b200"}}))
    assert already.startswith(f"workload.quantization = 'fp8': {root} is quantized already, modelopt_fp4")


def test_other_values_are_refused_by_name():
    with pytest.raises(SpecError, match="workload.quantization"):
        parse_spec(BASE | {"workload": {"quantization": "int8"}})
