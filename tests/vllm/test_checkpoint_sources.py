"""The quantization rules gemmaserve cites for engines it cannot run here are in those releases' sources:
vLLM 0.32.0's ROCm list, tpu-inference 0.32.0's JAX quantization (the path Gemma 4 takes on TPU).

The sources come from PyPI (release_sources.py, cached), read as text and parsed with ast.
"""

from __future__ import annotations

import ast

import pytest
import release_sources

from gemmaserve.plan import ROCM_QUANTIZATION, VLLM_DEFAULT_MM_LIMIT

pytestmark = pytest.mark.network

TPU_INFERENCE = ("tpu-inference", "0.32.0")


def _assigned(lines: list[str], name: str) -> ast.expr:
    """The value assigned to `name` anywhere in the module (a class attribute or a module constant)."""
    tree = ast.parse("\n".join(lines))
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign | ast.Assign):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return node.value
    raise AssertionError(f"{name} is not assigned")


def test_rocm_list_is_vllms() -> None:
    lines = release_sources.read("vllm", "0.32.0", "vllm/platforms/rocm.py")
    assert tuple(ast.literal_eval(_assigned(lines, "supported_quantization"))) == ROCM_QUANTIZATION


def test_gemma4_takes_tpu_inferences_jax_path() -> None:
    lines = release_sources.read(*TPU_INFERENCE, "tpu_inference/models/common/model_loader.py")
    preferred = ast.literal_eval(_assigned(lines, "_VLLM_PREFERRED_ARCHITECTURES").args[0])
    assert not [arch for arch in preferred if arch.startswith("Gemma4")]
    assert any('_MODEL_REGISTRY["Gemma4ForCausalLM"]' in line for line in lines)


def test_tpu_jax_quantization_methods() -> None:
    lines = release_sources.read(*TPU_INFERENCE, "tpu_inference/layers/jax/quantization/__init__.py")
    methods = _assigned(lines, "method_to_config")
    assert sorted(ast.unparse(k) for k in methods.keys) == ["COMPRESSED_TENSORS", "FP8", "MXFP4", "None"]


def test_tpu_compressed_tensors_schemes() -> None:
    text = "\n".join(
        release_sources.read(*TPU_INFERENCE, "tpu_inference/layers/jax/quantization/compressed_tensors.py")
    )
    # MoE experts: FP8 W8A8 only; dense layers: FP8 W8A8 and symmetric pack-quantized INT4 W4A16.
    assert "only fp8 w8a8 is" in text
    assert 'weight_quant.num_bits == 4 and qtype == "int"' in text and "'pack-quantized' is" in text
    assert "blockwise fp8 is not yet supported" in text


def _function(lines: list[str], name: str) -> ast.FunctionDef:
    tree = ast.parse("\n".join(lines))
    return next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)


@pytest.mark.parametrize("version", ["0.19.0", "0.23.0", "0.32.0"])
def test_gemma4_takes_video_through_its_vision_tower(version: str) -> None:
    """Why the plan counts video beside images (plan._vllm_limits) and text_only sets it to 0: Gemma 4's processor
    registers video with every vision tower, vLLM gives a modality left out of --limit-mm-per-prompt 999, and the
    vision tower is skipped only when image and video are both 0."""
    gemma4 = release_sources.read("vllm", version, "vllm/model_executor/models/gemma4_mm.py")
    registered = _function(gemma4, "get_supported_mm_limits")
    keys = {
        node.slice.value
        for node in ast.walk(registered)
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
    }
    assert keys == {"audio", "video"}  # beside {"image": None}; audio only with an audio tower
    towers = [
        ast.literal_eval(call.args[1])
        for call in ast.walk(ast.parse("\n".join(gemma4)))
        if isinstance(call, ast.Call) and getattr(call.func, "attr", "") == "_mark_tower_model"
    ]
    assert {"image", "video"} in towers
    default = _function(release_sources.read("vllm", version, "vllm/config/multimodal.py"), "get_limit_per_prompt")
    returned = [
        n.value.value for n in ast.walk(default) if isinstance(n, ast.Return) and isinstance(n.value, ast.Constant)
    ]
    assert VLLM_DEFAULT_MM_LIMIT in returned
