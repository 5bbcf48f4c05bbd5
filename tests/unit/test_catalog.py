"""The catalog's facts hold together and match their public sources."""

import pytest

from gemmaserve.catalog import CATALOG


def test_aliases_are_unique():
    names = [n for m in CATALOG.models for n in (m.hf_id.lower(), *m.aliases)]
    assert len(names) == len(set(names))


@pytest.mark.parametrize(
    "alias, hf_id",
    [
        ("e2b", "google/gemma-4-E2B-it"),
        ("e4b", "google/gemma-4-E4B-it"),
        ("31b", "google/gemma-4-31B-it"),
        ("26b-a4b", "google/gemma-4-26B-A4B-it"),
    ],
)
def test_aliases_resolve(alias, hf_id):
    assert CATALOG.model(alias).hf_id == hf_id
    assert CATALOG.model(hf_id.upper()).hf_id == hf_id


def test_31b_architecture():
    m = CATALOG.model("31b")
    assert m.layer_kinds.count("sliding") == 50 and m.layer_kinds.count("full") == 10
    assert m.layer_kinds[:6] == ("sliding",) * 5 + ("full",)
    assert (m.sliding.kv_heads, m.sliding.head_dim, m.full.kv_heads, m.full.head_dim) == (16, 256, 4, 512)
    assert m.sliding_window == 1024 and m.attention_k_eq_v


def test_26b_architecture():
    m = CATALOG.model("26b-a4b")
    assert m.num_layers == 30 and m.layer_kinds.count("full") == 5
    assert (m.sliding.kv_heads, m.full.kv_heads) == (8, 2)
    assert (m.num_experts, m.experts_per_token) == (128, 8)


def test_e2b_kv_layers_match_the_v6e4_writeup():
    # the v6e-4 write-up: "Number of Attention Layers: 15" for E2B (35 layers, 20 reuse earlier KV).
    assert len(CATALOG.model("e2b").kv_layer_kinds) == 15


@pytest.mark.parametrize("alias, context", [("e2b", 131072), ("e4b", 131072), ("31b", 262144), ("26b-a4b", 262144)])
def test_max_context(alias, context):
    assert CATALOG.model(alias).max_context == context


@pytest.mark.parametrize("alias, audio", [("e2b", True), ("e4b", True), ("31b", False), ("26b-a4b", False)])
def test_audio_only_on_small_models(alias, audio):
    assert CATALOG.model(alias).supports_audio is audio


def test_31b_and_26b_a4b_have_mtp_assistants():
    assert {m.aliases[0]: (m.mtp_assistant, m.mtp_assistant_bytes) for m in CATALOG.models if m.mtp_assistant} == {
        "31b": ("google/gemma-4-31B-it-assistant", 940_000_000),
        "26b-a4b": ("google/gemma-4-26B-A4B-it-assistant", 839_427_840),
    }


@pytest.mark.parametrize(
    "alias, total_size, bf16_parameters",
    [
        # metadata.total_size of the published safetensors index / the Hub API's BF16 parameter count
        ("31b", 62_546_177_752, 31_273_088_876),
        ("26b-a4b", 51_611_872_412, 25_805_936_206),
        # single-file checkpoints (no index): 2 bytes x the Hub API's BF16 parameter count
        ("e2b", 10_246_356_102, 5_123_178_051),
        ("e4b", 15_992_312_980, 7_996_156_490),
    ],
)
def test_checkpoint_bytes_are_the_published_bf16_tensors(alias, total_size, bf16_parameters):
    assert CATALOG.model(alias).checkpoint_bytes == total_size == 2 * bf16_parameters


def test_26b_checkpoint_is_below_what_vllm_0_19_reported_loading():
    """A real vLLM 0.19 on one A100 logged "Model loading took 48.5 GiB": checkpoint plus load-time buffers."""
    assert 48.0 < CATALOG.model("26b-a4b").weights_gib < 48.5


def test_vision_towers_are_inside_the_checkpoint():
    for model in CATALOG.models:
        assert 0 <= model.vision_tower_bytes < model.checkpoint_bytes


@pytest.mark.parametrize(
    "name",
    [
        "a100-40gb",
        "a100-80gb",
        "h100-80gb",
        "h200",
        "b200",
        "rtx-pro-6000",
        "l4",
        "mi300x",
        "mi325x",
        "mi355x",
        "tpu-v5e",
        "tpu-v6e",
        "tpu-v7",
        "cpu",
    ],
)
def test_every_accelerator_listed(name):
    acc = CATALOG.accelerator(name)
    assert acc.memory_gib > 0 and acc.interconnect and acc.vendor


@pytest.mark.parametrize(
    "name, count, machine_type",
    [
        ("rtx-pro-6000", 8, "g4-standard-384"),
        ("rtx-pro-6000", 1, "g4-standard-48"),
        ("a100-80gb", 1, "a2-ultragpu-1g"),
        ("a100-40gb", 8, "a2-highgpu-8g"),
        ("h100-80gb", 8, "a3-highgpu-8g"),
        ("l4", 1, "g2-standard-8"),
    ],
)
def test_gcp_machine_types(name, count, machine_type):
    assert CATALOG.accelerator(name).machine_type_for(count).name == machine_type


@pytest.mark.parametrize("chips, accelerator_type", [(1, "v6e-1"), (4, "v6e-4"), (8, "v6e-8")])
def test_v6e_types_and_runtime(chips, accelerator_type):
    tpu = CATALOG.accelerator("tpu-v6e").tpu_type_for(chips)
    assert tpu.accelerator_type == accelerator_type
    assert tpu.runtime_version == "v2-alpha-tpuv6e"


def test_v6e_hbm_per_chip_matches_the_v6e4_writeup():
    assert CATALOG.accelerator("tpu-v6e").memory_gib == 31.25


def test_interconnects():
    assert CATALOG.accelerator("rtx-pro-6000").interconnect == "pcie"  # Callstack's write-up: PCIe Gen5 x16
    assert CATALOG.accelerator("h100-80gb").interconnect == "nvswitch"
    assert CATALOG.accelerator("mi300x").interconnect == "xgmi"
    assert CATALOG.accelerator("tpu-v6e").interconnect == "ici"


def test_unknown_names_raise():
    with pytest.raises(KeyError):
        CATALOG.model("gemma-3")
    with pytest.raises(KeyError):
        CATALOG.accelerator("v100")
