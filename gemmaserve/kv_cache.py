"""KV-cache capacity the way vLLM counts it for Gemma 4's hybrid sliding-window/full attention.

The textbook formula (layers x heads x head_dim x 2 x bytes per token) is wrong for Gemma 4 in
vLLM. vLLM's v1 hybrid KV-cache manager (v0.19 vllm/v1/core/kv_cache_utils.py):

1. gives every KV-owning layer a spec: full attention, or sliding window with the model's window;
   KV-shared layers own no cache (gpu_model_runner.get_kv_cache_spec skips them);
2. makes all page sizes equal (unify_kv_cache_spec_page_size): the smaller-page kind gets a larger
   block_size, by the ratio of page sizes;
3. splits layers into groups of `group_size` layers of one kind (_get_kv_cache_groups_uniform_page_size):
   group_size is the smallest per-kind layer count, or the largest if that is < 1.5x the smallest;
4. allocates `group_size` tensors shared by all groups: num_blocks = memory // page_size // group_size
   (get_num_blocks);
5. logs "Maximum concurrency" as num_blocks / the blocks one max_model_len request needs across all
   groups, where a sliding group needs only cdiv(min(window - 1 + max_num_batched_tokens,
   max_model_len), block_size) + 1 blocks (SlidingWindowSpec.max_memory_usage_bytes);
6. logs "KV cache size: N tokens". vLLM 0.19 counts num_blocks // num_groups * min_block_size
   (_report_kv_cache_config); by 0.32 it is int(max_concurrency * max_model_len)
   (get_kv_cache_capacity). Releases in between were not checked and are counted the 0.19 way.

Calibration (an A100 user's vLLM 0.19 log, https://myoceane.fr/index.php/ai-vllm-a100-gemma-4/: A100 80GB, 26B-A4B, max_model_len 131072): 21.5 GiB gives
"93,936 tokens" and "6.96x"; tests/unit/test_kv_cache.py checks both. On vLLM 0.32 the sandbox's
real server reports exactly the blocks, tokens and concurrency computed here
(tests/roles/test_deploy.py compares them with its vllm:cache_config_info metric).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from gemmaserve.catalog import AttentionKind, GiB, ModelInfo

# vLLM's default block size on CUDA/ROCm (DEFAULT_BLOCK_SIZE, Triton attention takes multiples of 16)
# and on the CPU backend (platforms/cpu.py sets 128).
DEFAULT_BLOCK_SIZE = {"nvidia": 16, "amd": 16, "google": 16, "cpu": 128}

# Bytes per element of the KV cache for each --kv-cache-dtype.
KV_DTYPE_BYTES = {"auto": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}

# Memory a replica uses per device besides weights and KV cache during vLLM's profile run.
# RUNTIME_BASE_GIB is the CUDA/ROCm/XLA context, allocator slack and non-torch memory; the rest
# scales with max_num_batched_tokens (activations) and max_num_seqs (fp32 logits in the sampler).
# Calibrated on that A100 log: 79.25 GiB x 0.9 - 48.5 GiB weights - 21.5 GiB KV = 1.33 GiB of overhead
# at max_num_batched_tokens 2048, max_num_seqs 256, hidden 2816, vocab 262144.
RUNTIME_BASE_GIB = 1.0
ACTIVATION_BUFFERS = 8  # live [tokens x hidden] bf16 buffers at the profile run's peak


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KvSpec:
    """One kind of attention layer's KV cache on one tensor-parallel rank."""

    kind: AttentionKind
    block_size: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    sliding_window: int | None

    @property
    def page_size_bytes(self) -> int:
        return 2 * self.block_size * self.kv_heads * self.head_dim * self.dtype_bytes

    def blocks_per_request(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        if self.sliding_window is None:
            return cdiv(max_model_len, self.block_size)
        tokens = min(self.sliding_window - 1 + max_num_batched_tokens, max_model_len)
        return cdiv(tokens, self.block_size) + 1


@dataclass(frozen=True)
class KvLayout:
    """How vLLM lays out the KV cache of one replica: groups of layers sharing tensors."""

    groups: tuple[KvSpec, ...]
    group_size: int
    page_size_bytes: int

    @property
    def min_block_size(self) -> int:
        return min(g.block_size for g in self.groups)

    def blocks_per_request(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        return sum(g.blocks_per_request(max_model_len, max_num_batched_tokens) for g in self.groups)


@dataclass(frozen=True)
class KvCapacity:
    available_bytes: int
    num_blocks: int
    tokens: int
    max_concurrency: float

    @property
    def available_gib(self) -> float:
        return self.available_bytes / GiB


def kv_layout(model: ModelInfo, tensor_parallel_size: int, kv_dtype: str, block_size: int) -> KvLayout:
    """Build vLLM's KV-cache groups for `model` on one rank of a TP group."""
    dtype_bytes = KV_DTYPE_BYTES[kv_dtype]
    counts = Counter(model.kv_layer_kinds)
    specs: dict[str, KvSpec] = {}
    for kind in counts:
        shape = model.shape(kind)
        specs[kind] = KvSpec(
            kind=kind,
            block_size=block_size,
            # vLLM splits KV heads across ranks and replicates them when TP exceeds the head count.
            kv_heads=max(1, shape.kv_heads // tensor_parallel_size),
            head_dim=shape.head_dim,
            dtype_bytes=dtype_bytes,
            sliding_window=model.sliding_window if kind == "sliding" else None,
        )
    max_page = max(s.page_size_bytes for s in specs.values())
    for kind, spec in specs.items():
        if max_page % spec.page_size_bytes:
            raise ValueError(f"{model.hf_id}: page sizes {max_page} and {spec.page_size_bytes} do not divide")
        ratio = max_page // spec.page_size_bytes
        specs[kind] = KvSpec(**{**spec.__dict__, "block_size": spec.block_size * ratio})

    smallest, largest = min(counts.values()), max(counts.values())
    group_size = largest if largest < smallest * 1.5 else smallest
    groups: list[KvSpec] = []
    for kind, n in counts.items():
        groups.extend([specs[kind]] * cdiv(n, group_size))
    return KvLayout(groups=tuple(groups), group_size=group_size, page_size_bytes=max_page)


# The first release seen to report tokens as max_concurrency x max_model_len (see the docstring).
TOKENS_FROM_CONCURRENCY_SINCE = (0, 32, 0)


def kv_capacity(
    layout: KvLayout,
    available_bytes: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    vllm_version: tuple[int, int, int] = (0, 19, 0),
) -> KvCapacity:
    """Tokens and concurrency exactly as vLLM `vllm_version` logs them for `available_bytes` per rank."""
    num_blocks = max(0, available_bytes // layout.page_size_bytes // layout.group_size)
    per_request = layout.blocks_per_request(max_model_len, max_num_batched_tokens)
    concurrency = num_blocks / per_request
    if vllm_version >= TOKENS_FROM_CONCURRENCY_SINCE:
        tokens = int(concurrency * max_model_len)
    else:
        tokens = num_blocks // len(layout.groups) * layout.min_block_size
    return KvCapacity(
        available_bytes=available_bytes, num_blocks=num_blocks, tokens=tokens, max_concurrency=concurrency
    )


def runtime_overhead_gib(model: ModelInfo, max_num_batched_tokens: int, max_num_seqs: int) -> float:
    """Non-weight, non-KV memory per device at vLLM's profile peak (see RUNTIME_BASE_GIB)."""
    activations = ACTIVATION_BUFFERS * max_num_batched_tokens * model.hidden_size * 2
    logits = max_num_seqs * model.vocab_size * 4
    return RUNTIME_BASE_GIB + (activations + logits) / GiB


def min_bytes_for_one_request(layout: KvLayout, max_model_len: int, max_num_batched_tokens: int) -> int:
    """KV memory per rank that holds exactly one max_model_len request."""
    blocks = layout.blocks_per_request(max_model_len, max_num_batched_tokens)
    return blocks * layout.page_size_bytes * layout.group_size
