"""KV-cache accounting reproduces vLLM's own numbers (seed 05) and its hybrid-layout rules."""

import pytest

from gemmaserve.catalog import CATALOG, GiB
from gemmaserve.kv_cache import kv_capacity, kv_layout, runtime_overhead_gib
from gemmaserve.plan import plan
from gemmaserve.spec import parse_spec

# Seed 05: vLLM 0.19, one A100 80GB, gemma-4-26B-A4B, --max-model-len 131072, utilization 0.9.
SEED05_AVAILABLE_GIB = 21.5
SEED05_TOKENS = 93_936
SEED05_CONCURRENCY = "6.96"
SEED05_SPEC = {
    "model": "26b-a4b",
    "accelerator": {"kind": "a100-80gb", "count": 1},
    "workload": {"max_model_len": 131072, "gpu_memory_utilization": 0.9, "enforce_eager": True},
    "engine": {"vllm_version": "0.19.0"},
}


def test_seed05_tokens_from_logged_available_memory():
    replica = plan(parse_spec(SEED05_SPEC), available_kv_gib=SEED05_AVAILABLE_GIB).replicas[0]
    block = 16  # the smallest block size in the layout; vLLM reports tokens in whole blocks per group
    assert abs(replica.capacity.kv_cache_tokens - SEED05_TOKENS) <= block


def test_seed05_concurrency_from_logged_available_memory():
    replica = plan(parse_spec(SEED05_SPEC), available_kv_gib=SEED05_AVAILABLE_GIB).replicas[0]
    assert f"{replica.capacity.max_concurrency:.2f}" == SEED05_CONCURRENCY


def test_seed05_available_memory_estimated_from_hardware_within_3_percent():
    replica = plan(parse_spec(SEED05_SPEC)).replicas[0]
    assert replica.capacity.estimated
    assert abs(replica.capacity.available_kv_cache_gib - SEED05_AVAILABLE_GIB) / SEED05_AVAILABLE_GIB < 0.03


def test_seed05_weights_per_device():
    replica = plan(parse_spec(SEED05_SPEC)).replicas[0]
    assert replica.capacity.weights_gib_per_device == 48.5


def test_textbook_formula_disagrees_with_vllm():
    """Bytes-per-token over all layers is not what vLLM logs; the grouped layout is (102,474 vs 93,936)."""
    model = CATALOG.model("26b-a4b")
    per_token = sum(2 * model.shape(k).kv_heads * model.shape(k).head_dim * 2 for k in model.kv_layer_kinds)
    textbook = int(SEED05_AVAILABLE_GIB * GiB) // per_token
    assert abs(textbook - SEED05_TOKENS) > 5000


@pytest.mark.parametrize(
    "alias, group_size, groups, kv_layers",
    [
        ("e2b", 3, 5, 15),  # 35 layers, 20 KV-shared: 12 sliding + 3 full own KV (seed 03: 15 layers)
        ("e4b", 4, 6, 24),  # 42 layers, 18 shared: 20 sliding + 4 full
        ("31b", 10, 6, 60),  # 50 sliding + 10 full
        ("26b-a4b", 5, 6, 30),  # 25 sliding + 5 full
    ],
)
def test_hybrid_groups(alias, group_size, groups, kv_layers):
    model = CATALOG.model(alias)
    layout = kv_layout(model, 1, "auto", 16)
    assert len(model.kv_layer_kinds) == kv_layers
    assert layout.group_size == group_size
    assert len(layout.groups) == groups


def test_page_sizes_unified_by_scaling_block_size():
    # 26B: sliding 8x256 and full 2x512 per token -> full layers get twice the block size.
    layout = kv_layout(CATALOG.model("26b-a4b"), 1, "auto", 16)
    sizes = {g.kind: g.block_size for g in layout.groups}
    assert sizes == {"sliding": 16, "full": 32}
    assert len({g.page_size_bytes for g in layout.groups}) == 1


def test_small_models_scale_sliding_blocks_instead():
    layout = kv_layout(CATALOG.model("e2b"), 1, "auto", 16)
    assert {g.kind: g.block_size for g in layout.groups} == {"sliding": 32, "full": 16}


def test_tensor_parallel_splits_kv_heads():
    one = kv_layout(CATALOG.model("31b"), 1, "auto", 16)
    two = kv_layout(CATALOG.model("31b"), 2, "auto", 16)
    assert one.page_size_bytes == 2 * two.page_size_bytes


def test_kv_heads_replicate_when_tp_exceeds_them():
    # 31B full layers have 4 KV heads; at TP8 each rank still holds one.
    layout = kv_layout(CATALOG.model("31b"), 8, "auto", 16)
    full = next(g for g in layout.groups if g.kind == "full")
    assert full.kv_heads == 1


def test_fp8_doubles_tokens():
    model = CATALOG.model("31b")
    bf16 = kv_capacity(kv_layout(model, 2, "auto", 16), 20 * GiB, 32768, 8192)
    fp8 = kv_capacity(kv_layout(model, 2, "fp8", 16), 20 * GiB, 32768, 8192)
    assert fp8.num_blocks == 2 * bf16.num_blocks
    assert abs(fp8.tokens - 2 * bf16.tokens) <= 16  # whole blocks per group


def test_sliding_window_bounds_per_request_blocks():
    """A sliding group needs window + batch tokens, not max_model_len: concurrency grows with length less."""
    layout = kv_layout(CATALOG.model("26b-a4b"), 1, "auto", 16)
    sliding = next(g for g in layout.groups if g.kind == "sliding")
    assert sliding.blocks_per_request(131072, 2048) == sliding.blocks_per_request(65536, 2048) == 193


def test_overhead_grows_with_batch_budget():
    model = CATALOG.model("31b")
    assert runtime_overhead_gib(model, 8192, 256) > runtime_overhead_gib(model, 2048, 256)


def test_newer_vllm_reports_tokens_as_concurrency_times_length():
    data = {**SEED05_SPEC, "engine": {"vllm_version": "0.32.0"}}
    replica = plan(parse_spec(data), available_kv_gib=SEED05_AVAILABLE_GIB).replicas[0]
    old = plan(parse_spec(SEED05_SPEC), available_kv_gib=SEED05_AVAILABLE_GIB).replicas[0]
    assert replica.capacity.num_blocks == old.capacity.num_blocks
    assert replica.capacity.kv_cache_tokens == int(replica.capacity.max_concurrency * 131072)
