"""Any Gemma 4 checkpoint planned from its own files: config.json, weight bytes, quantization_config, LoRA adapters.

Fixtures under checkpoints/ (their sources in checkpoints/README.md). Hub checkpoints are read from a Hugging Face
cache laid out in a temporary HF_HOME, as huggingface_hub writes it; nothing here reaches a network.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import huggingface_hub.constants
import pytest
from huggingface_hub.errors import EntryNotFoundError
from typer.testing import CliRunner

from gemmaserve.catalog import CATALOG
from gemmaserve.checkpoint import (
    CheckpointError,
    CheckpointRef,
    architecture,
    load_checkpoint,
    parse_quantization,
    same_architecture,
)
from gemmaserve.ops.cli import app
from gemmaserve.plan import lora_slot_bytes, plan
from gemmaserve.spec import SpecError, parse_spec

FIXTURES = Path(__file__).parent / "checkpoints"
STOCK = {
    "e2b": "gemma-4-E2B-it",
    "e4b": "gemma-4-E4B-it",
    "31b": "gemma-4-31B-it",
    "26b-a4b": "gemma-4-26B-A4B-it",
}


def stock_config(alias: str) -> dict:
    return json.loads((FIXTURES / "configs" / f"{STOCK[alias]}.json").read_text())


def write_safetensors_header(path: Path, tensor_bytes: list[int]) -> None:
    """A model.safetensors whose header declares tensors of these sizes; the data is never read, so none is written."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for i, size in enumerate(tensor_bytes):
        header[f"t{i}"] = {"dtype": "U8", "shape": [size], "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


def checkpoint_dir(root: Path, config: dict, total_bytes: int, single_file: bool = False) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    if single_file:
        write_safetensors_header(root / "model.safetensors", [total_bytes // 2, total_bytes - total_bytes // 2])
    else:
        index = {
            "metadata": {"total_size": total_bytes},
            "weight_map": {"model.norm.weight": "model-00001.safetensors"},
        }
        (root / "model.safetensors.index.json").write_text(json.dumps(index))
    return root


def fine_tune_of(alias: str, root: Path) -> Path:
    base = CATALOG.model(alias)
    # E2B and E4B ship one model.safetensors (no index): their bytes come from the file's header.
    return checkpoint_dir(root, stock_config(alias), base.checkpoint_bytes, single_file=alias in ("e2b", "e4b"))


def hub_cache(hf_home: Path, repo: str, files: dict[str, str], commit: str = "a" * 40) -> None:
    """The cache layout huggingface_hub writes: snapshots/<commit>/<file> and refs/main naming the commit."""
    repo_dir = hf_home / "hub" / f"models--{repo.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, text in files.items():
        (snapshot / name).write_text(text)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)


@pytest.fixture(autouse=True)
def fresh_cache():
    load_checkpoint.cache_clear()
    yield
    load_checkpoint.cache_clear()


# --- the catalog is the oracle of config.json parsing, and config.json of the catalog ----------------------------


@pytest.mark.parametrize("alias", list(STOCK))
def test_published_config_gives_the_catalog_architecture(alias: str) -> None:
    info = CATALOG.model(alias)
    fields = architecture(stock_config(alias), CheckpointRef(info.hf_id))
    assert fields == {f: getattr(info, f) for f in fields}


@pytest.mark.parametrize("alias", list(STOCK))
def test_fine_tune_dir_is_read_as_its_base(alias: str, tmp_path: Path) -> None:
    root = fine_tune_of(alias, tmp_path / f"my-{alias}-ft")
    checkpoint = load_checkpoint(str(root))
    base = CATALOG.model(alias)
    assert checkpoint.base == base and checkpoint.quantization is None
    assert same_architecture(checkpoint.info, base)
    assert checkpoint.info.checkpoint_bytes == base.checkpoint_bytes
    assert checkpoint.info.vision_tower_bytes == base.vision_tower_bytes
    assert checkpoint.info.mtp_assistant == base.mtp_assistant
    assert checkpoint.info.hf_id == f"my-{alias}-ft" and checkpoint.info.local_dir == str(root)


def saved_by_transformers(config: dict) -> dict:
    """The config as transformers 5.19.0 saves it (Gemma4TextConfig.__post_init__ turns global_head_dim and
    num_global_key_value_heads into per_layer_config, and save_pretrained writes that): every fine-tune saved with it."""
    text = dict(config["text_config"])
    kinds = text.get("layer_types") or []
    overrides = {"head_dim": text.pop("global_head_dim", 512)}
    global_heads = text.pop("num_global_key_value_heads", None)
    if text.get("attention_k_eq_v", True) and global_heads is not None:
        overrides["num_key_value_heads"] = global_heads
    text["per_layer_config"] = {str(i): overrides for i, kind in enumerate(kinds) if kind == "full_attention"}
    return {**config, "text_config": text}


@pytest.mark.parametrize("alias", list(STOCK))
def test_a_config_saved_by_transformers_519_gives_the_same_architecture(alias: str) -> None:
    # The tiny test model's own config.json has this form (per_layer_config {"3": {"head_dim": 64}}); read as
    # global_head_dim's default it planned 512-wide full layers, a fifth of the KV tokens vLLM reports.
    info = CATALOG.model(alias)
    saved = saved_by_transformers(stock_config(alias))
    assert "global_head_dim" not in saved["text_config"]
    fields = architecture(saved, CheckpointRef(info.hf_id))
    assert fields == {f: getattr(info, f) for f in fields}


def test_per_layer_shapes_that_differ_within_a_kind_are_refused() -> None:
    saved = saved_by_transformers(stock_config("31b"))
    first_full = next(iter(saved["text_config"]["per_layer_config"]))
    saved["text_config"]["per_layer_config"][first_full] = {"head_dim": 128}
    with pytest.raises(CheckpointError, match="per_layer_config: layers of one attention type differ"):
        architecture(saved, CheckpointRef("x/y"))


SETUPS = [
    ("31b", {"kind": "rtx-pro-6000", "count": 8}, {}),
    ("31b", {"kind": "h100-80gb", "count": 2}, {"speculative": {"method": "mtp"}}),
    ("26b-a4b", {"kind": "a100-80gb", "count": 1}, {"max_model_len": 8192}),
    ("e4b", {"kind": "l4", "count": 1}, {}),
    ("e2b", {"kind": "tpu-v6e", "count": 4}, {"kv_cache_dtype": "fp8"}),
]


@pytest.mark.parametrize("alias, accelerator, workload", SETUPS)
def test_fine_tune_plans_exactly_like_its_base(alias, accelerator, workload, tmp_path: Path) -> None:
    root = fine_tune_of(alias, tmp_path / "ft")
    # MTP beside a directory: the replicas run offline, so the assistant is pinned and the weights role downloads it.
    mtp = workload.get("speculative", {}).get("method") == "mtp"
    weights = {"weights": {"assistant_revision": "e" * 40}} if mtp else {}
    base = plan(parse_spec({"model": alias, "accelerator": accelerator, "workload": workload} | weights))
    tuned = plan(parse_spec({"model": str(root), "accelerator": accelerator, "workload": workload} | weights))
    assert tuned.ok and base.ok, tuned.refusals
    for b, t in zip(base.replicas, tuned.replicas, strict=True):
        assert t.capacity == b.capacity
        # The same command but for what is served: the directory, under its own name (and where the MTP assistant
        # is read: its downloaded snapshot, not vLLM's own download).
        assert t.argv[:3] == ["vllm", "serve", str(root)]
        assert t.argv[3:5] == ["--served-model-name", "ft"]
        tuned_argv, base_argv = t.argv[5:], b.argv[3:]
        if mtp:
            at = tuned_argv.index("--speculative-config") + 1
            hub = json.loads(base_argv[at])  # online replicas: vLLM downloads the assistant at the pinned revision
            assert hub.pop("revision") == "e" * 40
            snapshot = f"/var/lib/gemmaserve/hf/hub/models--google--gemma-4-31B-it-assistant/snapshots/{'e' * 40}"
            assert json.loads(tuned_argv[at]) == hub | {"model": snapshot}
            tuned_argv, base_argv = tuned_argv[:at] + tuned_argv[at + 1 :], base_argv[:at] + base_argv[at + 1 :]
        assert tuned_argv == base_argv
        assert t.env["HF_HUB_OFFLINE"] == "1"


def test_hub_fine_tune_is_read_from_the_local_cache(tmp_path: Path, monkeypatch) -> None:
    config = json.dumps(stock_config("31b"))
    index = json.dumps({"metadata": {"total_size": CATALOG.model("31b").checkpoint_bytes}, "weight_map": {}})
    commit = "b" * 40
    hub_cache(
        tmp_path / "hf", "my-org/gemma4-31b-ft", {"config.json": config, "model.safetensors.index.json": index}, commit
    )
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    spec = parse_spec({"model": "my-org/gemma4-31b-ft", "accelerator": {"kind": "h200", "count": 1}})
    result = plan(spec)
    base = plan(parse_spec({"model": "31b", "accelerator": {"kind": "h200", "count": 1}}))
    assert result.replicas[0].argv[2] == "my-org/gemma4-31b-ft"
    assert result.replicas[0].capacity == base.replicas[0].capacity
    # Pinned to the commit the cache holds: read at that revision too.
    pinned = parse_spec(
        {"model": "my-org/gemma4-31b-ft", "accelerator": {"kind": "h200"}, "weights": {"revision": commit}}
    )
    assert pinned.model_info.checkpoint_bytes == CATALOG.model("31b").checkpoint_bytes


def test_hub_checkpoint_not_in_the_cache_says_what_to_fetch(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(SpecError) as error:
        parse_spec({"model": "my-org/not-here", "accelerator": {"kind": "h200"}})
    message = str(error.value)
    assert "model = 'my-org/not-here'" in message
    assert "not in the local Hugging Face cache" in message
    assert "huggingface-cli download my-org/not-here config.json model.safetensors.index.json" in message


def test_a_checkpoint_that_is_not_gemma4_is_refused_by_name(tmp_path: Path) -> None:
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 32}
    root = checkpoint_dir(tmp_path / "llama", config, 16_000_000_000)
    with pytest.raises(SpecError) as error:
        parse_spec({"model": str(root), "accelerator": {"kind": "h200"}})
    message = str(error.value)
    assert "model_type = 'llama'" in message and "LlamaForCausalLM" in message
    assert "allowed: model_type gemma4 or gemma4_text" in message


def test_a_directory_without_config_json_is_named(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecError, match="has no config.json"):
        parse_spec({"model": str(tmp_path / "empty"), "accelerator": {"kind": "h200"}})


def test_a_model_that_is_neither_name_nor_path_is_refused() -> None:
    with pytest.raises(SpecError) as error:
        parse_spec({"model": "not a model", "accelerator": {"kind": "h200"}})
    assert "e2b" in str(error.value) and "Hugging Face id OWNER/NAME" in str(error.value)


def test_irregular_layer_types_are_refused(tmp_path: Path) -> None:
    config = stock_config("31b")
    config["text_config"]["layer_types"][0] = "full_attention"
    root = checkpoint_dir(tmp_path / "odd", config, 10**9)
    with pytest.raises(SpecError, match="layer_types"):
        parse_spec({"model": str(root), "accelerator": {"kind": "h200"}})


def test_a_checkpoints_short_name_is_a_label_value(tmp_path: Path) -> None:
    root = fine_tune_of("31b", tmp_path / ("Very.Long-" * 10 + "FT"))
    alias = load_checkpoint(str(root)).info.aliases[0]
    assert len(alias) <= 63 and re.fullmatch(r"[a-z0-9][a-z0-9_-]*[a-z0-9]", alias)


def test_single_file_bytes_are_the_header_sums(tmp_path: Path) -> None:
    root = fine_tune_of("e2b", tmp_path / "e2b-ft")
    assert load_checkpoint(str(root)).info.checkpoint_bytes == 10_246_356_102


def test_a_smaller_text_only_gemma4_plans_from_its_own_numbers(tmp_path: Path) -> None:
    """A Gemma4ForCausalLM text-only checkpoint of no stock size: its own shapes, no towers, no base."""
    # No layer_types: transformers' default, every 6th layer full.
    text = stock_config("31b")["text_config"] | {"num_hidden_layers": 12, "layer_types": None}
    config = {"architectures": ["Gemma4ForCausalLM"], **text}
    root = checkpoint_dir(tmp_path / "tiny-31b-shape", config, 12 * 10**9)
    checkpoint = load_checkpoint(str(root))
    assert checkpoint.base is None and checkpoint.info.modalities == frozenset({"text"})
    assert checkpoint.info.kv_layer_kinds.count("full") == 2
    assert plan(parse_spec({"model": str(root), "accelerator": {"kind": "h100-80gb"}})).ok


# --- quantized checkpoints ------------------------------------------------------------------------------------------

QUANTIZED = {
    # fixture: (method as vLLM names it, scheme, min capability, native capability)
    "ct-fp8-static": ("compressed-tensors", "fp8-w8a8-static", 75, 89),
    "ct-fp8-dynamic": ("compressed-tensors", "fp8-w8a8-dynamic", 75, 89),
    "ct-w8a8-int8": ("compressed-tensors", "int8-w8a8", 75, 75),
    "ct-nvfp4": ("compressed-tensors", "nvfp4", 75, 100),
    "ct-w4a16": ("compressed-tensors", "int4-w4a16", 75, 75),
    "modelopt-fp8": ("modelopt", "fp8", 80, 89),
    "modelopt-nvfp4": ("modelopt_fp4", "nvfp4", 75, 100),
    "awq": ("auto_awq", "int4-w4a16", 75, 75),
    "gptq": ("auto_gptq", "int4-w4a16", 60, 60),
    "fp8-block": ("fp8", "fp8-block", 75, 89),
}


def quantization_config(name: str) -> dict:
    return json.loads((FIXTURES / "quantization" / f"{name}.json").read_text())


@pytest.mark.parametrize("name", list(QUANTIZED))
def test_quantization_config_is_read(name: str) -> None:
    q = parse_quantization(quantization_config(name))
    assert (q.method, q.scheme, q.min_capability, q.native_capability) == QUANTIZED[name]
    assert q.flags == () and "v0.32.0" in q.source


def test_mixed_precision_groups_take_the_most_demanding() -> None:
    """FP8 attention with NVFP4 MLPs: NVFP4's native capability, FP8's TPU support limited by NVFP4's none."""
    fp8, nvfp4 = quantization_config("ct-fp8-dynamic"), quantization_config("ct-nvfp4")
    mixed = fp8 | {"config_groups": {"attn": fp8["config_groups"]["group_0"], "mlp": nvfp4["config_groups"]["group_0"]}}
    q = parse_quantization(mixed)
    assert (q.scheme, q.min_capability, q.native_capability, q.tpu_layers) == (
        "fp8-w8a8-dynamic+nvfp4",
        75,
        100,
        "none",
    )


def test_unknown_quantization_is_refused_by_name() -> None:
    with pytest.raises(CheckpointError, match="quant_method = 'bitsandbytes'.*allowed: compressed-tensors"):
        parse_quantization({"quant_method": "bitsandbytes"})


def quantized_dir(tmp_path: Path, name: str, total_bytes: int) -> Path:
    config = stock_config("31b") | {"quantization_config": quantization_config(name)}
    return checkpoint_dir(tmp_path / f"31b-{name}", config, total_bytes)


def test_nvfp4_weights_count_their_packed_bytes(tmp_path: Path) -> None:
    """The index's total_size is what is on disk, packed: a quarter-size 31B plans with a quarter of the weights."""
    quarter = CATALOG.model("31b").checkpoint_bytes // 4
    root = quantized_dir(tmp_path, "ct-nvfp4", quarter)
    result = plan(parse_spec({"model": str(root), "accelerator": {"kind": "b200", "count": 1}}))
    assert result.ok and result.quantization.method == "compressed-tensors"
    assert result.replicas[0].capacity.weights_gib_per_device == pytest.approx(quarter / 1024**3, abs=0.01)
    assert "--quantization" not in result.replicas[0].argv
    assert not [w for w in result.warnings if "weight-only" in w]


@pytest.mark.parametrize(
    "name, accelerator, outcome",
    [
        ("ct-nvfp4", "b200", "native"),
        ("ct-nvfp4", "h100-80gb", "weight-only"),
        ("ct-fp8-dynamic", "l4", "native"),
        ("ct-fp8-dynamic", "a100-80gb", "weight-only"),
        ("modelopt-fp8", "a100-80gb", "weight-only"),
        ("ct-w8a8-int8", "a100-80gb", "native"),
        ("awq", "mi300x", "native"),
        # tpu-inference 0.32.0's JAX path: FP8 W8A8, fp8 and dense INT4 W4A16 only
        ("ct-fp8-static", "tpu-v6e", "native"),
        ("fp8-block", "tpu-v6e", "native"),
        ("ct-w4a16", "tpu-v6e", "native"),
        ("ct-nvfp4", "tpu-v6e", "refused"),
        ("awq", "tpu-v6e", "refused"),
        ("ct-w8a8-int8", "tpu-v6e", "refused"),
    ],
)
def test_hardware_rules(name, accelerator, outcome, tmp_path: Path) -> None:
    root = quantized_dir(tmp_path, name, 8 * 10**9)
    count = 4 if accelerator == "tpu-v6e" else 1
    result = plan(parse_spec({"model": str(root), "accelerator": {"kind": accelerator, "count": count}}))
    weight_only = [w for w in result.warnings if "weight-only kernels" in w]
    assert (not result.ok, bool(weight_only)) == {
        "native": (False, False),
        "weight-only": (False, True),
        "refused": (True, False),
    }[outcome], (result.refusals, result.warnings)


@pytest.mark.parametrize(
    "name, warning",
    [
        # served by vLLM's CPU build (tests/vllm/test_served_variants.py): no warning
        ("ct-w8a8-int8", None),
        ("awq", None),
        # loading fails without AMX (docs/checkpoints.md, "Tried on the CPU build")
        ("ct-fp8-dynamic", "FP8 weights only on CPUs with AMX"),
        ("fp8-block", "FP8 weights only on CPUs with AMX"),
        # never tried
        ("gptq", "not checked by gemmaserve"),
        ("ct-nvfp4", "not checked by gemmaserve"),
    ],
)
def test_cpu_rules(name: str, warning: str | None, tmp_path: Path) -> None:
    root = quantized_dir(tmp_path, name, 8 * 10**9)
    spec = {"model": str(root), "accelerator": {"kind": "cpu", "count": 1}, "workload": {"max_model_len": 1024}}
    result = plan(parse_spec(spec))
    assert result.ok, result.refusals
    found = [w for w in result.warnings if "is quantized" in w]
    assert (found == []) if warning is None else (len(found) == 1 and warning in found[0]), found


def test_tpu_quantizes_moe_experts_only_as_fp8(tmp_path: Path) -> None:
    def moe(name: str) -> Path:
        config = stock_config("26b-a4b") | {"quantization_config": quantization_config(name)}
        return checkpoint_dir(tmp_path / f"26b-{name}", config, 14 * 10**9)

    tpu = {"kind": "tpu-v6e", "count": 4}
    refused = plan(parse_spec({"model": str(moe("ct-w4a16")), "accelerator": tpu}))
    assert not refused.ok and "MoE experts only as FP8 W8A8" in refused.refusals[0]
    assert plan(parse_spec({"model": str(moe("ct-fp8-dynamic")), "accelerator": tpu})).ok


def test_a_gpu_below_the_minimum_capability_is_refused(tmp_path: Path, monkeypatch) -> None:
    root = quantized_dir(tmp_path, "modelopt-fp8", 20 * 10**9)
    spec = parse_spec({"model": str(root), "accelerator": {"kind": "l4"}})
    monkeypatch.setattr(
        type(spec), "accelerator_info", property(lambda s: replace(s.accelerator.info, compute_capability=75))
    )
    result = plan(spec)
    assert not result.ok
    assert "compute capability >= 8" in result.refusals[0] and "modelopt.py" in result.refusals[0]


def test_modelopt_fp8_kv_cache_is_what_auto_becomes(tmp_path: Path) -> None:
    """vLLM resolves --kv-cache-dtype auto to the checkpoint's kv_cache_quant_algo: twice the tokens of BF16 KV."""
    assert parse_quantization(quantization_config("modelopt-fp8")).kv_cache_dtype == "fp8_e4m3"
    assert parse_quantization(quantization_config("modelopt-nvfp4")).kv_cache_dtype is None
    fp8 = quantized_dir(tmp_path, "modelopt-fp8", 33 * 10**9)
    plain = quantized_dir(tmp_path, "ct-fp8-dynamic", 33 * 10**9)
    accelerator = {"kind": "h100-80gb", "count": 1}
    with_fp8_kv = plan(parse_spec({"model": str(fp8), "accelerator": accelerator})).replicas[0]
    with_bf16_kv = plan(parse_spec({"model": str(plain), "accelerator": accelerator})).replicas[0]
    assert "--kv-cache-dtype" not in with_fp8_kv.argv
    assert with_fp8_kv.capacity.kv_cache_tokens == pytest.approx(2 * with_bf16_kv.capacity.kv_cache_tokens, rel=0.01)


def test_an_nvfp4_kv_cache_is_refused_not_guessed(tmp_path: Path) -> None:
    config = quantization_config("modelopt-nvfp4") | {"kv_cache_quant_algo": "NVFP4"}
    root = checkpoint_dir(tmp_path / "kv4", stock_config("31b") | {"quantization_config": config}, 20 * 10**9)
    result = plan(parse_spec({"model": str(root), "accelerator": {"kind": "b200"}}))
    assert not result.ok and "nvfp4 KV cache" in result.refusals[0]
    explicit = plan(
        parse_spec({"model": str(root), "accelerator": {"kind": "b200"}, "workload": {"kv_cache_dtype": "fp8"}})
    )
    assert explicit.ok


def test_a_quantized_fine_tune_counts_the_bf16_tower_on_every_rank(tmp_path: Path) -> None:
    """The upper bound of weights per device: the base's BF16 vision tower whole on each rank, the rest split."""
    root = quantized_dir(tmp_path, "awq", 18 * 10**9)
    checkpoint = load_checkpoint(str(root))
    base = CATALOG.model("31b")
    assert checkpoint.base == base and checkpoint.info.mtp_assistant is None
    assert checkpoint.info.checkpoint_bytes == 18 * 10**9
    assert checkpoint.info.vision_tower_bytes == base.vision_tower_bytes
    result = plan(
        parse_spec(
            {
                "model": str(root),
                "accelerator": {"kind": "h100-80gb", "count": 2},
                "serving": {"tensor_parallel_size": 2},
            }
        )
    )
    tower = base.vision_tower_bytes
    expected = ((18 * 10**9 - tower) / 2 + tower) / 1024**3
    assert result.replicas[0].capacity.weights_gib_per_device == pytest.approx(expected, abs=0.01)


# --- LoRA adapters --------------------------------------------------------------------------------------------------


def adapter_dir(tmp_path: Path, fixture: str) -> Path:
    root = tmp_path / "adapters" / fixture
    root.mkdir(parents=True)
    shutil.copy(FIXTURES / "adapters" / f"{fixture}.json", root / "adapter_config.json")
    return root


def test_adapters_are_served_under_their_names(tmp_path: Path) -> None:
    sql = adapter_dir(tmp_path, "gemma4-31b-lora-r16")
    legal = adapter_dir(tmp_path, "gemma4-31b-lora-r48-pattern")
    spec = parse_spec(
        {
            "model": "31b",
            "accelerator": {"kind": "h200", "count": 1},
            "serving": {
                "lora_adapters": [{"name": "sql", "source": str(sql)}, {"name": "legal", "source": str(legal)}]
            },
        }
    )
    result = plan(spec)
    argv, env = result.replicas[0].argv, result.replicas[0].env
    start = argv.index("--enable-lora")
    assert argv[start : start + 7] == [
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "64",  # rank_pattern's 48 rounded up to the next rank vLLM accepts
        "--lora-modules",
        f"sql={sql}",
    ]
    assert argv[start + 7] == f"legal={legal}"
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env
    assert [a.name for a in result.adapters] == ["sql", "legal"]
    # LoRA changes the compiled graphs: a cache of the plain model is never reused.
    plain = plan(parse_spec({"model": "31b", "accelerator": {"kind": "h200", "count": 1}}))
    assert result.replicas[0].cache_key != plain.replicas[0].cache_key


def test_hub_adapters_are_fetched_or_refused_by_where_replicas_get_them(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    commit = "c" * 40
    text = (FIXTURES / "adapters" / "gemma4-31b-lora-r16.json").read_text()
    hub_cache(tmp_path / "hf", "my-org/gemma4-sql-lora", {"adapter_config.json": text}, commit)

    def planned(adapter: dict, **more) -> object:
        spec = {"model": "31b", "accelerator": {"kind": "h200"}, "serving": {"lora_adapters": [adapter]}} | more
        return plan(parse_spec(spec))

    # By id: vLLM downloads it when it starts.
    by_id = planned({"name": "sql", "source": "my-org/gemma4-sql-lora"})
    assert by_id.ok and "sql=my-org/gemma4-sql-lora" in by_id.replicas[0].argv
    # Pinned, with the weights from the hub: the weights role downloads that snapshot and vLLM is given its path.
    pinned = planned({"name": "sql", "source": "my-org/gemma4-sql-lora", "revision": commit})
    snapshot = f"/var/lib/gemmaserve/hf/hub/models--my-org--gemma4-sql-lora/snapshots/{commit}"
    assert pinned.ok and f"sql={snapshot}" in pinned.replicas[0].argv
    assert pinned.weights.hub_adapters == (("my-org/gemma4-sql-lora", commit),)
    # A container has no such download: refused, naming the engine.
    boxed = planned(
        {"name": "sql", "source": "my-org/gemma4-sql-lora", "revision": commit}, engine={"kind": "container"}
    )
    assert not boxed.ok and "serving.lora_adapters[0].revision" in boxed.refusals[0]
    assert "engine.kind is container" in boxed.refusals[0] and snapshot in boxed.refusals[0]
    # Offline replicas (a model directory) cannot download it: unpinned, it is refused naming the pin; pinned, the
    # weights role downloads its snapshot beside the directory, as beside hub weights.
    tuned = fine_tune_of("31b", tmp_path / "ft")
    offline = planned({"name": "sql", "source": "my-org/gemma4-sql-lora"}, model=str(tuned))
    assert not offline.ok and offline.refusals[0].startswith("serving.lora_adapters[0].revision: none given")
    assert "HF_HUB_OFFLINE=1" in offline.refusals[0]
    beside = planned({"name": "sql", "source": "my-org/gemma4-sql-lora", "revision": commit}, model=str(tuned))
    assert beside.ok and f"sql={snapshot}" in beside.replicas[0].argv
    assert beside.weights.mode == "local" and beside.weights.hub_adapters == (("my-org/gemma4-sql-lora", commit),)
    # With the weights from the bucket it comes from the mirror, so it must be pinned (tests/unit/test_weights_plan.py).
    weights = {"source": "bucket", "bucket": "gs://my-weights", "revision": "d" * 40}
    unpinned = planned({"name": "sql", "source": "my-org/gemma4-sql-lora"}, weights=weights)
    assert not unpinned.ok and "serving.lora_adapters[0].revision: none given" in unpinned.refusals[0]
    assert planned({"name": "sql", "source": "my-org/gemma4-sql-lora", "revision": commit}, weights=weights).ok


def test_lora_buffers_come_out_of_the_kv_cache(tmp_path: Path) -> None:
    """31B at TP2 with two adapters (max rank 64): vLLM's LoRA buffers, allocated while the model loads, leave
    that much less for the KV cache (the formula is checked against vLLM's own buffers in tests/vllm)."""
    sql, legal = adapter_dir(tmp_path, "gemma4-31b-lora-r16"), adapter_dir(tmp_path, "gemma4-31b-lora-r48-pattern")
    adapters = [{"name": "sql", "source": str(sql)}, {"name": "legal", "source": str(legal)}]
    base = {"model": "31b", "accelerator": {"kind": "h100-80gb", "count": 2}, "serving": {"tensor_parallel_size": 2}}
    plain = plan(parse_spec(base)).replicas[0].capacity
    with_lora = plan(parse_spec(base | {"serving": base["serving"] | {"lora_adapters": adapters}}))
    reserved = lora_slot_bytes(CATALOG.model("31b"), 2, 2, 64) / 1024**3
    assert reserved == pytest.approx(1.19, abs=0.01)
    assert with_lora.replicas[0].capacity.available_kv_cache_gib == pytest.approx(
        plain.available_kv_cache_gib - reserved, abs=1e-9
    )
    assert not [w for w in with_lora.warnings if "LoRA" in w]


def test_lora_buffers_of_every_stock_model_are_counted(tmp_path: Path) -> None:
    """E4B (per-layer inputs) and 26B-A4B (expert LoRA: one A and B per expert for gate, up and down) count like
    the others; the formula is checked against vLLM's own buffers in tests/vllm. 26B-A4B's experts make its
    buffers the largest per slot: over a GiB at rank 16."""
    sql = adapter_dir(tmp_path, "gemma4-31b-lora-r16")
    for alias, kind in (("e4b", "l4"), ("26b-a4b", "h100-80gb")):
        spec = {"model": alias, "accelerator": {"kind": kind}}
        plain = plan(parse_spec(spec)).replicas[0].capacity.available_kv_cache_gib
        served = plan(parse_spec(spec | {"serving": {"lora_adapters": [{"name": "a", "source": str(sql)}]}}))
        reserved = lora_slot_bytes(CATALOG.model(alias), 1, 1, 16) / 1024**3
        assert served.replicas[0].capacity.available_kv_cache_gib == pytest.approx(plain - reserved, abs=1e-9)
        assert not [w for w in served.warnings if "LoRA" in w], alias
    moe, dense = lora_slot_bytes(CATALOG.model("26b-a4b"), 1, 1, 16), lora_slot_bytes(CATALOG.model("31b"), 1, 1, 16)
    assert moe > 1024**3 > dense
    # Only the expert width is split over tensor-parallel ranks (the A buffers read the whole hidden state).
    assert 0.5 * moe < lora_slot_bytes(CATALOG.model("26b-a4b"), 2, 1, 16) < moe


def test_lora_on_tpu_is_refused_naming_the_field(tmp_path: Path) -> None:
    """tpu-inference runs Gemma 4 with its JAX model, which takes no adapters: refused before anything is planned,
    where the same adapter on a GPU plans."""
    sql = adapter_dir(tmp_path, "gemma4-31b-lora-r16")
    serving = {"lora_adapters": [{"name": "sql", "source": str(sql)}]}
    tpu = plan(parse_spec({"model": "31b", "accelerator": {"kind": "tpu-v6e", "count": 8}, "serving": serving}))
    assert not tpu.ok and not tpu.replicas
    assert tpu.refusals[0].startswith("serving.lora_adapters: LoRA adapters cannot be served on TPU")
    assert "get_flax_model" in tpu.refusals[0] and "allowed:" in tpu.refusals[0]
    gpu = {"model": "31b", "accelerator": {"kind": "h100-80gb", "count": 2}, "serving": serving}
    assert plan(parse_spec(gpu | {"serving": serving | {"tensor_parallel_size": 2}})).ok


def test_lora_memory_not_derived_is_said(tmp_path: Path) -> None:
    """A checkpoint whose config.json leaves out the head count: the plan says LoRA memory is not counted."""
    config = stock_config("31b")
    del config["text_config"]["num_attention_heads"]
    model = checkpoint_dir(tmp_path / "ft", config, CATALOG.model("31b").checkpoint_bytes)
    sql = adapter_dir(tmp_path, "gemma4-31b-lora-r16")
    spec = {
        "model": str(model),
        "accelerator": {"kind": "h100-80gb"},
        "serving": {"lora_adapters": [{"name": "a", "source": str(sql)}]},
    }
    assert any("LoRA" in w and "not counted" in w for w in plan(parse_spec(spec)).warnings)


def test_adapter_errors_name_the_field(tmp_path: Path) -> None:
    dora = adapter_dir(tmp_path, "gemma4-dora")
    with pytest.raises(SpecError) as error:
        parse_spec(
            {
                "model": "e4b",
                "accelerator": {"kind": "l4"},
                "serving": {"lora_adapters": [{"name": "x", "source": str(dora)}]},
            }
        )
    assert "serving.lora_adapters[0].source" in str(error.value) and "DoRA" in str(error.value)


def test_adapter_names_are_unique_and_plain(tmp_path: Path) -> None:
    sql = str(adapter_dir(tmp_path, "gemma4-31b-lora-r16"))
    twice = [{"name": "a", "source": sql}, {"name": "a", "source": sql}]
    with pytest.raises(SpecError, match="names repeat"):
        parse_spec({"model": "31b", "accelerator": {"kind": "h200"}, "serving": {"lora_adapters": twice}})
    with pytest.raises(SpecError, match="lora_adapters.0.name"):
        parse_spec(
            {
                "model": "31b",
                "accelerator": {"kind": "h200"},
                "serving": {"lora_adapters": [{"name": "a b", "source": sql}]},
            }
        )


# --- the command line -----------------------------------------------------------------------------------------------


def gemmaserve_plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gemmaserve", "plan", *args], capture_output=True, text=True, timeout=120
    )


def test_cli_refuses_a_checkpoint_that_is_not_gemma4_with_exit_2(tmp_path: Path) -> None:
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
    root = checkpoint_dir(tmp_path / "qwen", config, 10**9)
    result = gemmaserve_plan("--model", str(root), "--accelerator", "h200")
    assert result.returncode == 2
    assert f"model = '{root}'" in result.stderr and "model_type = 'qwen3'" in result.stderr
    assert "allowed: model_type gemma4" in result.stderr


def test_cli_plans_a_quantized_fine_tune(tmp_path: Path) -> None:
    root = quantized_dir(tmp_path, "ct-fp8-dynamic", 33 * 10**9)
    result = gemmaserve_plan("--model", str(root), "--accelerator", "a100-80gb", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["model"] == root.name and data["quantization"] == "compressed-tensors"
    assert any("weight-only kernels" in w for w in data["warnings"])


def test_cli_fetch_downloads_only_the_small_files(tmp_path: Path, monkeypatch) -> None:
    """plan --fetch asks huggingface_hub for config.json and the weight index (and adapter_config.json), then
    plans from the cache; nothing else is downloaded."""
    cache = tmp_path / "hf" / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    published = {
        ("my-org/gemma4-31b-ft", "config.json"): json.dumps(stock_config("31b")),
        ("my-org/gemma4-31b-ft", "model.safetensors.index.json"): json.dumps(
            {"metadata": {"total_size": CATALOG.model("31b").checkpoint_bytes}, "weight_map": {}}
        ),
    }
    asked = []

    def fake_download(repo_id: str, filename: str, revision: str | None = None, **_) -> str:
        asked.append((repo_id, filename))
        if (repo_id, filename) not in published:
            raise EntryNotFoundError(f"{repo_id} has no {filename}")
        snapshot = cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / ("e" * 40)
        snapshot.mkdir(parents=True, exist_ok=True)
        (snapshot / filename).write_text(published[repo_id, filename])
        (snapshot.parent.parent / "refs").mkdir(exist_ok=True)
        (snapshot.parent.parent / "refs" / "main").write_text("e" * 40)
        return str(snapshot / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    result = CliRunner().invoke(
        app, ["plan", "--model", "my-org/gemma4-31b-ft", "--accelerator", "h200", "--fetch", "--json"]
    )
    assert result.exit_code == 0, result.output
    assert asked == [("my-org/gemma4-31b-ft", "config.json"), ("my-org/gemma4-31b-ft", "model.safetensors.index.json")]
    assert "fetch: my-org/gemma4-31b-ft config.json" in result.output
    # A stock model is never fetched.
    asked.clear()
    assert CliRunner().invoke(app, ["plan", "--model", "31b", "--accelerator", "h200", "--fetch"]).exit_code == 0
    assert asked == []


def published(name: str) -> dict:
    return json.loads((FIXTURES / "published" / f"{name}.config.json").read_text())


def test_published_e4b_config_is_the_catalog_e4b(tmp_path: Path) -> None:
    """google/gemma-4-E4B-it's config.json as a user saved it (tests/unit/checkpoints/README.md): the catalog's E4B,
    head count included, so a fine-tune of it plans exactly like it, LoRA buffers counted."""
    info = CATALOG.model("e4b")
    fields = architecture(published("google--gemma-4-E4B-it"), CheckpointRef(info.hf_id))
    assert fields == {f: getattr(info, f) for f in fields}
    root = checkpoint_dir(tmp_path / "e4b-ft", published("google--gemma-4-E4B-it"), info.checkpoint_bytes, True)
    tuned = plan(parse_spec({"model": str(root), "accelerator": {"kind": "l4"}})).require_ok()
    stock = plan(parse_spec({"model": "e4b", "accelerator": {"kind": "l4"}})).require_ok()
    assert tuned.replicas[0].capacity == stock.replicas[0].capacity


def test_published_e2b_fine_tune_plans_exactly_like_e2b(tmp_path: Path) -> None:
    """A published full fine-tune of E2B (blazejewicz/gemma-4-e2b-japanese-teacher, its config.json byte for byte:
    tests/unit/checkpoints/README.md) writes per_layer_config's keys zero-padded ("04", "09"), which transformers
    reads as layer indices (int(key)). Read by its literal string, layers 4 and 9 lost their 512-wide heads and the
    checkpoint was refused as having two shapes of full layer; it is the catalog's E2B, and plans exactly like it."""
    config = published("blazejewicz--gemma-4-e2b-japanese-teacher")
    assert {"04", "09"} <= set(config["text_config"]["per_layer_config"])
    info = CATALOG.model("e2b")
    fields = architecture(config, CheckpointRef("blazejewicz/gemma-4-e2b-japanese-teacher"))
    assert fields == {f: getattr(info, f) for f in fields}
    root = checkpoint_dir(tmp_path / "gemma-4-e2b-japanese-teacher", config, info.checkpoint_bytes, single_file=True)
    for accelerator in ({"kind": "l4"}, {"kind": "tpu-v6e", "count": 4}):
        tuned = plan(parse_spec({"model": str(root), "accelerator": accelerator})).require_ok()
        stock = plan(parse_spec({"model": "e2b", "accelerator": accelerator})).require_ok()
        assert tuned.replicas[0].capacity == stock.replicas[0].capacity
        assert tuned.replicas[0].argv[3:5] == ["--served-model-name", "gemma-4-e2b-japanese-teacher"]


@pytest.mark.parametrize(
    "keys, message",
    [
        ({"x": {"head_dim": 512}}, r"keys \['x'\] are not all layer indices; allowed: integers 0..59"),
        ({"60": {"head_dim": 512}}, r"layers \[60\] do not exist; allowed: 0..59"),
    ],
)
def test_per_layer_config_keys_that_name_no_layer_are_refused(keys: dict, message: str) -> None:
    config = stock_config("31b")
    config["text_config"] = {**config["text_config"], "per_layer_config": keys}
    with pytest.raises(CheckpointError, match=message):
        architecture(config, CheckpointRef("x/y"))


def test_published_unified_w4a16_checkpoint_plans_on_gpu_and_is_refused_where_it_cannot_run(tmp_path: Path) -> None:
    """A published Gemma 4 Unified checkpoint (Gemma4UnifiedForConditionalGeneration, 12B, encoder-free) quantized
    W4A16 with compressed-tensors: planned from its own config.json on an L4; refused on TPU (tpu-inference has no
    JAX model for it) and on a vLLM older than the one that added its architecture."""
    config = published("zaid-muslim--gemma-4-12b-w4a16")
    # The weights' bytes are a stand-in (no published index was found): 12B parameters at about 4.5 bits.
    root = checkpoint_dir(tmp_path / "gemma-4-12b-w4a16", config, 7_000_000_000)
    spec = {"model": str(root), "accelerator": {"kind": "l4"}}
    result = plan(parse_spec(spec)).require_ok()
    model = parse_spec(spec).model_info
    assert model.unified and not any(same_architecture(model, m) for m in CATALOG.models)
    assert (model.num_layers, model.hidden_size, model.num_attention_heads) == (48, 3840, 16)
    assert result.quantization.method == "compressed-tensors" and result.quantization.scheme == "int4-w4a16"
    assert result.replicas[0].capacity.kv_cache_tokens > 0
    tpu = plan(parse_spec(spec | {"accelerator": {"kind": "tpu-v6e", "count": 4}}))
    assert (
        not tpu.ok
        and tpu.refusals[0].startswith("model:")
        and "Gemma4UnifiedForConditionalGeneration" in tpu.refusals[0]
    )
    old = plan(parse_spec(spec | {"engine": {"vllm_version": "0.22.1"}}))
    assert not old.ok and any(r.startswith("engine.vllm_version: 0.22.1") for r in old.refusals)
    assert plan(parse_spec(spec | {"engine": {"vllm_version": "0.23.0"}})).ok


def served_on_e2b(tmp_path: Path, fixture: str, name: str):
    """E2B on an L4 serving the recorded adapter `fixture` as `name`: (its directory, the plan)."""
    root = adapter_dir(tmp_path, fixture)
    data = {
        "model": "e2b",
        "accelerator": {"kind": "l4"},
        "serving": {"lora_adapters": [{"name": name, "source": str(root)}]},
    }
    return root, plan(parse_spec(data)).require_ok()


def test_published_unsloth_adapter_is_served_on_e2b(tmp_path: Path) -> None:
    """A LoRA adapter as PEFT 0.18.1 saved it for Unsloth's E2B (tests/unit/checkpoints/README.md): rank 16 on the
    attention and MLP projections; served under its name with vLLM's smallest rank that holds it."""
    root, result = served_on_e2b(tmp_path, "unsloth-gemma-4-e2b-lora-r16", "pog")
    assert [(a.rank, "q_proj" in a.target_modules) for a in result.adapters] == [(16, True)]
    argv = result.replicas[0].argv
    assert argv[argv.index("--max-lora-rank") + 1] == "16" and f"pog={root}" in argv[argv.index("--lora-modules") + 1]


def test_published_adapter_with_a_regex_target_is_served_on_e2b(tmp_path: Path) -> None:
    """A LoRA adapter as PEFT 0.19.1 saved it for E2B with target_modules one regular expression (the language
    model's attention and MLP projections; tests/unit/checkpoints/README.md): read as one target, rank 16."""
    _, result = served_on_e2b(tmp_path, "gemma4-gsm8k-e2b-lora-r16-regex", "gsm8k")
    (adapter,) = result.adapters
    assert adapter.rank == 16 and len(adapter.target_modules) == 1
    assert re.fullmatch(adapter.target_modules[0], "model.language_model.layers.3.mlp.down_proj")
    argv = result.replicas[0].argv
    assert argv[argv.index("--max-lora-rank") + 1] == "16"
    assert result.replicas[0].capacity.lora_slots_gib > 0


@pytest.mark.parametrize(
    "published, base",
    [("nvidia--Gemma-4-31B-IT-NVFP4", "31b"), ("nvidia--Gemma-4-26B-A4B-NVFP4", "26b-a4b")],
)
def test_published_nvfp4_checkpoints_plan_on_their_base_with_their_fp8_kv_cache(tmp_path: Path, published, base):
    """NVIDIA's published config.json files (tests/unit/checkpoints/published): the stock architecture, ModelOpt
    NVFP4 (native on B200, weight-only before Blackwell) and an FP8 KV cache, which halves the KV bytes per token:
    the same memory holds twice the tokens of the BF16 cache (the weights' bytes are a stand-in: no published
    metadata.total_size was found)."""
    config = json.loads((FIXTURES / "published" / f"{published}.config.json").read_text())
    root = checkpoint_dir(tmp_path / published, config, CATALOG.model(base).checkpoint_bytes // 3)
    spec = {"model": str(root), "accelerator": {"kind": "b200", "count": 1}}
    result = plan(parse_spec(spec)).require_ok()
    assert result.quantization.method == "modelopt_fp4" and result.quantization.kv_cache_dtype == "fp8_e4m3"
    assert same_architecture(parse_spec(spec).model_info, CATALOG.model(base))
    given = plan(parse_spec(spec), available_kv_gib=40).replicas[0].capacity
    bf16 = plan(parse_spec({"model": base, "accelerator": {"kind": "b200", "count": 1}}), available_kv_gib=40)
    assert given.num_blocks == 2 * bf16.replicas[0].capacity.num_blocks
    hopper = plan(parse_spec(spec | {"accelerator": {"kind": "h100-80gb", "count": 1}}))
    assert hopper.ok and [w for w in hopper.warnings if "weight-only" in w]
