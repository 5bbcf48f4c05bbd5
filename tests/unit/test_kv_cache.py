"""KV-cache accounting reproduces real vLLM logs and each release's rules (vLLM's own code judges the
whole grid in tests/vllm/test_kv_oracle.py; these tests pin the rules and the recorded logs)."""

import pytest

from gemmaserve.catalog import CATALOG, GiB
from gemmaserve.engines import engine_pin
from gemmaserve.kv_cache import (
    kv_capacity,
    kv_layout,
    runtime_overhead_gib,
    tpu_block_size,
    tpu_kv_layout,
    tpu_page_size_bytes,
)
from gemmaserve.plan import plan
from gemmaserve.spec import parse_spec
from gemmaserve.vllm_releases import vllm_release

# A real vLLM 0.19 server: one A100 80GB, gemma-4-26B-A4B, --max-model-len 131072, utilization 0.9,
# --enforce-eager. Its log: "Available KV cache memory: 21.5 GiB", "GPU KV cache size: 93,936 tokens",
# "Maximum concurrency for 131,072 tokens per request: 6.96x".
A100_LOG_AVAILABLE_GIB = 21.5  # vLLM prints round(bytes / GiB, 2)
A100_LOG_TOKENS = 93_936
A100_LOG_CONCURRENCY = "6.96"
A100_SPEC = {
    "model": "26b-a4b",
    "accelerator": {"kind": "a100-80gb", "count": 1},
    "workload": {"max_model_len": 131072, "gpu_memory_utilization": 0.9, "enforce_eager": True},
    "engine": {"vllm_version": "0.19.0"},
}

# A real vllm-tpu server (E2B on a v6e-4, TP4, fp8 KV, --gpu-memory-utilization 0.4, max_model_len
# 16384, --max-num-batched-tokens 4096): 18,523 blocks of 16 tokens, "296,368 tokens".
TPU_LOG_BLOCKS = 18_523
TPU_LOG_TOKENS = 296_368
TPU_SPEC = {
    "model": "e2b",
    "accelerator": {"kind": "tpu-v6e", "count": 4},
    "workload": {
        "max_model_len": 16384,
        "kv_cache_dtype": "fp8",
        "gpu_memory_utilization": 0.4,
        "max_num_batched_tokens": 4096,
    },
}


def release(version: str, vendor: str = "nvidia"):
    return vllm_release(version, vendor)


def test_a100_log_reproduced_from_the_hardware():
    """From the A100's memory, the checkpoint and vLLM 0.19's rules: the logged tokens and concurrency, exactly."""
    capacity = plan(parse_spec(A100_SPEC)).replicas[0].capacity
    assert capacity.estimated
    assert round(capacity.available_kv_cache_gib, 2) == A100_LOG_AVAILABLE_GIB
    assert capacity.kv_cache_tokens == A100_LOG_TOKENS
    assert f"{capacity.max_concurrency:.2f}" == A100_LOG_CONCURRENCY


def test_a100_log_tokens_pin_the_block_count():
    """93,936 = num_blocks // 6 groups x 16: only 35,226..35,231 blocks log it, all inside the printed 21.5 GiB."""
    layout = kv_layout(CATALOG.model("26b-a4b"), 1, "auto", 16)
    logging_it = [
        n
        for n in range(35_200, 35_260)
        if kv_capacity(layout, n * layout.bytes_per_block, 131072, 2048, release("0.19.0")).tokens == A100_LOG_TOKENS
    ]
    assert logging_it == list(range(35_226, 35_232))
    for n in logging_it:
        assert round(n * layout.bytes_per_block / GiB, 2) == A100_LOG_AVAILABLE_GIB
        concurrency = kv_capacity(layout, n * layout.bytes_per_block, 131072, 2048, release("0.19.0")).max_concurrency
        assert f"{concurrency:.2f}" == A100_LOG_CONCURRENCY


def test_a100_memory_estimate_within_3_percent():
    capacity = plan(parse_spec(A100_SPEC)).replicas[0].capacity
    assert abs(capacity.available_kv_cache_gib - A100_LOG_AVAILABLE_GIB) / A100_LOG_AVAILABLE_GIB < 0.03


def test_textbook_formula_disagrees_with_vllm():
    """Bytes-per-token over all layers is not what vLLM logs; the grouped layout is (102,474 vs 93,936)."""
    model = CATALOG.model("26b-a4b")
    per_token = sum(2 * model.shape(k).kv_heads * model.shape(k).head_dim * 2 for k in model.kv_layer_kinds)
    textbook = int(A100_LOG_AVAILABLE_GIB * GiB) // per_token
    assert abs(textbook - A100_LOG_TOKENS) > 5000


@pytest.mark.parametrize(
    "alias, group_size, groups, kv_layers",
    [
        ("e2b", 3, 5, 15),  # 35 layers, 20 KV-shared: 12 sliding + 3 full own KV ("15 attention layers" on TPU)
        ("e4b", 4, 6, 24),  # 42 layers, 18 shared: 20 sliding + 4 full
        ("31b", 10, 6, 60),  # 50 sliding + 10 full
        ("26b-a4b", 5, 6, 30),  # 25 sliding + 5 full
    ],
)
def test_hybrid_groups(alias, group_size, groups, kv_layers):
    model = CATALOG.model(alias)
    layout = kv_layout(model, 1, "auto", 16)
    assert len(model.kv_layer_kinds) == kv_layers
    assert len(layout.groups) == groups
    assert layout.bytes_per_block == group_size * layout.groups[0].page_size_bytes


def test_page_sizes_unified_by_scaling_block_size():
    # 26B: sliding 8x256 and full 2x512 per token -> full layers get twice the block size.
    layout = kv_layout(CATALOG.model("26b-a4b"), 1, "auto", 16)
    assert {g.kind: g.block_size for g in layout.groups} == {"sliding": 16, "full": 32}
    assert len({g.page_size_bytes for g in layout.groups}) == 1


def test_small_models_scale_sliding_blocks_instead():
    layout = kv_layout(CATALOG.model("e2b"), 1, "auto", 16)
    assert {g.kind: g.block_size for g in layout.groups} == {"sliding": 32, "full": 16}


def test_tensor_parallel_splits_kv_heads():
    one = kv_layout(CATALOG.model("31b"), 1, "auto", 16)
    two = kv_layout(CATALOG.model("31b"), 2, "auto", 16)
    assert one.bytes_per_block == 2 * two.bytes_per_block


def test_kv_heads_replicate_when_tp_exceeds_them():
    # 31B full layers have 4 KV heads; at TP8 each rank still holds one.
    layout = kv_layout(CATALOG.model("31b"), 8, "auto", 16)
    full = next(g for g in layout.groups if g.kind == "full")
    assert full.kv_heads == 1


def test_fp8_doubles_blocks():
    model = CATALOG.model("31b")
    bf16 = kv_capacity(kv_layout(model, 2, "auto", 16), 20 * GiB, 32768, 8192, release("0.33.0"))
    fp8 = kv_capacity(kv_layout(model, 2, "fp8", 16), 20 * GiB, 32768, 8192, release("0.33.0"))
    assert fp8.num_blocks == 2 * bf16.num_blocks
    assert fp8.tokens in (2 * bf16.tokens, 2 * bf16.tokens + 1)


def test_sliding_window_reserve_one_batch_up_to_0_25():
    """window - 1 + max_num_batched_tokens, async scheduling or not, up to 0.25.1 (26B: 1023 + 2048 -> 193 blocks)."""
    sliding = next(g for g in kv_layout(CATALOG.model("26b-a4b"), 1, "auto", 16).groups if g.kind == "sliding")
    for asynchronous in (False, True):
        in_flight = release("0.25.1").in_flight_tokens(2048, asynchronous)
        assert sliding.blocks_per_request(131072, in_flight) == sliding.blocks_per_request(65536, in_flight) == 193


def test_sliding_window_reserve_counts_two_batches_in_flight_since_0_26():
    sliding = next(g for g in kv_layout(CATALOG.model("26b-a4b"), 1, "auto", 16).groups if g.kind == "sliding")
    assert release("0.26.0").in_flight_tokens(2048, async_scheduling=True) == 4096
    assert release("0.26.0").in_flight_tokens(2048, async_scheduling=False) == 2048
    assert sliding.blocks_per_request(131072, 4096) == 321  # cdiv(1023 + 4096, 16) + 1


@pytest.mark.parametrize(
    "alias, tp, max_model_len, overstated",
    [("31b", 2, 16384, 0.659), ("31b", 2, 32768, 0.655), ("31b", 2, 131072, 0.367), ("e2b", 1, 131072, 0.110)],
)
def test_old_reserve_overstates_the_default_pins_concurrency(alias, tp, max_model_len, overstated):
    """The 1x formula overstates a default GPU plan (the pinned 0.32.0, 8192 batched tokens, async) by ~10-65 %."""
    pinned = release(engine_pin("nvidia").vllm_version)
    layout = kv_layout(CATALOG.model(alias), tp, "auto", 16)
    new = kv_capacity(layout, 30 * GiB, max_model_len, pinned.in_flight_tokens(8192, True), pinned)
    old = kv_capacity(layout, 30 * GiB, max_model_len, 8192, pinned)
    assert round(old.max_concurrency / new.max_concurrency - 1, 3) == overstated


def test_token_report_switches_at_0_20_1():
    layout = kv_layout(CATALOG.model("26b-a4b"), 1, "auto", 16)
    available = 35_228 * layout.bytes_per_block
    before = kv_capacity(layout, available, 131072, 2048, release("0.20.0"))
    after = kv_capacity(layout, available, 131072, 2048, release("0.20.1"))
    assert before.num_blocks == after.num_blocks
    assert before.tokens == 35_228 // 6 * 16
    assert after.tokens == int(after.max_concurrency * 131072)


def test_31b_awq_jump_between_0_20_0_and_0_21_0():
    """vllm-project/vllm#43308: the same ~50 GB of KV logged ~55k tokens on 0.20.0 and ~525k on 0.21.0 (A100)."""
    layout = kv_layout(CATALOG.model("31b"), 1, "auto", 16)
    assert round(kv_capacity(layout, 50 * GiB, 131072, 2048, release("0.20.0")).tokens, -3) == 55_000
    assert 500_000 < kv_capacity(layout, 50 * GiB, 131072, 2048, release("0.21.0")).tokens < 550_000


def test_fit_check_holds_back_the_null_block_since_0_29():
    layout = kv_layout(CATALOG.model("31b"), 2, "auto", 16)
    needed = kv_capacity(layout, GiB, 32768, 8192, release("0.28.0")).needed_bytes
    assert kv_capacity(layout, needed, 32768, 8192, release("0.28.0")).fits
    assert not kv_capacity(layout, needed, 32768, 8192, release("0.29.0")).fits
    assert kv_capacity(layout, needed + layout.bytes_per_block, 32768, 8192, release("0.29.0")).fits


def test_runtime_overhead_grows_with_batch_budget():
    model = CATALOG.model("31b")
    assert runtime_overhead_gib(model, 8192, 256) > runtime_overhead_gib(model, 2048, 256)


# TPU (tpu-inference) -----------------------------------------------------------------------------


def test_tpu_pages_of_e2b_on_v6e_4():
    """fp8 packs 4 values per 32 bits: 1 KV head padded to one per chip -> (16, 4, 4, 256) bytes x 4 chips."""
    assert tpu_page_size_bytes(16, 1, 256, "fp8", 4) == 16 * 4 * 256 * 4
    assert tpu_page_size_bytes(16, 1, 512, "fp8", 4) == 16 * 4 * 512 * 4
    layout = tpu_kv_layout(CATALOG.model("e2b"), 4, "fp8", 16)
    assert layout.bytes_per_block == 12 * 65_536 + 3 * 131_072
    assert len(layout.groups) == 1 and layout.groups[0].sliding_window is None


def test_tpu_block_size_rules():
    assert tpu_block_size(16384, 128) == 16
    assert tpu_block_size(16384, 256) == 32  # get_min_page_size: 16384 tokens in at most 512 pages
    assert tpu_block_size(2048, 256) == 128  # next power of two of max_model_len / 16
    assert tpu_block_size(1024, 256) == 64
    assert tpu_block_size(8192, 1024) == 256  # capped at 256
    assert tpu_block_size(32768, 1024) == 256  # 32768 tokens in at most 128 pages


def test_tpu_log_blocks_and_tokens_from_its_memory():
    """With 16-token blocks (max_num_seqs <= 128) the slice's memory gives the logged blocks and tokens exactly."""
    spec = parse_spec({**TPU_SPEC, "workload": {**TPU_SPEC["workload"], "max_num_seqs": 128}})
    capacity = plan(spec).replicas[0].capacity
    assert capacity.block_size == 16
    assert capacity.num_blocks == TPU_LOG_BLOCKS
    assert capacity.kv_cache_tokens == TPU_LOG_TOKENS


def test_tpu_log_with_default_max_num_seqs_takes_32_token_blocks():
    """The server's command set no --max-num-seqs: tpu-inference 0.32 then picks 32-token blocks, whose whole
    blocks cannot log 296,368 tokens (an odd number of 16-token blocks); the same memory gives 296,352."""
    capacity = plan(parse_spec(TPU_SPEC)).replicas[0].capacity
    assert capacity.block_size == 32
    assert capacity.num_blocks == TPU_LOG_BLOCKS // 2
    assert capacity.kv_cache_tokens == 296_352


def test_tpu_kv_per_chip_is_not_the_logged_12_53_gib():
    """18,523 blocks hold 5.09 GiB per chip; 12.53 GiB is about the utilization cap, 0.4 x 31.25 GiB."""
    layout = tpu_kv_layout(CATALOG.model("e2b"), 4, "fp8", 16)
    per_chip = TPU_LOG_BLOCKS * layout.bytes_per_block / 4 / GiB
    assert round(per_chip, 2) == 5.09
    assert round(0.4 * 31.25, 2) == 12.5


def test_prefix_cache_hits_are_multiples_of_the_groups_lcm():
    """A prefix-cache hit lands on the lcm of the groups' block sizes. The sandbox's tiny model on vLLM 0.32.0's
    CPU build logged "kv cache group sizes (256, 256, 256, 128)" and "kv lcm block sizes 256" (2026-11-25), and
    a conversation's second turn found 0 cached tokens where its first turn's prompt held one full 128-token
    block and 223 tokens in all; the third found 256. The oracle checks the lcm against every release's groups."""
    sandbox = plan(parse_spec({"model": "tiny", "accelerator": {"kind": "cpu", "count": 1}})).require_ok()
    assert (sandbox.replicas[0].capacity.block_size, sandbox.replicas[0].capacity.prefix_cache_block) == (128, 256)
    assert kv_layout(CATALOG.model("26b-a4b"), 1, "auto", 16).prefix_cache_block == 32
    assert kv_layout(CATALOG.model("e2b"), 1, "auto", 16).prefix_cache_block == 32
    # One group on TPU: its block.
    assert tpu_kv_layout(CATALOG.model("e2b"), 4, "fp8", 16).prefix_cache_block == 16
