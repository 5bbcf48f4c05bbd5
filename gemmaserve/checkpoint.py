"""Any Gemma 4 checkpoint as a catalog.ModelInfo: read from its config.json, weight index and adapter configs.

The files are read from a local directory or the local Hugging Face cache only; planning never downloads.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from gemmaserve.catalog import CATALOG, AttentionShape, ModelInfo

# A Hugging Face repository id: OWNER/NAME of letters, digits, '-', '_' and '.'
# (huggingface_hub.utils.validate_repo_id).
HUB_REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
# A checkpoint in Cloud Storage: gs://BUCKET/PATH (bucket naming: cloud.google.com/storage/docs/buckets#naming, no
# dotted names), read where it is: planned from its small files, served by vLLM's Run:ai streamer.
GCS_CHECKPOINT = re.compile(r"gs://[a-z0-9][a-z0-9_-]{1,61}[a-z0-9](/[A-Za-z0-9._-]+)+/?")
# Where `gemmaserve plan --fetch` keeps a gs:// checkpoint's small files (config.json, the weight index):
# GCS_CACHE/<bucket>/<path>/<file>. Planning reads only this cache, never the network.
GCS_CACHE = Path(os.environ.get("GEMMASERVE_GCS_CACHE", Path.home() / ".cache" / "gemmaserve" / "gcs"))
# What vLLM 0.32.0 serves Gemma 4 checkpoints as (vllm/model_executor/models/registry.py at v0.32.0). The Unified
# variant (encoder-free: patches and audio frames projected straight into the language model) runs the same
# Gemma4ForCausalLM language model (models/gemma4_unified.py subclasses gemma4_mm's model), so its KV cache is
# planned from its text_config like any other; vLLM serves it since 0.23.0 (vllm_releases rule gemma4_unified).
UNIFIED_ARCHITECTURE = "Gemma4UnifiedForConditionalGeneration"
GEMMA4_ARCHITECTURES = ("Gemma4ForConditionalGeneration", "Gemma4ForCausalLM", UNIFIED_ARCHITECTURE)
GEMMA4_MODEL_TYPES = ("gemma4", "gemma4_text", "gemma4_unified")
# Model types whose language model's config is their text_config (the others are a text config themselves).
MULTIMODAL_MODEL_TYPES = ("gemma4", "gemma4_unified")
# The files planning reads; the weight index is absent from single-file checkpoints (E2B, E4B).
CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_WEIGHTS_FILE = "model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"


class CheckpointError(ValueError):
    """A checkpoint gemmaserve cannot plan: the message names the file or field, the value and what is allowed."""


@dataclass(frozen=True)
class CheckpointRef:
    """Where a checkpoint's files are: a local directory, or a hub repository (at a revision) in the HF cache."""

    name: str
    revision: str | None = None

    @property
    def is_local(self) -> bool:
        return self.name.startswith("/")

    @property
    def is_gcs(self) -> bool:
        return self.name.startswith("gs://")

    @property
    def served_name(self) -> str:
        """A directory's or a bucket path's last component (--served-model-name), else the hub id."""
        return self.name.rstrip("/").rsplit("/", 1)[-1] if self.is_local or self.is_gcs else self.name

    def describe(self) -> str:
        return self.name if self.is_local or self.is_gcs else f"{self.name}@{self.revision or 'main'}"

    def download_hint(self, files: tuple[str, ...]) -> str:
        if self.is_gcs:
            return (
                f"gemmaserve plan --fetch (it copies {', '.join(files)} from {self.name} to {gcs_cache_dir(self.name)})"
            )
        revision = f" --revision {self.revision}" if self.revision else ""
        return f"huggingface-cli download {self.name}{revision} {' '.join(files)}"

    def read_text(self, filename: str) -> str | None:
        """The file's text, or None when it is not local (no network: a hub is never asked)."""
        path = self.path(filename)
        return path.read_text() if path else None

    def path(self, filename: str) -> Path | None:
        if self.is_local or self.is_gcs:
            path = (gcs_cache_dir(self.name) if self.is_gcs else Path(self.name)) / filename
            return path if path.is_file() else None
        # The cache lookup huggingface_hub itself uses (snapshots/<commit> resolved through refs/<revision>);
        # imported here so the core loads it only when a hub checkpoint is planned.
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(self.name, filename, revision=self.revision)
        return Path(found) if isinstance(found, str) else None


def gcs_cache_dir(uri: str) -> Path:
    """Where a gs:// checkpoint's small files are kept for planning."""
    return GCS_CACHE / uri.removeprefix("gs://").strip("/")


def read_json(ref: CheckpointRef, filename: str, needed: tuple[str, ...]) -> dict[str, Any]:
    text = ref.read_text(filename)
    if text is None:
        if ref.is_local:
            where, fetch = f"directory {ref.name} has no {filename}", ""
        elif ref.is_gcs:
            where = f"{filename} of {ref.name} is not in the local copy {gcs_cache_dir(ref.name)} (planning does not download)"
            fetch = f"; fetch the small files first: {ref.download_hint(needed)}"
        else:
            where = (
                f"{filename} of {ref.describe()} is not in the local Hugging Face cache (planning does not download)"
            )
            fetch = f"; fetch the small files first: {ref.download_hint(needed)} (or `gemmaserve plan --fetch`)"
        raise CheckpointError(f"{where}{fetch}")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{ref.describe()}/{filename} is not JSON: {error}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{ref.describe()}/{filename}: must be a JSON object")
    return data


@dataclass(frozen=True)
class Quantization:
    """A checkpoint's quantization as vLLM 0.32.0 reads it from config.json's quantization_config."""

    # The method as vLLM names it (a key of QUANTIZATION_METHODS) when it detects the checkpoint.
    method: str
    # What the weights are: "fp8-w8a8", "fp8-w8a16", "int8-w8a8", "nvfp4", "int4-w4a16", "fp8-block" ...
    scheme: str
    # Compute capability (major*10+minor) below which vLLM refuses to load it, and at or above which the
    # kernels run natively (below: weight-only Marlin kernels, activations in 16 bits).
    min_capability: int
    native_capability: int
    source: str
    # vLLM detects every method below from config.json: no --quantization flag is needed.
    flags: tuple[str, ...] = ()
    # What vLLM turns --kv-cache-dtype auto into for this checkpoint (None: the model's dtype).
    kv_cache_dtype: str | None = None
    # Which layers tpu-inference 0.32.0's JAX path (the one Gemma 4 runs on TPU) has a method for:
    # "all", "dense" (not MoE experts) or "none" (TPU_QUANTIZATION_SOURCE).
    tpu_layers: str = "none"

    def describe(self) -> str:
        return f"{self.method} ({self.scheme})"


_VLLM_QUANT = "vllm/model_executor/layers/quantization"
# tpu-inference 0.32.0 (what vllm-tpu 0.32.0 pins) serves Gemma 4 on its JAX path (models/common/model_loader.py
# resolve_model_architecture: flax_nnx unless the architecture is vLLM-preferred), whose quantization is
# get_tpu_quantization_config: unquantized, fp8, mxfp4, compressed-tensors; and in compressed-tensors
# (layers/jax/quantization/compressed_tensors.py get_quant_method) FP8 W8A8 for every layer, symmetric
# pack-quantized INT4 W4A16 (no actorder group) for dense layers only; anything else raises NotImplementedError.
TPU_QUANTIZATION_SOURCE = (
    "tpu_inference/layers/jax/quantization/__init__.py get_tpu_quantization_config and compressed_tensors.py "
    "get_quant_method, tpu-inference 0.32.0"
)
_CT = f"{_VLLM_QUANT}/compressed_tensors"


def _ct_args(group: dict[str, Any], key: str) -> dict[str, Any] | None:
    value = group.get(key)
    return value if isinstance(value, dict) else None


_TPU_LAYERS = ("none", "dense", "all")


def _compressed_tensors(config: dict[str, Any]) -> Quantization:
    """Each config group's scheme as CompressedTensorsConfig._get_scheme_from_parts picks it; with several groups
    (mixed precision) the most demanding one decides capability and TPU support."""
    groups = config.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups or not all(isinstance(g, dict) for g in groups.values()):
        raise CheckpointError(
            "quantization_config.config_groups: missing; a compressed-tensors config names its schemes"
        )
    schemes = [_ct_group(name, group, str(config.get("format", ""))) for name, group in groups.items()]
    first = schemes[0]
    return replace(
        first,
        scheme="+".join(dict.fromkeys(q.scheme for q in schemes)),
        min_capability=max(q.min_capability for q in schemes),
        native_capability=max(q.native_capability for q in schemes),
        source="; ".join(dict.fromkeys(q.source for q in schemes)),
        tpu_layers=min((q.tpu_layers for q in schemes), key=_TPU_LAYERS.index),
    )


def _ct_group(name: str, group: dict[str, Any], fmt: str) -> Quantization:
    weights, inputs = _ct_args(group, "weights"), _ct_args(group, "input_activations")
    if weights is None:
        raise CheckpointError(f"quantization_config.config_groups.{name}.weights: missing")
    w_type, w_bits = weights.get("type"), weights.get("num_bits")
    source = f"{_CT}/compressed_tensors.py _get_scheme_from_parts, v0.32.0"
    if fmt == "nvfp4-pack-quantized" or (w_type == "float" and w_bits == 4 and weights.get("group_size") == 16):
        # CompressedTensorsW4A4Fp4.get_min_capability 75; native FP4 GEMMs from SM100 (Blackwell,
        # utils/nvfp4_utils.py cutlass_fp4_supported), older GPUs run the NVFP4 Marlin kernel.
        scheme = "nvfp4" if inputs else "nvfp4-w4a16"
        return Quantization(
            "compressed-tensors", scheme, 75, 100, f"{source}; schemes/compressed_tensors_w4a4_nvfp4.py"
        )
    if w_type == "float" and w_bits == 8:
        if inputs is None:
            return Quantization(
                "compressed-tensors", "fp8-w8a16", 75, 75, f"{source}; schemes/compressed_tensors_w8a16_fp8.py"
            )
        # CompressedTensorsW8A8Fp8.get_min_capability 89; below it vLLM falls back to W8A16 (75).
        dynamic = "dynamic" if inputs.get("dynamic") else "static"
        # Block-wise FP8 is not implemented for the JAX path's merged (gate/up) linears.
        tpu = "none" if weights.get("block_structure") else "all"
        return Quantization(
            "compressed-tensors",
            f"fp8-w8a8-{dynamic}",
            75,
            89,
            f"{source}; schemes/compressed_tensors_w8a8_fp8.py",
            tpu_layers=tpu,
        )
    if w_type == "int" and w_bits == 8 and inputs is not None:
        return Quantization(
            "compressed-tensors", "int8-w8a8", 75, 75, f"{source}; schemes/compressed_tensors_w8a8_int8.py"
        )
    if w_type == "int" and w_bits in (4, 8) and inputs is None:
        tpu_w4a16 = (
            w_bits == 4
            and weights.get("symmetric", True)
            and not weights.get("dynamic")
            and weights.get("strategy") in ("group", "channel")
            and weights.get("actorder") != "group"
            and (group.get("format") or fmt) in ("pack-quantized", "")
        )
        return Quantization(
            "compressed-tensors",
            f"int{w_bits}-w{w_bits}a16",
            75,
            75,
            f"{source}; schemes/compressed_tensors_wNa16.py",
            tpu_layers="dense" if tpu_w4a16 else "none",
        )
    raise CheckpointError(
        f"quantization_config.config_groups.{name}: compressed-tensors weights {w_type}{w_bits} (format {fmt!r}): gemmaserve has not "
        "checked this scheme against vLLM's source; allowed: FP8 (W8A8 static/dynamic, W8A16), INT8 W8A8, "
        "W4A16/W8A16 INT, NVFP4"
    )


# vllm/utils/torch_utils.py MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP (v0.32.0).
MODELOPT_KV_CACHE_DTYPES = {"fp8": "fp8_e4m3", "nvfp4": "nvfp4"}


def _modelopt_kv_cache_dtype(config: dict[str, Any]) -> str | None:
    """--kv-cache-dtype auto as vLLM resolves it for a ModelOpt checkpoint (torch_utils.py
    get_kv_cache_quant_algo_string, applied by EngineArgs.create_engine_config at v0.32.0); "auto" for a value
    vLLM does not know, None when the checkpoint names none."""
    inner = config.get("quantization") or config
    algo = (
        inner.get("kv_cache_scheme")
        or config.get("kv_cache_scheme")
        or inner.get("kv_cache_quant_algo")
        or config.get("kv_cache_quant_algo")
    )
    if isinstance(algo, dict):
        if algo.get("dynamic") is False and algo.get("num_bits") == 8 and algo.get("type") == "float":
            algo = "fp8"
        elif algo.get("num_bits") == 4 and algo.get("type") == "float":
            algo = "nvfp4"
        else:
            return "auto"
    if isinstance(algo, str):
        return MODELOPT_KV_CACHE_DTYPES.get(algo.lower(), "auto")
    return None


def _modelopt(config: dict[str, Any]) -> Quantization:
    # ModelOpt writes quant_algo at the top (hf_quant_config.json style) or under "quantization".
    algo = str(config.get("quant_algo") or (config.get("quantization") or {}).get("quant_algo") or "").upper()
    source = f"{_VLLM_QUANT}/modelopt.py override_quantization_method, v0.32.0"
    kv = _modelopt_kv_cache_dtype(config)
    kv = None if kv == "auto" else kv
    if "NVFP4" in algo or "FP4" in algo:
        # ModelOptNvFp4Config.get_min_capability 75 (Marlin W4A16 below Blackwell's native FP4).
        return Quantization(
            "modelopt_fp4", "nvfp4", 75, 100, f"{source}; ModelOptNvFp4Config.get_min_capability", kv_cache_dtype=kv
        )
    if algo == "FP8":
        # ModelOptFp8Config.get_min_capability 80; FP8 GEMMs where supports_fp8 (cc >= 8.9).
        return Quantization(
            "modelopt", "fp8", 80, 89, f"{source}; ModelOptFp8Config.get_min_capability", kv_cache_dtype=kv
        )
    raise CheckpointError(f"quantization_config.quant_algo = {algo!r}: allowed for ModelOpt: FP8, NVFP4")


def parse_quantization(config: dict[str, Any] | None) -> Quantization | None:
    """config.json's quantization_config -> what vLLM loads, or None for an unquantized checkpoint."""
    if not config:
        return None
    if not isinstance(config, dict):
        raise CheckpointError(f"quantization_config = {config!r}: must be a JSON object")
    method = str(config.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _compressed_tensors(config)
    if method == "modelopt":
        return _modelopt(config)
    if method == "fp8":
        # Fp8Config.get_min_capability 75: W8A8 FP8 GEMMs where the platform supports_fp8 (cc >= 8.9,
        # platforms/cuda.py), Marlin weight-only FP8 below.
        scheme = "fp8-block" if config.get("weight_block_size") else "fp8"
        return Quantization("fp8", scheme, 75, 89, f"{_VLLM_QUANT}/fp8.py Fp8Config, v0.32.0", tpu_layers="all")
    if method == "awq":
        # AutoAWQConfig.override_quantization_method names it auto_awq on GPUs (on the CPU build it stays awq,
        # the same config class); get_min_capability 75.
        bits = config.get("bits", config.get("w_bit", 4))
        return Quantization(
            "auto_awq", f"int{bits}-w{bits}a16", 75, 75, f"{_VLLM_QUANT}/auto_awq.py AutoAWQConfig, v0.32.0"
        )
    if method == "gptq":
        # AutoGPTQConfig.override_quantization_method: auto_gptq; get_min_capability 60.
        bits = config.get("bits", 4)
        return Quantization(
            "auto_gptq", f"int{bits}-w{bits}a16", 60, 60, f"{_VLLM_QUANT}/auto_gptq.py AutoGPTQConfig, v0.32.0"
        )
    raise CheckpointError(
        f"quantization_config.quant_method = {method!r}: gemmaserve has not checked it against vLLM's source; "
        "allowed: compressed-tensors, modelopt, fp8, awq, gptq"
    )


def _text_config(config: dict[str, Any], ref: CheckpointRef) -> dict[str, Any]:
    architectures = config.get("architectures") or []
    model_type = config.get("model_type")
    if model_type not in GEMMA4_MODEL_TYPES or not set(architectures) & set(GEMMA4_ARCHITECTURES):
        raise CheckpointError(
            f"{ref.describe()} is not a Gemma 4 checkpoint: config.json model_type = {model_type!r}, "
            f"architectures = {architectures!r}; allowed: model_type {' or '.join(GEMMA4_MODEL_TYPES)} with "
            f"architecture {' or '.join(GEMMA4_ARCHITECTURES)}"
        )
    text = config.get("text_config", config) if model_type in MULTIMODAL_MODEL_TYPES else config
    if not isinstance(text, dict):
        raise CheckpointError(f"{ref.describe()}: config.json text_config must be a JSON object")
    return text


def _field(text: dict[str, Any], name: str, default: Any = None) -> Any:
    value = text.get(name, default)
    if value is None:
        raise CheckpointError(f"config.json text_config.{name}: missing; every Gemma 4 config.json sets it")
    return value


# transformers' Gemma4TextConfig.__post_init__ (5.19.0, the release pinned with vLLM 0.32.0), which vLLM reads the
# checkpoint through: without layer_types every 6th layer is full attention, the last layer is always made full, and a
# missing global_head_dim is 512.
DEFAULT_FULL_EVERY = 6
DEFAULT_GLOBAL_HEAD_DIM = 512


def _layer_types(text: dict[str, Any]) -> list[str]:
    """Each layer's attention, as Gemma4TextConfig fills it in: every 6th full when absent, the last always full."""
    layers = int(_field(text, "num_hidden_layers"))
    kinds = text.get("layer_types")
    if kinds is None:
        kinds = ["full_attention" if (i + 1) % DEFAULT_FULL_EVERY == 0 else "sliding_attention" for i in range(layers)]
    kinds = [*kinds[:-1], "full_attention"]
    if len(kinds) != layers:
        raise CheckpointError(f"config.json text_config.layer_types: {len(kinds)} entries for {layers} layers")
    return kinds


def _full_every(text: dict[str, Any]) -> int:
    """The period of full-attention layers: ModelInfo holds the pattern every released Gemma 4 uses."""
    layers = int(_field(text, "num_hidden_layers"))
    kinds = _layer_types(text)
    every = kinds.index("full_attention") + 1
    expected = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(layers)]
    if kinds != expected:
        raise CheckpointError(
            f"config.json text_config.layer_types: not every {every}th layer full with the rest sliding; "
            "allowed: the periodic pattern of the released Gemma 4 models (gemmaserve's KV model holds no other)"
        )
    return every


def _attention_shapes(text: dict[str, Any], k_eq_v: bool) -> tuple[AttentionShape, AttentionShape]:
    """(sliding, full) layers' KV heads and head size, as transformers 5.19.0's Gemma4TextConfig.__post_init__ sets
    each layer's: `per_layer_config` (layer index -> overrides of head_dim / num_key_value_heads) when the file has
    one, which is how transformers 5.19 itself saves a Gemma 4 config (so every fine-tune saved with it); otherwise
    built from global_head_dim (absent: 512) and, with attention_k_eq_v, num_global_key_value_heads for the full
    layers."""
    heads, head_dim = int(_field(text, "num_key_value_heads")), int(_field(text, "head_dim"))
    per_layer = text.get("per_layer_config")
    if per_layer is None:
        global_heads = text.get("num_global_key_value_heads")
        full_heads = int(global_heads) if k_eq_v and global_heads is not None else heads
        full_dim = int(text.get("global_head_dim") or DEFAULT_GLOBAL_HEAD_DIM)
        return AttentionShape(kv_heads=heads, head_dim=head_dim), AttentionShape(kv_heads=full_heads, head_dim=full_dim)
    if not isinstance(per_layer, dict) or not all(isinstance(o, dict) for o in per_layer.values()):
        raise CheckpointError("config.json text_config.per_layer_config: must map layer indices to JSON objects")
    # transformers reads each key as int(key) (integrations/heterogeneity/configuration_utils.py
    # _apply_heterogeneous_config), so "04" is layer 4: a published E2B fine-tune writes its keys zero-padded.
    kinds = _layer_types(text)
    try:
        by_layer = {int(key): overrides for key, overrides in per_layer.items()}
    except ValueError:
        raise CheckpointError(
            f"config.json text_config.per_layer_config: keys {sorted(per_layer)} are not all layer indices; "
            f"allowed: integers 0..{len(kinds) - 1}"
        ) from None
    if outside := sorted(i for i in by_layer if not 0 <= i < len(kinds)):
        raise CheckpointError(
            f"config.json text_config.per_layer_config: layers {outside} do not exist; allowed: 0..{len(kinds) - 1}"
        )
    shapes: dict[str, set[AttentionShape]] = {"sliding_attention": set(), "full_attention": set()}
    for index, kind in enumerate(kinds):
        overrides = by_layer.get(index) or {}
        shape = AttentionShape(
            kv_heads=int(overrides.get("num_key_value_heads") or heads),
            head_dim=int(overrides.get("head_dim") or head_dim),
        )
        shapes.setdefault(kind, set()).add(shape)
    if any(len(found) > 1 for found in shapes.values()):
        raise CheckpointError(
            "config.json text_config.per_layer_config: layers of one attention type differ in head_dim or "
            "num_key_value_heads; allowed: one shape for the sliding and one for the full layers (as every released "
            "Gemma 4 has)"
        )
    (sliding,), (full,) = shapes["sliding_attention"] or {AttentionShape(heads, head_dim)}, shapes["full_attention"]
    return sliding, full


def architecture(config: dict[str, Any], ref: CheckpointRef) -> dict[str, Any]:
    """ModelInfo's architecture fields from config.json (transformers' Gemma4Config / Gemma4TextConfig)."""
    text = _text_config(config, ref)
    k_eq_v = bool(text.get("attention_k_eq_v", False))
    sliding, full = _attention_shapes(text, k_eq_v)
    modalities = {"text"}
    if config.get("vision_config"):
        modalities |= {"image", "video"}
    if config.get("audio_config"):
        modalities.add("audio")
    vision = config.get("vision_config")
    # transformers 5.19.0's Gemma4VisionConfig defaults: hidden_size 768, intermediate_size 3072.
    widths = (int(vision.get("hidden_size") or 768), int(vision.get("intermediate_size") or 3072)) if vision else None
    experts = text.get("num_experts") if text.get("enable_moe_block", text.get("num_experts")) else None
    # vLLM's Gemma4DecoderLayer reads either name (gemma4.py, v0.32.0).
    moe_width = text.get("moe_intermediate_size") or text.get("expert_intermediate_size")
    return {
        "num_layers": int(_field(text, "num_hidden_layers")),
        "full_every": _full_every(text),
        "sliding": sliding,
        "full": full,
        "sliding_window": int(_field(text, "sliding_window")),
        "num_kv_shared_layers": int(text.get("num_kv_shared_layers") or 0),
        "attention_k_eq_v": k_eq_v,
        "max_context": int(_field(text, "max_position_embeddings")),
        "hidden_size": int(_field(text, "hidden_size")),
        "vocab_size": int(_field(text, "vocab_size")),
        "modalities": frozenset(modalities),
        "num_experts": int(experts) if experts else None,
        "experts_per_token": int(text["top_k_experts"]) if experts and text.get("top_k_experts") else None,
        "num_attention_heads": int(text["num_attention_heads"]) if text.get("num_attention_heads") else None,
        "intermediate_size": int(text["intermediate_size"]) if text.get("intermediate_size") else None,
        "moe_intermediate_size": int(moe_width) if experts and moe_width else None,
        "per_layer_input_size": int(text.get("hidden_size_per_layer_input") or 0),
        "double_wide_mlp": bool(text.get("use_double_wide_mlp", False)),
        "unified": UNIFIED_ARCHITECTURE in (config.get("architectures") or []),
        "vision_tower_widths": widths,
    }


def _safetensors_header_bytes(path: Path) -> int:
    """Tensor bytes of one .safetensors file, from its header alone (8-byte length, then JSON offsets)."""
    with path.open("rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(length))
    return sum(t["data_offsets"][1] - t["data_offsets"][0] for k, t in header.items() if k != "__metadata__")


def weight_bytes(ref: CheckpointRef) -> int:
    """Tensor bytes vLLM loads: the index's metadata.total_size (packed bytes for quantized weights), else the
    single model.safetensors file's tensors (its header's offsets)."""
    index = ref.read_text(INDEX_FILE)
    if index is not None:
        total = (json.loads(index).get("metadata") or {}).get("total_size")
        if not isinstance(total, int) or total <= 0:
            raise CheckpointError(f"{ref.describe()}/{INDEX_FILE}: metadata.total_size missing; allowed: bytes > 0")
        return total
    single = ref.path(SINGLE_WEIGHTS_FILE)
    if single is not None:
        return _safetensors_header_bytes(single)
    if ref.is_local:
        where = f"directory {ref.name} has"
    elif ref.is_gcs:
        where = f"the local copy of {ref.name} ({gcs_cache_dir(ref.name)}) has"
    else:
        where = f"the local Hugging Face cache of {ref.describe()} has"
    fetch = "" if ref.is_local else f"; fetch it first: {ref.download_hint((CONFIG_FILE, INDEX_FILE))}"
    raise CheckpointError(
        f"{where} neither {INDEX_FILE} nor {SINGLE_WEIGHTS_FILE}: the weight bytes are unknown{fetch}"
    )


def _slug(name: str) -> str:
    """A short name usable in labels, cache keys and directory names."""
    # At most 63 characters of lowercase letters, digits, '-' and '_': a Google Cloud label value (infra labels).
    return re.sub(r"[^a-z0-9_-]+", "-", name.lower())[-63:].strip("-") or "checkpoint"


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint as planned: its ModelInfo, its quantization and the catalog model it has the shape of."""

    info: ModelInfo
    quantization: Quantization | None
    base: ModelInfo | None


_ARCH_FIELDS = (
    "num_layers",
    "full_every",
    "sliding",
    "full",
    "sliding_window",
    "num_kv_shared_layers",
    "attention_k_eq_v",
    "max_context",
    "hidden_size",
    "vocab_size",
    "modalities",
    "num_experts",
    "experts_per_token",
    "unified",
)


def same_architecture(a: ModelInfo, b: ModelInfo) -> bool:
    return all(getattr(a, f) == getattr(b, f) for f in _ARCH_FIELDS)


@lru_cache(maxsize=64)
def load_checkpoint(name: str, revision: str | None = None) -> Checkpoint:
    """Read a Gemma 4 checkpoint (local directory, or hub repository in the local HF cache) into a Checkpoint.

    A fine-tune with a stock model's architecture and an unquantized checkpoint keeps that model's serving facts
    (vision-tower split, MTP assistant), so it plans exactly like its base; a quantized one keeps the tower split.
    """
    ref = CheckpointRef(name, revision)
    config = read_json(ref, CONFIG_FILE, (CONFIG_FILE, INDEX_FILE))
    fields = architecture(config, ref)
    quantization = parse_quantization(config.get("quantization_config"))
    total = weight_bytes(ref)
    info = ModelInfo(
        # A directory's or a bucket path's checkpoint is served under its last component (--served-model-name).
        hf_id=ref.served_name,
        aliases=(_slug(ref.served_name),),
        checkpoint_bytes=total,
        total_params_b=round(total / 2 / 1e9, 1),
        local_dir=name if ref.is_local else None,
        **fields,
    )
    base = next((m for m in CATALOG.models if not m.is_test_model and same_architecture(m, info)), None)
    if base is not None and quantization is None:
        info = replace(
            info,
            total_params_b=base.total_params_b,
            vision_tower_bytes=base.vision_tower_bytes,
            mtp_assistant=base.mtp_assistant,
            mtp_assistant_bytes=base.mtp_assistant_bytes,
        )
    elif base is not None:
        # Whether the recipe left the vision tower in BF16 is not read; counting the base's BF16 tower whole on
        # every rank is the upper bound of weights per device (the total is exact), so KV is never overstated.
        info = replace(info, total_params_b=base.total_params_b, vision_tower_bytes=min(base.vision_tower_bytes, total))
    return Checkpoint(info, quantization, base)


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter as vLLM 0.32.0 validates it (vllm/lora/peft_helper.py PEFTHelper.validate_legal)."""

    name: str
    source: str
    revision: str | None
    rank: int
    target_modules: tuple[str, ...]


def load_adapter(name: str, source: str, revision: str | None = None) -> Adapter:
    ref = CheckpointRef(source, revision)
    config = read_json(ref, ADAPTER_CONFIG_FILE, (ADAPTER_CONFIG_FILE,))
    where = f"{ref.describe()}/{ADAPTER_CONFIG_FILE}"
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise CheckpointError(f"{where}: peft_type = {config.get('peft_type')!r}; allowed: LORA")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise CheckpointError(f"{where}: r = {rank!r}; allowed: a positive integer")
    ranks = [rank, *(v for v in (config.get("rank_pattern") or {}).values() if isinstance(v, int))]
    # PEFTHelper._validate_features / validate_legal at v0.32.0: what vLLM refuses to load.
    unsupported = []
    if config.get("use_dora"):
        unsupported.append("use_dora = true (vLLM does not support DoRA)")
    if config.get("bias", "none") != "none":
        unsupported.append(f"bias = {config.get('bias')!r} (vLLM supports only 'none')")
    if config.get("lora_bias"):
        unsupported.append("lora_bias = true (vLLM does not support LoRA bias)")
    if [m for m in config.get("modules_to_save") or [] if m not in ("classifier", "score")]:
        unsupported.append(f"modules_to_save = {config.get('modules_to_save')!r} (vLLM allows only classifier, score)")
    if unsupported:
        raise CheckpointError(f"{where}: " + "; ".join(unsupported))
    targets = config.get("target_modules") or ()
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    return Adapter(name, source, revision, max(ranks), targets)
