"""vLLM's own KV-cache accounting for Gemma 4 layouts, as the engine core runs it at startup.

Runs as a script under a python that can import the vLLM release to judge (the sandbox's CPU vLLM venv,
with a downloaded release's `vllm/` package first on PYTHONPATH). stdin: a JSON list of cases; stdout:
one JSON object per case with what that release computes and logs:

    {"num_blocks": N, "tokens": T, "concurrency": C, "block_sizes": [...], "error": null}

Only the glue is ours: each case becomes vLLM config objects and one `Attention` layer per KV-owning
Gemma 4 layer, whose own `get_kv_cache_spec` builds the spec. Grouping, page-size unification, block
counts, the per-request reserve, the "not enough KV cache" check and the logged token count all come
from the release's functions, called in the order of `EngineCore._initialize_kv_caches`
(vllm/v1/engine/core.py) at that release.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import types

os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


class _LogCapture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _load():
    import torch  # noqa: F401
    import vllm
    from vllm.config import DeviceConfig, VllmConfig
    from vllm.v1.core import kv_cache_utils

    return vllm, VllmConfig, DeviceConfig, kv_cache_utils


def _engine_function(name: str):
    """A function as vLLM's engine core imports it (the module it lives in moved between releases)."""
    for module in ("vllm.v1.core.kv_cache_planning", "vllm.v1.core.kv_cache_utils"):
        try:
            mod = __import__(module, fromlist=[name])
        except ImportError:
            continue
        if hasattr(mod, name):
            return getattr(mod, name)
    return None


def _speculative_config(method: str, tokens: int):
    """A SpeculativeConfig as the engine holds it after parsing --speculative-config.

    Built without running its __post_init__ (which would load the draft model's config from a hub); the
    fields the KV-cache code reads are the ones `SpeculativeConfig.__post_init__` sets for Gemma 4: the
    method, num_speculative_tokens and, for MTP, the draft model's hf_config with model_type gemma4_mtp
    (config/speculative.py rewrites gemma4_assistant to gemma4_mtp).
    """
    from vllm.config import SpeculativeConfig

    spec = object.__new__(SpeculativeConfig)
    fields = {f: None for f in getattr(SpeculativeConfig, "__dataclass_fields__", {})}
    for name, field in getattr(SpeculativeConfig, "__dataclass_fields__", {}).items():
        default = field.default
        if default is not getattr(__import__("dataclasses"), "MISSING"):
            fields[name] = default
        elif field.default_factory is not getattr(__import__("dataclasses"), "MISSING"):
            fields[name] = field.default_factory()
    for name, value in fields.items():
        object.__setattr__(spec, name, value)
    object.__setattr__(spec, "method", method)
    object.__setattr__(spec, "num_speculative_tokens", tokens)
    if method == "mtp":
        hf = types.SimpleNamespace(model_type="gemma4_mtp", num_hidden_layers=4)
        draft = types.SimpleNamespace(hf_config=hf, hf_text_config=hf, max_model_len=None)
        object.__setattr__(spec, "draft_model_config", draft)
    return spec


def _gemma4_kv_layers(text_config: dict, tp: int):
    """(layer index, sliding window, KV heads per rank, head size) of each Gemma 4 layer that owns KV.

    Per-layer head sizes and KV heads come from transformers' Gemma4TextConfig (per_layer_config: full
    layers take global_head_dim, and num_global_key_value_heads when attention_k_eq_v); the split over
    tensor-parallel ranks and the KV-shared tail follow vllm/model_executor/models/gemma4.py
    (Gemma4Attention: num_kv_heads = max(1, total // tp_size); the last num_kv_shared_layers layers set
    kv_sharing_target_layer_name and own no cache).
    """
    from transformers import Gemma4TextConfig

    config = Gemma4TextConfig(**text_config)
    first_shared = config.num_hidden_layers - (config.num_kv_shared_layers or 0)
    for index in range(first_shared):
        layer = config.per_layer_config[index]
        sliding = config.layer_types[index] == "sliding_attention"
        yield index, (config.sliding_window if sliding else None), max(1, layer.num_key_value_heads // tp), layer.head_dim


def run_case(case: dict, capture: _LogCapture) -> dict:
    import torch
    import vllm.logger as vllm_logger
    from vllm.model_executor.layers.attention.attention import Attention

    vllm, VllmConfig, DeviceConfig, kv_cache_utils = _load()
    vc = VllmConfig(device_config=DeviceConfig(device="cuda"))
    hf_text = types.SimpleNamespace(model_type="gemma4_text")
    hf = types.SimpleNamespace(model_type="gemma4", text_config=hf_text, architectures=["Gemma4ForConditionalGeneration"])
    model = types.SimpleNamespace(
        max_model_len=case["max_model_len"],
        original_max_model_len=case["max_model_len"],
        dtype=torch.bfloat16,
        hf_config=hf,
        hf_text_config=hf_text,
        use_mla=False,
        is_hybrid=False,
        architectures=hf.architectures,
        runner_type="generate",
        is_multimodal_model=True,
        is_diffusion=False,
        is_moe=bool(case["text_config"].get("enable_moe_block")),
    )
    # What vLLM's model registry says about Gemma 4 at this release (is_hybrid, supports_kv_cache_grouping, ...).
    from vllm.model_executor.models.registry import ModelRegistry

    info = ModelRegistry._try_inspect_model_cls("Gemma4ForConditionalGeneration")
    if info is not None:
        for name, value in vars(info).items():
            setattr(model, name, value)
    object.__setattr__(vc, "model_config", model)
    sched = vc.scheduler_config
    object.__setattr__(sched, "max_num_batched_tokens", case["max_num_batched_tokens"])
    object.__setattr__(sched, "async_scheduling", case["async_scheduling"])
    # CUDA and ROCm support the hybrid KV-cache manager (Platform.support_hybrid_kv_cache); with no KV
    # events or connector configured VllmConfig leaves it on. This process has no GPU platform, so set it.
    object.__setattr__(sched, "disable_hybrid_kv_cache_manager", False)
    if hasattr(sched, "max_model_len"):
        object.__setattr__(sched, "max_model_len", case["max_model_len"])
    cache = vc.cache_config
    object.__setattr__(cache, "block_size", case["block_size"])
    object.__setattr__(cache, "cache_dtype", case["kv_cache_dtype"])
    object.__setattr__(vc.parallel_config, "tensor_parallel_size", case["tensor_parallel_size"])
    if case["speculative"] != "none":
        object.__setattr__(vc, "speculative_config", _speculative_config(case["speculative"], case["num_speculative_tokens"]))

    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype

    specs = {}
    for index, window, kv_heads, head_dim in _gemma4_kv_layers(case["text_config"], case["tensor_parallel_size"]):
        attn = Attention.__new__(Attention)
        torch.nn.Module.__init__(attn)
        attn.attn_type = "decoder"
        attn.sliding_window = window
        attn.num_kv_heads = kv_heads
        attn.head_size = head_dim
        attn.head_size_v = head_dim
        attn.kv_cache_dtype = case["kv_cache_dtype"]
        attn.kv_cache_torch_dtype = kv_cache_dtype_str_to_dtype(case["kv_cache_dtype"], model)
        attn.attn_backend = TritonAttentionBackend
        attn.kv_sharing_target_layer_name = None
        specs[f"language_model.model.layers.{index}.self_attn.attn"] = attn.get_kv_cache_spec(vc)

    worker_specs = [dict(specs) for _ in range(case["tensor_parallel_size"])]
    available = [case["available_bytes"]] * case["tensor_parallel_size"]
    vllm_logger._print_info_once.cache_clear()
    capture.messages.clear()

    resolve_layout = _engine_function("resolve_kv_cache_layout")
    if resolve_layout is None:
        from vllm.v1.attention.backends import utils as backend_utils

        resolve_layout = getattr(backend_utils, "resolve_kv_cache_layout", None)
    if resolve_layout is not None:
        from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts

        supported = [layout.name for layout in get_supported_kv_cache_layouts([TritonAttentionBackend])]
        resolve_layout(vc, [supported] * len(worker_specs), [s for w in worker_specs for s in w.values()])
    get_configs = _engine_function("get_kv_cache_configs")
    global_groups = _engine_function("get_global_kv_cache_groups")
    try:
        if global_groups is not None:
            groups = global_groups(vc, worker_specs)
            configs = get_configs(vc, worker_specs, available, groups)
        else:
            configs = get_configs(vc, worker_specs, available)
    except ValueError as error:
        return {"error": str(error).split(".")[0]}
    scheduler = kv_cache_utils.generate_scheduler_kv_cache_config(configs)
    concurrency = kv_cache_utils.get_max_concurrency_for_kv_cache_config(vc, scheduler)
    update = getattr(kv_cache_utils, "update_kv_cache_capacity", None)
    capacity = getattr(kv_cache_utils, "get_kv_cache_capacity", None)
    if update is not None:
        update(vc, scheduler)
    elif capacity is not None:
        capacity(vc, scheduler)
    elif hasattr(kv_cache_utils, "_report_kv_cache_config"):
        report_calls = [m for m in capture.messages if "KV cache size" in m]
        if not report_calls:
            kv_cache_utils._report_kv_cache_config(vc, scheduler)
    logged = [m for m in capture.messages if "KV cache size" in m]
    tokens = int(re.search(r"KV cache size: ([\d,]+) tokens", logged[-1])[1].replace(",", "")) if logged else None
    return {
        "num_blocks": scheduler.num_blocks,
        "tokens": tokens,
        "concurrency": concurrency,
        "block_sizes": [g.kv_cache_spec.block_size for g in scheduler.kv_cache_groups],
        "num_groups": len(scheduler.kv_cache_groups),
        "error": None,
    }


def main() -> int:
    cases = json.load(sys.stdin)
    capture = _LogCapture()
    logger = logging.getLogger("vllm")
    logger.setLevel(logging.INFO)
    logger.addHandler(capture)
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("vllm"):
            logging.getLogger(name).setLevel(logging.INFO)
    vllm = __import__("vllm")
    print(json.dumps({"version": vllm.__version__}), flush=True)
    for case in cases:
        print(json.dumps(run_case(case, capture)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
