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

# Memory vLLM's GPU worker takes out of total x gpu_memory_utilization besides the checkpoint (gpu_profile). Two
# terms are measurements the source does not determine, so the plan carries them as visible margins:
# - non-torch growth during the profile run (lazily loaded kernels, cuBLAS/NCCL buffers): public logs print 0.25 GiB
#   ("0.25 GiB for non-torch memory", 31B on one B300, vLLM 0.26.0) and imply 0.14-0.3 GiB on one A100 and on four
#   L4 at TP4 (docs/capacity.md);
# - the CUDA-graph estimate (0.20.0 on, unless --enforce-eager): a real capture of a few graphs before the KV cache
#   exists, extrapolated to all (gpu_model_runner.py profile_cudagraph_memory: the first graph's memory plus the second
#   graph's, at least 1 MiB, for each further graph). What a graph holds grows with the kernels it records, one set a
#   decoder layer, so the margin is per layer and graph: public Gemma 4 logs show 0.76 GiB estimated for 102 graphs of
#   31B's 60 layers (B300, 0.124 MiB a layer and graph), 0.27 GiB for 28 of 31B's (vllm-project/vllm#41789, 0.165)
#   and a capture of 0.45-0.47 GiB for 102 of 26B-A4B's 30 layers (RTX PRO 6000, 0.154): 0.17 MiB, the largest.
NON_TORCH_MARGIN_GIB = 0.3
CUDAGRAPH_MIB_PER_LAYER_GRAPH = 0.17


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


# --- Memory besides the KV cache on a GPU, as vLLM's worker measures it ---------------------------------------

# Gemma 4's RoPE: one cos/sin cache per attention kind, [max_position_embeddings, head_dim] in the model dtype,
# replicated on every rank (rotary_embedding/base.py, gemma4_rope.py forces rotary_dim = head_size, v0.32.0).
# The sampler's V1 warm-up holds, over [rows, vocab]: the bf16 logits, their fp32 copy, the probabilities and the
# exponential noise of random_sample (v1/sample/sampler.py, ops/topk_topp_sampler.py at v0.19.1 to v0.32.0): 14
# bytes a logit; the V2 runner's warm-up skips the fp32 path (gpu/sample/sampler.py): the soft-capped bf16 logits
# and their copy, 4 bytes a logit from 0.29.0, 6 (an fp32 copy) from 0.25.0 to 0.28.0.
V1_SAMPLER_BYTES = 14
V2_SAMPLER_BYTES = {True: 4, False: 6}  # release has its measured V2 CUDA-graph estimate (0.29.0 on) -> bytes


@dataclass(frozen=True)
class GpuProfile:
    """What vLLM takes per GPU rank before the KV cache, besides the checkpoint's own bytes (GiB). The first three
    follow from vLLM's source; the margins stand for what only the hardware measures."""

    loaded_extra: float  # built while loading, in "Model loading took": RoPE caches, the V copies of K=V layers
    activations: float  # the profile run's torch peak over its start: max(forward, sampler warm-up)
    persistent: float  # runner buffers made after loading, counted since 0.27.0 (V2 sampler penalty state)
    non_torch_margin: float
    cudagraph_margin: float
    cudagraphs: int  # graphs the release captures (0: eager, or no estimate taken out)

    @property
    def cudagraph_mib(self) -> float:
        """The margin per captured graph (CUDAGRAPH_MIB_PER_LAYER_GRAPH x the model's layers), MiB."""
        return self.cudagraph_margin * 1024 / self.cudagraphs if self.cudagraphs else 0.0

    @property
    def derived(self) -> float:
        return self.loaded_extra + self.activations + self.persistent

    @property
    def margin(self) -> float:
        return self.non_torch_margin + self.cudagraph_margin

    @property
    def total(self) -> float:
        return self.derived + self.margin


def cudagraph_capture_sizes(
    max_num_seqs: int, max_num_batched_tokens: int, speculative_tokens: int = 0, limit: int = 512
) -> list[int]:
    """vLLM's default capture sizes (config/vllm.py _set_cudagraph_sizes, v0.19.1 to v0.32.0): 1, 2, 4, every 8 below
    256, every 16 from 256, up to min(2 x max_num_seqs x (1 + speculative tokens), `limit`, max_num_batched_tokens).
    `limit` is 512, or 1024 on compute capability 10.x since 0.28.0 (VllmRelease rule blackwell_capture_1024)."""
    top = min(max_num_seqs * (1 + speculative_tokens) * 2, limit, max_num_batched_tokens)
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, min(top + 1, 256), 8)) + list(range(256, top + 1, 16))
    return sizes


def cudagraph_count(
    max_num_seqs: int, max_num_batched_tokens: int, speculative_tokens: int = 0, limit: int = 512
) -> int:
    """Graphs FULL_AND_PIECEWISE (the default mode) captures: a piecewise graph per size, and a full decode graph
    per size up to max_num_seqs x (1 + speculative tokens) (v1/cudagraph_dispatcher.py)."""
    sizes = cudagraph_capture_sizes(max_num_seqs, max_num_batched_tokens, speculative_tokens, limit)
    return len(sizes) + sum(1 for s in sizes if s <= max_num_seqs * (1 + speculative_tokens))


def gpu_profile(
    model: ModelInfo,
    tensor_parallel_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    multiprocessors: int,
    release: VllmRelease,
    cudagraphs_counted: bool,
    speculative_tokens: int = 0,
    capture_limit: int = 512,
    linear_weight_bytes: int = 2,
) -> GpuProfile:
    """vLLM's non-KV memory per rank beyond the checkpoint (gpu_worker.determine_available_memory).

    The profile run (gpu_model_runner.profile_run) runs the model on max_num_batched_tokens tokens, then the
    sampler's warm-up on min(tokens, max_num_seqs) rows of the full vocabulary (gathered on every TP rank); its
    torch peak is the larger of the two. Gemma 4's forward holds the MLP's [T, 2I/TP] and [T, I/TP] beside the
    residual; 26B-A4B's fused-MoE workspace (experts/triton_moe.py workspace_shapes: two [T x top-k, hidden]
    buffers, hidden being wider than 2 x moe_intermediate) stays allocated into the sampler phase; E2B/E4B carry
    [T, layers x 256] per-layer inputs.
    """
    tp, tokens, vocab, hidden = tensor_parallel_size, max_num_batched_tokens, model.vocab_size, model.hidden_size
    rows = min(tokens, max_num_seqs)
    rope = sum(model.max_context * model.shape(kind).head_dim * 2 for kind in set(model.layer_kinds))
    full_layers = sum(1 for kind in model.layer_kinds if kind == "full")
    # The V weights of K=V layers, loaded as copies of K (1 byte each under online FP8).
    k_eq_v = (
        full_layers * max(1, model.full.kv_heads // tp) * model.full.head_dim * hidden * linear_weight_bytes
        if model.attention_k_eq_v
        else 0
    )
    moe = model.num_experts is not None
    workspace = 2 * tokens * (model.experts_per_token or 0) * hidden * 2 if moe else 0
    # E2B's KV-shared layers have a double-width MLP (use_double_wide_mlp).
    width = (model.intermediate_size or 0) * (2 if model.double_wide_mlp else 1)
    mlp = 2 * tokens * (hidden + 3 * width // tp)
    # E2B/E4B: [T, layers x 256] per-layer inputs, twice while projected; a [T, layers, 256] buffer is made at load
    # (gemma4_mm.py per_layer_embeddings), so it is in "Model loading took".
    per_layer_buffer = tokens * model.num_layers * model.per_layer_input_size * 2
    per_layer = 2 * per_layer_buffer
    forward = mlp + per_layer + workspace
    v2 = release.v2_runner(moe)
    if v2:
        sampler = V2_SAMPLER_BYTES[release.has("v2_runner_cudagraph_estimate")] * rows * vocab
    else:
        # ops/triton_topk_topp.py keeps one fp32 vocabulary row per SM, at most, for its top-k/top-p kernel.
        triton_rows = min(1 << (min(multiprocessors, rows) - 1).bit_length(), multiprocessors) if rows >= 8 else 0
        sampler = V1_SAMPLER_BYTES * rows * vocab + 4 * triton_rows * vocab + (12 * rows * vocab if rows < 8 else 0)
    sampler_phase = sampler + workspace + tokens * hidden * 2
    # V2's penalty state (gpu/sample/penalties.py): [max_num_seqs, vocab] int32 counts and a [max_num_seqs, vocab/32]
    # mask, made after loading; the free-memory accounting of 0.27.0 on counts it.
    persistent = max_num_seqs * vocab * 4 * 33 // 32 if v2 and release.consumed_memory_counted else 0
    # The V2 runner of 0.25.0 to 0.28.0 returns 0 for its CUDA-graph estimate (gpu/model_runner.py).
    graphs = cudagraph_count(max_num_seqs, tokens, speculative_tokens, capture_limit) if cudagraphs_counted else 0
    if v2 and not release.has("v2_runner_cudagraph_estimate"):
        graphs = 0
    return GpuProfile(
        loaded_extra=(rope + k_eq_v + per_layer_buffer) / GiB,
        activations=max(forward, sampler_phase) / GiB,
        persistent=persistent / GiB,
        non_torch_margin=NON_TORCH_MARGIN_GIB,
        cudagraph_margin=graphs * model.num_layers * CUDAGRAPH_MIB_PER_LAYER_GRAPH / 1024,
        cudagraphs=graphs,
    )
