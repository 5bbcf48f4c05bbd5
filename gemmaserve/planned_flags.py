"""The vLLM flags the plan sets, and the spec field that sets each one: `workload.extra_args` may not set them.

vLLM's serve parser takes the last of two copies of a flag, so an extra `--kv-cache-dtype fp8` would silently
replace the plan's and leave the planned KV capacity, the balancer's limits and the checks behind it wrong; an
extra `--api-key` would put a secret into the unit's environment file. The plan is the one place flags are
computed, so such an argument is refused at the spec, naming the field to set instead.

vLLM's parser (vllm/utils/argparse_utils.py FlexibleArgumentParser, v0.32.0) reads `--a_b` as `--a-b`, takes
`--flag=value`, and lets a long option be abbreviated to any prefix no other option shares (argparse's
allow_abbrev): all three forms are matched here. tests/vllm/test_planned_flags.py holds this table to vLLM's
own parser: every option string of each destination, short forms and `--no-` forms included.
"""

from __future__ import annotations

import re

# vLLM's argument destination -> what sets it in the spec.
PLANNED: dict[str, str] = {
    "model": "model",
    "model_tag": "model",
    "served_model_name": "model (served under the checkpoint's own name)",
    "revision": "weights.revision",
    "load_format": "weights.load (or a gs:// model)",
    "tensor_parallel_size": "serving.tensor_parallel_size",
    "pipeline_parallel_size": "serving.tensor_parallel_size (gemmaserve places replicas, not pipeline stages)",
    "data_parallel_size": "serving.replicas (one vLLM per replica)",
    "host": "serving.bind_address",
    "port": "serving.base_port",
    "uds": "serving.bind_address (replicas listen on TCP behind the balancer)",
    "api_key": "serving.api_keys (the balancer checks keys; a key on vLLM's command line would sit in its unit)",
    "ssl_keyfile": "serving.tls (the balancer terminates TLS)",
    "ssl_certfile": "serving.tls (the balancer terminates TLS)",
    "shutdown_timeout": "serving.shutdown_timeout",
    "enable_lora": "serving.lora_adapters",
    "max_loras": "serving.lora_adapters",
    "max_lora_rank": "serving.lora_adapters",
    "lora_modules": "serving.lora_adapters",
    "max_model_len": "workload.max_model_len",
    "gpu_memory_utilization": "workload.gpu_memory_utilization",
    "kv_cache_memory_bytes": "workload.gpu_memory_utilization (the plan sizes the KV cache from it)",
    "kv_cache_dtype": "workload.kv_cache_dtype",
    "block_size": "workload.block_size",
    "max_num_seqs": "workload.max_num_seqs",
    "max_num_batched_tokens": "workload.max_num_batched_tokens",
    "enable_prefix_caching": "workload.enable_prefix_caching",
    "speculative_config": "workload.speculative",
    "enforce_eager": "workload.enforce_eager",
    "dtype": "workload.dtype",
    "quantization": "workload.quantization (fp8: online) or the checkpoint's own quantization_config, which vLLM "
    "detects (docs/checkpoints.md)",
    "cpu_offload_gb": "nothing: the plan counts every weight on the GPU (serve a smaller or quantized checkpoint)",
    "enable_auto_tool_choice": "workload.tool_calling",
    "tool_call_parser": "workload.tool_calling",
    "reasoning_parser": "workload.reasoning",
    "chat_template": "workload.tool_calling and workload.reasoning (the vllm role installs the template)",
    "limit_mm_per_prompt": "workload.limit_mm_per_prompt or workload.text_only",
    "allowed_media_domains": "workload.allowed_media_domains",
    "mm_processor_kwargs": "workload.vision_token_budget",
    "hf_overrides": "workload.vision_token_budget",
    "async_scheduling": "the plan (on for GPUs, off with ngram drafting)",
    "disable_chunked_mm_input": "the plan (on for TPUs)",
}

# vLLM 0.32.0's option strings for each destination above (tests/vllm/test_planned_flags.py compares).
OPTIONS: dict[str, tuple[str, ...]] = {
    "model": ("--model",),
    "model_tag": (),
    "served_model_name": ("--served-model-name",),
    "revision": ("--revision",),
    "load_format": ("--load-format",),
    "tensor_parallel_size": ("--tensor-parallel-size", "-tp"),
    "pipeline_parallel_size": ("--pipeline-parallel-size", "-pp"),
    "data_parallel_size": ("--data-parallel-size", "-dp"),
    "host": ("--host",),
    "port": ("--port",),
    "uds": ("--uds",),
    "api_key": ("--api-key",),
    "ssl_keyfile": ("--ssl-keyfile",),
    "ssl_certfile": ("--ssl-certfile",),
    "shutdown_timeout": ("--shutdown-timeout",),
    "enable_lora": ("--enable-lora", "--no-enable-lora"),
    "max_loras": ("--max-loras",),
    "max_lora_rank": ("--max-lora-rank",),
    "lora_modules": ("--lora-modules",),
    "max_model_len": ("--max-model-len",),
    "gpu_memory_utilization": ("--gpu-memory-utilization", "--device-memory-utilization"),
    "kv_cache_memory_bytes": ("--kv-cache-memory-bytes",),
    "kv_cache_dtype": ("--kv-cache-dtype",),
    "block_size": ("--block-size",),
    "max_num_seqs": ("--max-num-seqs",),
    "max_num_batched_tokens": ("--max-num-batched-tokens",),
    "enable_prefix_caching": ("--enable-prefix-caching", "--no-enable-prefix-caching"),
    "speculative_config": ("--speculative-config", "-sc"),
    "enforce_eager": ("--enforce-eager", "--no-enforce-eager"),
    "dtype": ("--dtype",),
    "quantization": ("--quantization", "-q"),
    "cpu_offload_gb": ("--cpu-offload-gb",),
    "enable_auto_tool_choice": ("--enable-auto-tool-choice", "--no-enable-auto-tool-choice"),
    "tool_call_parser": ("--tool-call-parser",),
    "reasoning_parser": ("--reasoning-parser",),
    "chat_template": ("--chat-template",),
    "limit_mm_per_prompt": ("--limit-mm-per-prompt",),
    "allowed_media_domains": ("--allowed-media-domains",),
    "mm_processor_kwargs": ("--mm-processor-kwargs",),
    "hf_overrides": ("--hf-overrides",),
    "async_scheduling": ("--async-scheduling", "--no-async-scheduling"),
    "disable_chunked_mm_input": ("--disable-chunked-mm-input", "--no-disable-chunked-mm-input"),
}

# vLLM's own long options that are a prefix of a planned one but name another setting: written out whole they
# are that setting, not an abbreviation (argparse matches an exact option first). The oracle test fills this in.
UNPLANNED_PREFIXES: frozenset[str] = frozenset()

_NEGATIVE_NUMBER = re.compile(r"^-\d")


def _long_options() -> dict[str, str]:
    return {option: dest for dest, options in OPTIONS.items() for option in options if option.startswith("--")}


def _short_options() -> dict[str, str]:
    return {option: dest for dest, options in OPTIONS.items() for option in options if not option.startswith("--")}


def planned_destination(word: str) -> str | None:
    """The planned vLLM destination an argument word sets, as vLLM's parser would read it, or None."""
    if not word.startswith("-") or word == "--" or _NEGATIVE_NUMBER.match(word):
        return None
    if not word.startswith("--"):
        # A short option reads its value glued on too (-q fp8, -qfp8, -q=fp8).
        return next((dest for option, dest in _short_options().items() if word.startswith(option)), None)
    name = "--" + word[2:].split("=", 1)[0].replace("_", "-")
    longs = _long_options()
    if name in longs:
        return longs[name]
    if name in UNPLANNED_PREFIXES:
        return None
    # An abbreviation: vLLM takes it for the one option it begins (or refuses it as ambiguous).
    return next((dest for option, dest in longs.items() if option.startswith(name)), None)


# tpu-inference 0.32.0 (the engine Gemma 4 runs on TPU) has no runtime weight quantization for its JAX model: its
# Fp8Config reads quant_method from the checkpoint's own quantization_config (layers/jax/quantization/fp8.py), which a
# 16-bit checkpoint does not have, and loads FP8-serialized tensors only.
TPU_RUNTIME_QUANTIZATION = (
    "tpu-inference 0.32.0 quantizes no 16-bit Gemma 4 weights at load (layers/jax/quantization/fp8.py Fp8Config reads "
    "the checkpoint's own quantization_config); allowed: a QAT or FP8-serialized checkpoint as the model "
    "(docs/checkpoints.md), or 16-bit weights"
)


def planned_flag_problems(extra_args: tuple[str, ...], tpu: bool = False) -> list[str]:
    """One message per extra argument that sets a flag the plan sets, naming the spec field."""
    problems = []
    for word in extra_args:
        dest = planned_destination(word)
        if dest == "quantization" and tpu:
            problems.append(f"{word!r} asks for runtime weight quantization: {TPU_RUNTIME_QUANTIZATION}")
        elif dest is not None:
            problems.append(
                f"{word!r} sets vLLM's {dest}, which the plan sets from {PLANNED[dest]}; allowed: that field "
                "(extra_args are for flags gemmaserve does not plan)"
            )
    return problems
