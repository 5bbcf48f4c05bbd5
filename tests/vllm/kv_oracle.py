"""vLLM's own KV-cache accounting for Gemma 4 layouts, as the engine core runs it at startup.

Runs as a script under a python that can import the vLLM release to judge: the sandbox's CPU vLLM venv
(torch, transformers), with a downloaded release's `vllm/` package first on PYTHONPATH. stdin: a JSON
list of cases; stdout: a line {"version": ...}, then one JSON object per case with what that release
computes and logs:

    {"num_blocks": N, "tokens": T, "concurrency": C, "block_sizes": [...], "fits": true}

Only the glue is ours. A GPU case becomes vLLM config objects and one `Attention` layer per KV-owning
Gemma 4 layer, whose own `get_kv_cache_spec` builds the layer's spec (per-layer heads and head sizes
from transformers' Gemma4TextConfig). A TPU case becomes the FullAttentionSpec objects tpu-inference
registers for its JAX Gemma 4 (tpu_inference/runner/kv_cache_manager.py: every layer full attention,
page_size_padded to the TPU page). Grouping, page-size unification, block counts, the per-request
reserve, the "one request must fit" check and the logged token count all come from the release's
functions, called in the order of EngineCore._initialize_kv_caches (vllm/v1/engine/core.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import sys
import types

os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

# vLLM raises this (ValueError) when one max_model_len request does not fit the KV-cache memory.
NOT_ENOUGH = "To serve at least one request"


class _LogCapture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _engine_function(name: str):
    """A function as vLLM's engine core imports it (the module it lives in moved between releases)."""
    for module in ("vllm.v1.core.kv_cache_planning", "vllm.v1.core.kv_cache_utils", "vllm.v1.attention.backends.utils"):
        try:
            mod = __import__(module, fromlist=[name])
        except ImportError:
            continue
        if hasattr(mod, name):
            return getattr(mod, name)
    return None


def _speculative_config(method: str, tokens: int):
    """A SpeculativeConfig as the engine holds it after parsing --speculative-config.

    Built without its __post_init__ (which loads the draft model's config from a hub): every field gets
    its declared default, then the ones SpeculativeConfig.__post_init__ sets for Gemma 4: the method,
    num_speculative_tokens and, for MTP, the draft model's hf_config with model_type gemma4_mtp
    (config/speculative.py rewrites gemma4_assistant to gemma4_mtp and sets no num_nextn_predict_layers).
    """
    from vllm.config import SpeculativeConfig

    spec = object.__new__(SpeculativeConfig)
    for field in dataclasses.fields(SpeculativeConfig):
        if field.default is not dataclasses.MISSING:
            value = field.default
        elif field.default_factory is not dataclasses.MISSING:
            value = field.default_factory()
        else:
            value = None
        object.__setattr__(spec, field.name, value)
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
        yield (
            index,
            (config.sliding_window if sliding else None),
            max(1, layer.num_key_value_heads // tp),
            layer.head_dim,
        )


class Oracle:
    """One vLLM release, loaded once; run() answers one case."""

    def __init__(self) -> None:
        import torch
        import vllm
        from vllm.config import DeviceConfig, VllmConfig
        from vllm.model_executor.models.registry import ModelRegistry
        from vllm.v1.core import kv_cache_utils

        self.torch = torch
        self.version = vllm.__version__
        self.VllmConfig, self.DeviceConfig = VllmConfig, DeviceConfig
        self.kv_cache_utils = kv_cache_utils
        # What vLLM's registry says about Gemma 4 at this release (is_hybrid, supports_kv_cache_grouping...).
        info = ModelRegistry._try_inspect_model_cls("Gemma4ForConditionalGeneration")
        self.model_info = vars(info) if info is not None else {}
        self._layers: dict[str, list] = {}
        self.capture = _LogCapture()
        logger = logging.getLogger("vllm")
        logger.setLevel(logging.INFO)
        logger.addHandler(self.capture)
        for name in list(logging.root.manager.loggerDict):
            if name.startswith("vllm"):
                logging.getLogger(name).setLevel(logging.INFO)

    def _config(self, case: dict):
        torch = self.torch
        # One VllmConfig for all cases (building one takes most of a case's time); every field the KV-cache
        # code reads is set again below, and speculative_config is reset.
        if not hasattr(self, "_vc"):
            self._vc = self.VllmConfig(device_config=self.DeviceConfig(device="cuda"))
        vc = self._vc
        object.__setattr__(vc, "speculative_config", None)
        hf_text = types.SimpleNamespace(model_type="gemma4_text")
        hf = types.SimpleNamespace(
            model_type="gemma4", text_config=hf_text, architectures=["Gemma4ForConditionalGeneration"]
        )
        model = types.SimpleNamespace(
            max_model_len=case["max_model_len"],
            original_max_model_len=case["max_model_len"],
            dtype=torch.bfloat16,
            hf_config=hf,
            hf_text_config=hf_text,
            use_mla=False,
            architectures=hf.architectures,
            runner_type="generate",
            is_multimodal_model=True,
            is_diffusion=False,
            is_moe=case.get("is_moe", False),
            is_hybrid=False,
            supports_kv_cache_grouping=False,
        )
        for name, value in self.model_info.items():
            setattr(model, name, value)
        object.__setattr__(vc, "model_config", model)
        sched = vc.scheduler_config
        object.__setattr__(sched, "max_num_batched_tokens", case["max_num_batched_tokens"])
        object.__setattr__(sched, "async_scheduling", case["async_scheduling"])
        # CUDA/ROCm (and vllm-tpu) support the hybrid KV-cache manager (Platform.support_hybrid_kv_cache)
        # and no KV events or connector are configured, so VllmConfig leaves it on. This process has no
        # such platform, so set it as VllmConfig would.
        object.__setattr__(sched, "disable_hybrid_kv_cache_manager", False)
        if hasattr(sched, "max_model_len"):
            object.__setattr__(sched, "max_model_len", case["max_model_len"])
        cache = vc.cache_config
        object.__setattr__(cache, "block_size", case["block_size"])
        object.__setattr__(cache, "cache_dtype", case["kv_cache_dtype"])
        object.__setattr__(vc.parallel_config, "tensor_parallel_size", case["tensor_parallel_size"])
        if case.get("speculative", "none") != "none":
            spec = _speculative_config(case["speculative"], case["num_speculative_tokens"])
            object.__setattr__(vc, "speculative_config", spec)
        return vc, model

    def _gpu_specs(self, case: dict, vc, model):
        """Triton attention (vLLM forces TRITON_ATTN, or FA4, for Gemma 4's mixed head sizes on CUDA)."""
        from vllm.model_executor.layers.attention.attention import Attention
        from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
        from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

        key = json.dumps([case["text_config"], case["tensor_parallel_size"]], sort_keys=True)
        if key not in self._layers:
            self._layers[key] = list(_gemma4_kv_layers(case["text_config"], case["tensor_parallel_size"]))
        specs = {}
        for index, window, kv_heads, head_dim in self._layers[key]:
            attn = Attention.__new__(Attention)
            self.torch.nn.Module.__init__(attn)
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
        return specs, [TritonAttentionBackend]

    def _tpu_specs(self, case: dict, vc, model):
        """tpu-inference's KVCacheManager._create_attention_spec on the JAX path: FullAttentionSpec per layer."""
        from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        dtype = kv_cache_dtype_str_to_dtype(case["kv_cache_dtype"], model)
        specs = {}
        for layer in case["tpu_layers"]:
            specs[f"layer.{layer['index']}"] = FullAttentionSpec(
                block_size=case["block_size"],
                num_kv_heads=layer["kv_heads"],
                head_size=layer["head_dim"],
                dtype=dtype,
                page_size_padded=layer["page_size_bytes"],
            )
        return specs, []

    def run(self, case: dict) -> dict:
        import vllm.logger as vllm_logger

        vc, model = self._config(case)
        specs, backends = (
            self._tpu_specs(case, vc, model) if case.get("tpu_layers") else self._gpu_specs(case, vc, model)
        )
        workers = 1 if case.get("tpu_layers") else case["tensor_parallel_size"]
        worker_specs = [dict(specs) for _ in range(workers)]
        available = [case["available_bytes"]] * workers
        vllm_logger._print_info_once.cache_clear()
        self.capture.messages.clear()

        resolve_layout = _engine_function("resolve_kv_cache_layout")
        if resolve_layout is not None:
            # Workers report the layouts their backends support (WorkerBase.get_supported_kv_cache_layouts);
            # Triton declares none, so the default preference applies, as for the JAX model on TPU.
            from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts

            supported = [layout.name for layout in get_supported_kv_cache_layouts(backends)]
            resolve_layout(vc, [supported] * workers, [s for w in worker_specs for s in w.values()])
        get_configs = _engine_function("get_kv_cache_configs")
        global_groups = _engine_function("get_global_kv_cache_groups")
        try:
            if global_groups is not None:
                configs = get_configs(vc, worker_specs, available, global_groups(vc, worker_specs))
            else:
                configs = get_configs(vc, worker_specs, available)
        except ValueError as error:
            if NOT_ENOUGH in str(error):
                return {"fits": False}
            raise
        utils = self.kv_cache_utils
        scheduler = utils.generate_scheduler_kv_cache_config(configs)
        concurrency = utils.get_max_concurrency_for_kv_cache_config(vc, scheduler)
        if hasattr(utils, "update_kv_cache_capacity"):
            utils.update_kv_cache_capacity(vc, scheduler)
        elif hasattr(utils, "get_kv_cache_capacity"):
            tokens, _ = utils.get_kv_cache_capacity(vc, scheduler)
            self.capture.messages.append(f"GPU KV cache size: {tokens:,} tokens")
        elif not any("KV cache size" in m for m in self.capture.messages):
            utils._report_kv_cache_config(vc, scheduler)
        logged = [m for m in self.capture.messages if "KV cache size" in m]
        tokens = int(re.search(r"KV cache size: ([\d,]+) tokens", logged[-1])[1].replace(",", ""))
        return {
            "fits": True,
            "num_blocks": scheduler.num_blocks,
            "tokens": tokens,
            "concurrency": concurrency,
            "block_sizes": [g.kv_cache_spec.block_size for g in scheduler.kv_cache_groups],
        }


def main() -> int:
    cases = json.load(sys.stdin)
    oracle = Oracle()
    print(json.dumps({"version": oracle.version}), flush=True)
    for case in cases:
        print(json.dumps(oracle.run(case)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
