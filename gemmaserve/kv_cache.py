"""KV-cache capacity the way vLLM counts it for Gemma 4, release by release, on GPU, CPU and TPU.

The textbook formula (layers x heads x head_dim x 2 x bytes per token) is wrong for Gemma 4 in vLLM.
On CUDA, ROCm and CPU, vLLM's v1 hybrid KV-cache manager (vllm/v1/core/kv_cache_utils.py, and
kv_cache_planning.py since 0.33):

1. gives every KV-owning layer a spec: full attention, or sliding window with the model's window;
   KV-shared layers own no cache (the model sets kv_sharing_target_layer_name, the runner skips them);
2. makes all page sizes equal (unify_kv_cache_spec_page_size): the smaller-page kind gets a larger
   block_size, by the ratio of page sizes;
3. splits layers into groups of `group_size` layers of one kind (_get_kv_cache_groups_uniform_page_size):
   group_size is the smallest per-kind layer count, or the largest if that is < 1.5x the smallest;
4. allocates `group_size` tensors shared by all groups: num_blocks = memory // (page_size x group_size);
5. logs "Maximum concurrency" as num_blocks / the blocks one max_model_len request needs across all
   groups; a sliding group needs cdiv(min(window - 1 + in-flight tokens, max_model_len), block) + 1;
6. logs "KV cache size: N tokens".

Steps 5 and 6 and the "one request must fit" check changed between releases; gemmaserve.vllm_releases
holds each release's rules with the source lines they come from, and tests/vllm/test_kv_oracle.py runs
each release's own functions against this module on a grid of Gemma 4 configurations.

On TPU, tpu-inference's JAX Gemma 4 registers every KV-owning layer as full attention with heads and
head_dim padded for its kernel (tpu_kv_layout); vllm-tpu then puts them in one group whose block is
the sum of the layer pages.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace

from gemmaserve.catalog import AttentionKind, GiB, ModelInfo
from gemmaserve.vllm_releases import VllmRelease

# vLLM's default block size on CUDA/ROCm (CacheConfig.DEFAULT_BLOCK_SIZE; Triton and FlashAttention
# take multiples of 16) and on the CPU backend (platforms/cpu.py sets 128). TPU: tpu_block_size.
DEFAULT_BLOCK_SIZE = {"nvidia": 16, "amd": 16, "google": 16, "cpu": 128}

# Bytes per element of the KV cache for each --kv-cache-dtype.
KV_DTYPE_BYTES = {"auto": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}

# Memory a GPU replica uses per device besides weights and KV cache at vLLM's profile peak.
# RUNTIME_BASE_GIB is the CUDA context, allocator slack, buffers vLLM allocates while loading (rotary
# caches, ...) and non-torch memory; the rest scales with max_num_batched_tokens (activations) and
# max_num_seqs (fp32 logits in the sampler). Calibrated on one real log (an A100 user's vLLM 0.19,
# https://myoceane.fr/index.php/ai-vllm-a100-gemma-4/: one A100 80GB, gemma-4-26B-A4B, --enforce-eager,
# utilization 0.9): 79.25 x 0.9 - 21.5 GiB KV ("Available KV cache memory") - 48.07 GiB checkpoint =
# 1.76 GiB at max_num_batched_tokens 2048, max_num_seqs 256.
RUNTIME_BASE_GIB = 1.42
ACTIVATION_BUFFERS = 8  # live [tokens x hidden] bf16 buffers at the profile run's peak
# CUDA-graph memory vLLM measures and takes out of the KV budget (since 0.20.0, unless --enforce-eager).
# It is measured on the GPU at startup; public Gemma 4 logs print 0.27 GiB ("Estimated CUDA graph memory",
# vllm-project/vllm#41789, 31B with max-num-seqs 32) and other models 0.36-0.58 GiB at default capture
# sizes. An estimate, not a measurement of our plans.
CUDAGRAPH_GIB = 0.5


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KvSpec:
    """One kind of attention layer's KV cache on one tensor-parallel rank (one KV-cache group)."""

    kind: AttentionKind
    block_size: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    sliding_window: int | None

    @property
    def page_size_bytes(self) -> int:
        return 2 * self.block_size * self.kv_heads * self.head_dim * self.dtype_bytes

    def blocks_per_request(self, max_model_len: int, in_flight_tokens: int) -> int:
        if self.sliding_window is None:
            return cdiv(max_model_len, self.block_size)
        # SlidingWindowSpec.max_admission_blocks_per_request; extra_retained_tokens is 0 for Gemma 4
        # (one MTP module at most: gemmaserve.vllm_releases, gemma4_mtp_shares_kv).
        tokens = min(self.sliding_window - 1 + in_flight_tokens, max_model_len)
        return cdiv(tokens, self.block_size) + 1


@dataclass(frozen=True)
class KvLayout:
    """How vLLM lays out one replica's KV cache: groups drawing block ids from one pool."""

    groups: tuple[KvSpec, ...]
    # Bytes one block id takes in the pool on each rank: page x group_size for the hybrid layout, the sum
    # of every layer's page for TPU's single group.
    bytes_per_block: int

    @property
    def min_block_size(self) -> int:
        return min(g.block_size for g in self.groups)

    @property
    def prefix_cache_block(self) -> int:
        """Tokens a prefix-cache hit is a multiple of: the least common multiple of the groups' block sizes
        (vllm/v1/core/kv_cache_utils.py at v0.32.0, `scheduler_block_size = math.lcm(*group_block_sizes)`, logged
        as "kv lcm block sizes"; an attention-only model's hits align to it, `partial_hash_hits_enabled` being
        for Mamba states only). Gemma 4's sliding groups get larger blocks than its full-attention group (their
        pages are unified), so a hit on the CPU backend's 128-token blocks is a multiple of 256 tokens."""
        return math.lcm(*(g.block_size for g in self.groups))

    def blocks_per_request(self, max_model_len: int, in_flight_tokens: int) -> int:
        return sum(g.blocks_per_request(max_model_len, in_flight_tokens) for g in self.groups)


@dataclass(frozen=True)
class KvCapacity:
    available_bytes: int
    num_blocks: int
    tokens: int
    max_concurrency: float
    # vLLM refuses to start when one max_model_len request does not fit ("To serve at least one request").
    fits: bool
    needed_bytes: int
    # KvLayout.prefix_cache_block: the granularity of prefix-cache hits, in tokens.
    prefix_cache_block: int = 0

    @property
    def available_gib(self) -> float:
        return self.available_bytes / GiB


# The smallest kernel block of the attention backends vLLM runs Gemma 4 with on CUDA and ROCm (Triton,
# FlashAttention: MultipleOf(16)); releases with sliding_block_smallest_kernel start sliding-window
# layers from it.
SMALLEST_KERNEL_BLOCK = 16


def kv_layout(
    model: ModelInfo,
    tensor_parallel_size: int,
    kv_dtype: str,
    block_size: int,
    sliding_block_size: int | None = None,
) -> KvLayout:
    """vLLM's KV-cache groups for `model` on one rank of a TP group (CUDA, ROCm, CPU).

    `sliding_block_size` is the block a sliding-window layer's spec starts from when the release does
    not take `block_size` for it (VllmRelease.sliding_block_smallest_kernel).
    """
    dtype_bytes = KV_DTYPE_BYTES[kv_dtype]
    counts = Counter(model.kv_layer_kinds)
    specs: dict[str, KvSpec] = {}
    for kind in counts:
        shape = model.shape(kind)
        specs[kind] = KvSpec(
            kind=kind,
            block_size=(sliding_block_size or block_size) if kind == "sliding" else block_size,
            # Gemma4Attention: num_kv_heads = max(1, total // tp_size); replicated when TP exceeds them.
            kv_heads=max(1, shape.kv_heads // tensor_parallel_size),
            head_dim=shape.head_dim,
            dtype_bytes=dtype_bytes,
            sliding_window=model.sliding_window if kind == "sliding" else None,
        )
    # unify_kv_cache_spec_page_size: smaller pages grow their block size to the largest page.
    max_page = max(s.page_size_bytes for s in specs.values())
    for kind, spec in specs.items():
        if max_page % spec.page_size_bytes:
            raise ValueError(f"{model.hf_id}: page sizes {max_page} and {spec.page_size_bytes} do not divide")
        specs[kind] = replace(spec, block_size=spec.block_size * (max_page // spec.page_size_bytes))

    smallest, largest = min(counts.values()), max(counts.values())
    group_size = largest if largest < smallest * 1.5 else smallest
    groups: list[KvSpec] = []
    for kind, n in counts.items():
        groups.extend([specs[kind]] * cdiv(n, group_size))
    return KvLayout(groups=tuple(groups), bytes_per_block=max_page * group_size)


def release_kv_layout(
    model: ModelInfo, tensor_parallel_size: int, kv_dtype: str, block_size: int, release: VllmRelease
) -> KvLayout:
    """kv_layout as `release` builds it (CUDA, ROCm, CPU)."""
    sliding = SMALLEST_KERNEL_BLOCK if release.sliding_block_smallest_kernel else None
    return kv_layout(model, tensor_parallel_size, kv_dtype, block_size, sliding)


# TPU (tpu-inference) ------------------------------------------------------------------------------

# Bits per KV element on TPU; "auto" is the model dtype, bfloat16.
TPU_KV_DTYPE_BITS = {"auto": 16, "bfloat16": 16, "fp8": 8, "fp8_e4m3": 8, "fp8_e5m2": 8}


def tpu_padded_kv_heads(kv_heads: int, tensor_parallel_size: int) -> int:
    """utils.get_padded_num_heads: at least one head per shard of the model axis."""
    return kv_heads if kv_heads >= tensor_parallel_size else tensor_parallel_size


def tpu_padded_head_dim(head_dim: int) -> int:
    """utils.get_padded_head_dim: a multiple of 128, except the dedicated head_dim 64 kernel."""
    return 64 if head_dim == 64 else cdiv(head_dim, 128) * 128


def tpu_page_size_bytes(block_size: int, kv_heads: int, head_dim: int, kv_dtype: str, tensor_parallel_size: int) -> int:
    """runner/kv_cache.get_attention_page_size_bytes for one layer: the whole replica's page.

    The ragged paged attention kernel's page is (block, cdiv(2 x heads per shard, packing), packing,
    head_dim aligned to 128) per shard, packing = 32 // bits, times the shards of the model axis.
    """
    bits = TPU_KV_DTYPE_BITS[kv_dtype]
    packing = 32 // bits
    heads_per_shard = tpu_padded_kv_heads(kv_heads, tensor_parallel_size) // tensor_parallel_size
    slots = cdiv(heads_per_shard * 2, packing) * packing
    # Gemma 4's head sizes (256, 512) take the v3 kernel; head_dim 64 would take kernel_hd64 instead.
    dim = cdiv(tpu_padded_head_dim(head_dim), 128) * 128
    return block_size * slots * dim * bits // 8 * tensor_parallel_size


def tpu_block_size(max_model_len: int, max_num_seqs: int) -> int:
    """PallasAttentionBackend.get_page_size, raised to get_min_page_size (tpu_platform.check_and_update_config)."""
    if max_model_len > 8192:
        size = 16
    else:
        size = min(256, max(16, (1 << (max_model_len - 1).bit_length()) // 16))
    max_pages_per_request = 1024 * 1024 // 2 // max_num_seqs // 4
    floor = cdiv(max_model_len, max_pages_per_request)
    floor = 1 << (floor - 1).bit_length()
    return max(size, floor)


def tpu_kv_layout(model: ModelInfo, tensor_parallel_size: int, kv_dtype: str, block_size: int) -> KvLayout:
    """tpu-inference's specs for the JAX Gemma 4: every KV-owning layer full attention, one group."""
    bytes_per_block = 0
    for kind in model.kv_layer_kinds:
        shape = model.shape(kind)
        bytes_per_block += tpu_page_size_bytes(
            block_size, shape.kv_heads, shape.head_dim, kv_dtype, tensor_parallel_size
        )
    full = KvSpec(
        kind="full",
        block_size=block_size,
        kv_heads=0,  # pages differ per layer; bytes_per_block carries their sum
        head_dim=0,
        dtype_bytes=0,
        sliding_window=None,
    )
    return KvLayout(groups=(full,), bytes_per_block=bytes_per_block)


# Capacity -----------------------------------------------------------------------------------------


def kv_capacity(
    layout: KvLayout,
    available_bytes: int,
    max_model_len: int,
    in_flight_tokens: int,
    release: VllmRelease,
) -> KvCapacity:
    """Blocks, tokens and concurrency exactly as `release` logs them for `available_bytes` per rank.

    `in_flight_tokens` is what a sliding-window group reserves on top of window - 1
    (release.in_flight_tokens(max_num_batched_tokens, async_scheduling)).
    """
    available_bytes = max(0, available_bytes)
    num_blocks = available_bytes // layout.bytes_per_block
    per_request = layout.blocks_per_request(max_model_len, in_flight_tokens)
    concurrency = num_blocks / per_request
    if release.tokens_from_concurrency:
        tokens = int(concurrency * max_model_len)
    else:
        tokens = num_blocks // len(layout.groups) * layout.min_block_size
    needed = per_request * layout.bytes_per_block
    # Since 0.29.0 the check plans against usable blocks: the pool keeps one null block.
    usable = available_bytes - (layout.bytes_per_block if release.fit_check_holds_null_block else 0)
    return KvCapacity(
        available_bytes=available_bytes,
        num_blocks=num_blocks,
        tokens=tokens,
        max_concurrency=concurrency,
        fits=available_bytes > 0 and usable >= needed,
        needed_bytes=needed,
        prefix_cache_block=layout.prefix_cache_block,
    )


def runtime_overhead_gib(model: ModelInfo, max_num_batched_tokens: int, max_num_seqs: int) -> float:
    """Non-weight, non-KV memory per GPU at vLLM's profile peak, without CUDA graphs (see RUNTIME_BASE_GIB)."""
    activations = ACTIVATION_BUFFERS * max_num_batched_tokens * model.hidden_size * 2
    logits = max_num_seqs * model.vocab_size * 4
    return RUNTIME_BASE_GIB + (activations + logits) / GiB
