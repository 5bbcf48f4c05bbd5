"""vLLM 0.32.0's own code judges what gemmaserve reads from a checkpoint: the quantization method it detects
from config.json and the capability it needs, the LoRA ranks and adapter features it accepts, the LoRA flags.

One run of a judge script under the sandbox's vLLM CPU venv answers every case (importing vLLM takes seconds).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from gemmaserve.catalog import ModelInfo
from gemmaserve.checkpoint import CheckpointRef, architecture, parse_quantization
from gemmaserve.plan import MAX_LORA_RANKS, language_model_linears, linear_weight_elements, lora_slot_bytes, plan
from gemmaserve.spec import parse_spec
from roles._lib.programs import program_source

pytestmark = pytest.mark.vllm

FIXTURES = Path(__file__).parents[1] / "unit" / "checkpoints"
# The recorded quantization_config objects, and those of published checkpoints' config.json (published/README.md).
QUANTIZATION_CONFIGS = {
    p.stem: json.loads(p.read_text()) for p in sorted((FIXTURES / "quantization").glob("*.json"))
} | {
    p.name.removesuffix(".config.json"): config["quantization_config"]
    for p in sorted((FIXTURES / "published").glob("*.config.json"))
    if "quantization_config" in (config := json.loads(p.read_text()))
}
QUANTIZATION = list(QUANTIZATION_CONFIGS)
ADAPTERS = sorted(p.stem for p in (FIXTURES / "adapters").glob("*.json"))

JUDGE = r"""
import json, os, sys, types
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
import vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors as ctmod
from vllm.platforms.interface import DeviceCapability
from vllm.utils.torch_utils import get_kv_cache_quant_algo_string
from vllm.config.lora import LoRAConfig, MaxLoRARanks
from vllm.config.model import ModelConfig
from vllm.lora.peft_helper import PEFTHelper
from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config
def _stand_in(cls):
    # Constructing it returns the class itself; its get_min_capability stays the real one.
    return type(cls.__name__, (), {"__new__": lambda _, *a, **k: cls, "get_min_capability": cls.get_min_capability})
for _name in [n for n in dir(ctmod) if n.startswith("CompressedTensorsW")]:
    setattr(ctmod, _name, _stand_in(getattr(ctmod, _name)))
from typing import get_args

cases = json.load(sys.stdin)
out = {"quantization": {}, "adapters": {}, "max_lora_ranks": list(get_args(MaxLoRARanks))}
for name, cfg in cases["quantization"].items():
    # ModelConfig._verify_quantization on a stand-in: the detection loop `vllm serve` runs on config.json.
    fake = types.SimpleNamespace(model_arch_config=types.SimpleNamespace(quantization_config=cfg),
                                 quantization=None, hf_config=None, allow_deprecated_quantization=False)
    ModelConfig._verify_quantization(fake)
    cls = get_quantization_config(fake.quantization)
    parsed = cls.from_config(cfg)
    result = {"detected": fake.quantization, "known": fake.quantization in QUANTIZATION_METHODS,
              "class": cls.__name__, "min_capability": cls.get_min_capability(),
              "kv_cache_dtype": get_kv_cache_quant_algo_string(cfg)}
    if fake.quantization == "compressed-tensors":
        # The scheme vLLM picks for a Linear layer on GPUs of compute capability 8.0, 9.0 and 10.0
        # (_get_scheme_from_parts asks the platform; the scheme classes are swapped for themselves so nothing is built).
        args = parsed.target_scheme_map["Linear"]
        result["schemes"] = {}
        for cc in (80, 90, 100):
            ctmod.current_platform.get_device_capability = lambda device_id=0, cc=cc: DeviceCapability(cc // 10, cc % 10)
            scheme = parsed._get_scheme_from_parts(args.get("weights"), args.get("input_activations"))
            result["schemes"][str(cc)] = [scheme.__name__, scheme.get_min_capability()]
    out["quantization"][name] = result
for name, (cfg, max_rank) in cases["adapters"].items():
    try:
        PEFTHelper.from_dict(dict(cfg, vllm_max_position_embeddings=4096)).validate_legal(
            LoRAConfig(max_lora_rank=max_rank, max_loras=1))
        out["adapters"][name] = None
    except Exception as error:
        out["adapters"][name] = str(error)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def verdicts(vllm_python: Path) -> dict:
    rank = {name: 64 for name in ADAPTERS}
    cases = {
        "quantization": QUANTIZATION_CONFIGS,
        "adapters": {
            f"{n}@{r}": (json.loads((FIXTURES / "adapters" / f"{n}.json").read_text()), r)
            for n in ADAPTERS
            for r in (rank[n], 32)
        },
    }
    proc = subprocess.run(
        [str(vllm_python), "-c", JUDGE], input=json.dumps(cases), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("name", QUANTIZATION)
def test_vllm_detects_the_method_gemmaserve_names(verdicts, name: str) -> None:
    """The same config class; AWQ's name differs only on this CPU build (auto_awq.py: no override on CPU)."""
    mine = parse_quantization(QUANTIZATION_CONFIGS[name])
    verdict = verdicts["quantization"][name]
    assert verdict["known"]
    assert verdict["detected"] == mine.method or (verdict["detected"], mine.method) == ("awq", "auto_awq")


@pytest.mark.parametrize("name", QUANTIZATION)
def test_minimum_capability_is_vllms(verdicts, name: str) -> None:
    mine = parse_quantization(QUANTIZATION_CONFIGS[name])
    verdict = verdicts["quantization"][name]
    if "schemes" in verdict:
        # On an A100 (8.0) the scheme vLLM picks needs what gemmaserve calls the minimum; where gemmaserve says the
        # kernels turn native, vLLM picks a scheme that needs exactly that capability.
        a100, hopper = verdict["schemes"]["80"], verdict["schemes"]["90"]
        assert mine.min_capability == max(a100[1], verdict["min_capability"])
        if mine.scheme.startswith("fp8-w8a8"):
            assert a100[0] == "CompressedTensorsW8A16Fp8"
            assert hopper == ["CompressedTensorsW8A8Fp8", mine.native_capability]
    else:
        assert mine.min_capability == verdict["min_capability"]


@pytest.mark.parametrize("name", QUANTIZATION)
def test_kv_cache_dtype_auto_resolves_as_vllms(verdicts, name: str) -> None:
    mine = parse_quantization(QUANTIZATION_CONFIGS[name])
    assert mine.kv_cache_dtype == verdicts["quantization"][name]["kv_cache_dtype"]


def test_lora_ranks_are_vllms(verdicts) -> None:
    assert list(MAX_LORA_RANKS) == verdicts["max_lora_ranks"]


@pytest.mark.parametrize(
    "case, accepted",
    [
        ("gemma4-31b-lora-r16@64", True),
        ("gemma4-31b-lora-r16@32", True),
        ("gemma4-31b-lora-r48-pattern@64", True),
        ("gemma4-31b-lora-r48-pattern@32", False),  # rank_pattern's 48 counts: why the plan asks for 64
        ("gemma4-dora@64", False),  # DoRA: gemmaserve refuses it at the spec as well
        ("unsloth-gemma-4-e2b-lora-r16@64", True),  # published (tests/unit/checkpoints/README.md)
        ("unsloth-gemma-4-e2b-lora-r16@32", True),
        ("gemma4-gsm8k-e2b-lora-r16-regex@64", True),  # published: target_modules one regular expression
        ("gemma4-gsm8k-e2b-lora-r16-regex@32", True),
    ],
)
def test_vllm_accepts_the_adapters_gemmaserve_accepts(verdicts, case: str, accepted: bool) -> None:
    assert (verdicts["adapters"][case] is None) is accepted, verdicts["adapters"][case]


def test_planned_lora_flags_pass_vllms_parser(vllm_python: Path, tmp_path: Path) -> None:
    roots = []
    for name in ("gemma4-31b-lora-r16", "gemma4-31b-lora-r48-pattern"):
        root = tmp_path / name
        root.mkdir()
        (root / "adapter_config.json").write_text((FIXTURES / "adapters" / f"{name}.json").read_text())
        roots.append(root)
    spec = parse_spec(
        {
            "model": "31b",
            "accelerator": {"kind": "h200", "count": 1},
            # No chat template: its installed path does not exist here, and vLLM's validation reads it.
            "workload": {"tool_calling": False, "reasoning": False},
            "serving": {"lora_adapters": [{"name": f"a{i}", "source": str(r)} for i, r in enumerate(roots)]},
        }
    )
    argv = plan(spec).replicas[0].argv
    proc = subprocess.run(
        [str(vllm_python), str(program_source("vllm", "vllm_argcheck.py"))],
        input=json.dumps([argv]),
        capture_output=True,
        text=True,
        timeout=300,
    )
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert results and results[0]["ok"], proc.stdout + proc.stderr


# --- config.json as transformers (pinned with vLLM 0.32.0) reads it for vLLM ---------------------------------------

CONFIG_JUDGE = r"""
import json, sys
from transformers import Gemma4Config, Gemma4TextConfig
from transformers.models.gemma4_unified.configuration_gemma4_unified import Gemma4UnifiedConfig
out = {}
for name, cfg in json.load(sys.stdin).items():
    kind = cfg.get("model_type")
    if kind in ("gemma4", "gemma4_unified"):
        text = (Gemma4Config if kind == "gemma4" else Gemma4UnifiedConfig)(**cfg).text_config
    else:
        text = Gemma4TextConfig(**cfg)
    layers = text.per_layer_config
    out[name] = {
        "kinds": ["full" if k == "full_attention" else "sliding" for k in text.layer_types],
        "shapes": [[layers[i].num_key_value_heads, layers[i].head_dim] for i in range(text.num_hidden_layers)],
        "kv_shared": text.num_kv_shared_layers,
        "window": text.sliding_window,
        "max_context": text.max_position_embeddings,
    }
print(json.dumps(out))
"""


def _variants() -> dict[str, dict]:
    stock = {p.stem: json.loads(p.read_text()) for p in sorted((FIXTURES / "configs").glob("*.json"))}
    published = {p.name: json.loads(p.read_text()) for p in sorted((FIXTURES / "published").glob("*.json"))}
    base = stock["gemma-4-31B-it"]
    text = base["text_config"]
    return (
        stock
        | published
        | {
            # transformers' defaults: no layer_types (every 6th full), no global_head_dim (512)
            "defaults": {
                **base,
                "text_config": {k: v for k, v in text.items() if k not in ("layer_types", "global_head_dim")},
            },
            # a text-only Gemma4ForCausalLM checkpoint: the text config at the top, 12 layers
            "text-only": {"architectures": ["Gemma4ForCausalLM"], **text, "num_hidden_layers": 12, "layer_types": None},
            # as transformers 5.19 saves a config (every fine-tune saved with it): per_layer_config, no global_head_dim
            "saved-by-transformers": {**base, "text_config": _per_layer_form(text)},
        }
    )


def _per_layer_form(text: dict) -> dict:
    """The full layers' head size and KV heads as per_layer_config overrides (256 and 2 heads: not the 31B's own, so
    the judge sees the file's values win), global_head_dim and num_global_key_value_heads dropped."""
    kinds = text["layer_types"]
    rest = {k: v for k, v in text.items() if k not in ("global_head_dim", "num_global_key_value_heads")}
    overrides = {"head_dim": 256, "num_key_value_heads": 2}
    return {**rest, "per_layer_config": {str(i): overrides for i, k in enumerate(kinds) if k == "full_attention"}}


@pytest.fixture(scope="module")
def config_verdicts(vllm_python: Path) -> dict:
    proc = subprocess.run(
        [str(vllm_python), "-c", CONFIG_JUDGE],
        input=json.dumps(_variants()),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("name", list(_variants()))
def test_transformers_reads_config_json_as_gemmaserve_does(config_verdicts, name: str) -> None:
    fields = architecture(_variants()[name], CheckpointRef(name))
    info = ModelInfo(hf_id=name, aliases=(name,), checkpoint_bytes=1, total_params_b=0, **fields)
    verdict = config_verdicts[name]
    assert list(info.layer_kinds) == verdict["kinds"]
    assert [[info.shape(k).kv_heads, info.shape(k).head_dim] for k in info.layer_kinds] == verdict["shapes"]
    assert (info.num_kv_shared_layers, info.sliding_window, info.max_context) == (
        verdict["kv_shared"],
        verdict["window"],
        verdict["max_context"],
    )


# --- the LoRA buffers vLLM allocates while it loads the model ------------------------------------------------------

# The start of a judge script that builds vLLM's own Gemma 4 on the CPU: `build(vllm_config, port)` makes the model a
# config describes (its weights uninitialised), in a one-rank gloo process group set up on the first call.
BUILD_MODEL = r"""
import json, os, sys
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.model_loader.utils import get_model_architecture

_group = []
def build(vllm_config, port):
    with set_current_vllm_config(vllm_config):
        if not _group:
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{port}")
            initialize_model_parallel(1, 1)
            _group.append(port)
        return get_model_architecture(vllm_config.model_config)[0](vllm_config=vllm_config)
"""

LORA_JUDGE = (
    BUILD_MODEL
    + r"""
import torch
from vllm.config import LoRAConfig
from vllm.lora.model_manager import LoRAModelManager
from vllm.lora.layers import fused_moe

# The CPU build has no LoRA-capable fused-MoE kernel: FusedMoEWithLoRA.__init__ fails its kernel check ("Old-style
# modular kernel not supported") after setting everything the buffers' shapes depend on, and set_mapping hands the
# buffers to that kernel. Both are let through here; create_lora_weights, which allocates them, runs as shipped.
_init, _set_mapping = fused_moe.FusedMoEWithLoRA.__init__, fused_moe.FusedMoEWithLoRA.set_mapping
def _init_without_kernel(self, base_layer):
    try:
        _init(self, base_layer)
    except RuntimeError as error:
        if "modular kernel" not in str(error):
            raise
def _set_mapping_without_kernel(self, punica_wrapper):
    if "_moe_kernel" in vars(self):
        return _set_mapping(self, punica_wrapper)
    self.punica_wrapper = punica_wrapper
fused_moe.FusedMoEWithLoRA.__init__ = _init_without_kernel
fused_moe.FusedMoEWithLoRA.set_mapping = _set_mapping_without_kernel

out = {}
for case in json.load(sys.stdin):
    model_config = ModelConfig(model=case["dir"], skip_tokenizer_init=True, dtype="bfloat16")
    lora_config = LoRAConfig(max_lora_rank=case["rank"], max_loras=case["max_loras"])
    vllm_config = VllmConfig(model_config=model_config, lora_config=lora_config)
    model = build(vllm_config, case["port"])
    with set_current_vllm_config(vllm_config):
        # The manager wraps the model's layers and allocates every adapter slot, as load_lora_model does.
        LoRAModelManager(model, 4, 64, model_config.get_vocab_size(), lora_config, torch.device("cpu"), vllm_config)
    # Every LoRA buffer a wrapped layer holds (lora_a_stacked, w13_lora_b_stacked, ...), counted once per storage:
    # the MoE wrapper's lora_a_stacked/lora_b_stacked lists are views into its w13_/w2_ buffers.
    storages = {}
    for module in model.modules():
        for name, value in vars(module).items():
            if name.endswith("lora_a_stacked") or name.endswith("lora_b_stacked"):
                for tensor in value if isinstance(value, (list, tuple)) else (value,):
                    storage = tensor.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
    out[case["name"]] = sum(storages.values())
print(json.dumps(out))
"""
)

TINY_TEXT = {
    "architectures": ["Gemma4ForCausalLM"],
    "model_type": "gemma4_text",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_global_key_value_heads": 1,
    "head_dim": 16,
    "global_head_dim": 32,
    "sliding_window": 16,
    "num_kv_shared_layers": 0,
    "attention_k_eq_v": True,
    "hidden_size_per_layer_input": 0,
    "vocab_size": 256,
    "max_position_embeddings": 1024,
    "enable_moe_block": False,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}
LORA_CASES = {
    # name: (text config changes, max_loras, rank)
    "k-eq-v": ({}, 2, 16),
    "plain-attention": ({"attention_k_eq_v": False, "num_hidden_layers": 12, "intermediate_size": 96}, 1, 8),
    "wide": ({"num_attention_heads": 8, "num_key_value_heads": 4, "layer_types": None}, 3, 64),
    "with-vision-tower": ({}, 1, 8),
    "unified": ({}, 2, 16),
    # The 26B-A4B form: a dense MLP beside routed experts, each expert's gate, up and down with LoRA buffers
    "experts": (
        {"enable_moe_block": True, "num_experts": 8, "top_k_experts": 2, "moe_intermediate_size": 32},
        2,
        8,
    ),
    # The E2B form: per-layer input embeddings, KV-shared layers with q_proj alone and a double-width MLP
    "per-layer-inputs": (
        {
            "attention_k_eq_v": False,
            "layer_types": ["sliding_attention", "full_attention"] * 3,
            "num_kv_shared_layers": 2,
            "use_double_wide_mlp": True,
            "hidden_size_per_layer_input": 8,
            "vocab_size_per_layer_input": 256,
        },
        2,
        16,
    ),
}


# The multimodal forms, around the same small language model: vLLM wraps only the language model's layers (the
# vision tower's and embedder's linears get no LoRA buffers: no PunicaWrapper matches them).
TINY_VISION = {
    "model_type": "gemma4_vision",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "patch_size": 16,
    "pooling_kernel_size": 3,
    "position_embedding_size": 256,
    "default_output_length": 70,
}
TINY_UNIFIED_VISION = {
    "model_type": "gemma4_unified_vision",
    "mm_embed_dim": TINY_TEXT["hidden_size"],
    "mm_posemb_size": 64,
    "model_patch_size": 48,
    "num_soft_tokens": 70,
    "output_proj_dims": TINY_TEXT["hidden_size"],
    "patch_size": 16,
    "pooling_kernel_size": 3,
}
MULTIMODAL = {
    # name: (architecture, model_type, the text config's model_type, vision_config)
    "with-vision-tower": ("Gemma4ForConditionalGeneration", "gemma4", "gemma4_text", TINY_VISION),
    "unified": ("Gemma4UnifiedForConditionalGeneration", "gemma4_unified", "gemma4_unified_text", TINY_UNIFIED_VISION),
}


def lora_case_config(name: str, changes: dict) -> dict:
    text = {k: v for k, v in (TINY_TEXT | changes).items() if v is not None}
    if name not in MULTIMODAL:
        return text
    architecture, model_type, text_type, vision = MULTIMODAL[name]
    tokens = {"image_token_id": 19, "boi_token_id": 17, "eoi_token_id": 18, "video_token_id": 23}
    text = {k: v for k, v in text.items() if k != "architectures"} | {"model_type": text_type}
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "text_config": text,
        "vision_config": vision,
    } | tokens


@pytest.fixture(scope="module")
def lora_verdicts(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    cases = []
    for name, (changes, max_loras, rank) in LORA_CASES.items():
        root = tmp_path_factory.mktemp(name)
        (root / "config.json").write_text(json.dumps(lora_case_config(name, changes)))
        cases.append({"name": name, "dir": str(root), "max_loras": max_loras, "rank": rank, "port": 29571})
    proc = subprocess.run(
        [str(vllm_python), "-c", LORA_JUDGE], input=json.dumps(cases), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"cases": cases, "bytes": json.loads(proc.stdout.splitlines()[-1])}


@pytest.mark.parametrize("name", list(LORA_CASES))
def test_lora_buffers_are_what_vllm_allocates(lora_verdicts, name: str) -> None:
    case = next(c for c in lora_verdicts["cases"] if c["name"] == name)
    config = json.loads((Path(case["dir"]) / "config.json").read_text())
    info = ModelInfo(
        hf_id=name, aliases=(name,), checkpoint_bytes=1, total_params_b=0, **architecture(config, CheckpointRef(name))
    )
    assert lora_slot_bytes(info, 1, case["max_loras"], case["rank"]) == lora_verdicts["bytes"][name]


# --- online FP8: the layers vLLM's OnlineQuantizationConfig quantizes ------------------------------------------------

ONLINE_FP8_JUDGE = (
    BUILD_MODEL
    + r"""
out = {}
for case in json.load(sys.stdin):
    model_config = ModelConfig(
        model=case["dir"], skip_tokenizer_init=True, dtype="bfloat16", quantization="fp8_per_tensor"
    )
    model = build(VllmConfig(model_config=model_config), case["port"])
    # The weights of every layer the online config gave a quantizing method (the 16-bit tensors it turns to FP8).
    quantized, inside = 0, 0
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None or "Unquantized" in type(method).__name__:
            continue
        elements = sum(p.numel() for n, p in module.named_parameters(recurse=False) if n in ("weight", "w13_weight", "w2_weight"))
        quantized += elements
        inside += elements if "layers." in name and "tower" not in name else 0
    out[case["name"]] = {"quantized": quantized, "language_model_layers": inside}
print(json.dumps(out))
"""
)

# The LoRA cases, and a vision tower whose widths are multiples of 64 (E2B/E4B's 768 and 3072 are): vLLM quantizes
# that tower with the model, which gemmaserve does not count, so such a plan is refused.
QUANTIZABLE_TOWER = TINY_VISION | {"hidden_size": 64, "intermediate_size": 128}
ONLINE_FP8_COUNTED = ["k-eq-v", "plain-attention", "wide", "experts", "per-layer-inputs", "with-vision-tower"]
ONLINE_FP8_REFUSED = ["unified", "quantizable-tower"]


@pytest.fixture(scope="module")
def online_fp8_verdicts(vllm_python: Path, tmp_path_factory) -> dict:
    cases = []
    for name in ONLINE_FP8_COUNTED + ONLINE_FP8_REFUSED:
        if name == "quantizable-tower":
            config = lora_case_config("with-vision-tower", {}) | {"vision_config": QUANTIZABLE_TOWER}
        else:
            config = lora_case_config(name, LORA_CASES[name][0])
        root = tmp_path_factory.mktemp(f"fp8-{name}")
        (root / "config.json").write_text(json.dumps(config))
        cases.append({"name": name, "dir": str(root), "port": 29577})
    proc = subprocess.run(
        [str(vllm_python), "-c", ONLINE_FP8_JUDGE], input=json.dumps(cases), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"cases": {c["name"]: c for c in cases}, "counts": json.loads(proc.stdout.splitlines()[-1])}


def _info(case: dict) -> ModelInfo:
    config = json.loads((Path(case["dir"]) / "config.json").read_text())
    name = case["name"]
    return ModelInfo(
        hf_id=name, aliases=(name,), checkpoint_bytes=1, total_params_b=0, **architecture(config, CheckpointRef(name))
    )


@pytest.mark.parametrize("name", ONLINE_FP8_COUNTED)
def test_online_fp8_quantizes_the_linear_layers_gemmaserve_counts(online_fp8_verdicts, name: str) -> None:
    """vLLM 0.32.0's --quantization fp8_per_tensor, built on the CPU: its quantizing methods hold exactly the weights
    gemmaserve's language_model_linears marks quantized (the MoE router's GateLinear stays 16-bit; a vision tower
    whose widths are not multiples of 64 too)."""
    info = _info(online_fp8_verdicts["cases"][name])
    mine = sum(layer.weight_elements for layer in language_model_linears(info, 1) if layer.quantized)
    assert online_fp8_verdicts["counts"][name]["quantized"] == mine
    # The checkpoint's own linear weights (no V copies of K=V layers) are what the plan takes to 1 byte.
    full_kv = sum(1 for k in info.layer_kinds if k == "full") * info.full.kv_heads * info.full.head_dim
    assert linear_weight_elements(info) == mine - (full_kv * info.hidden_size if info.attention_k_eq_v else 0)


@pytest.mark.parametrize("name", ONLINE_FP8_REFUSED)
def test_online_fp8_that_reaches_beyond_the_language_model_is_refused(online_fp8_verdicts, name: str, tmp_path) -> None:
    """A Unified checkpoint's patch projection and a tower with widths in multiples of 64 are quantized too: more than
    gemmaserve counts, so the plan refuses online FP8 for them rather than guess."""
    case = online_fp8_verdicts["cases"][name]
    info = _info(case)
    counted = sum(layer.weight_elements for layer in language_model_linears(info, 1) if layer.quantized)
    counts = online_fp8_verdicts["counts"][name]
    assert counts["language_model_layers"] == counted and counts["quantized"] > counted
    (tmp_path / "config.json").write_text((Path(case["dir"]) / "config.json").read_text())
    (tmp_path / "model.safetensors.index.json").write_text('{"metadata": {"total_size": 1000000}, "weight_map": {}}')
    spec = {"model": str(tmp_path), "accelerator": {"kind": "h100-80gb"}, "workload": {"quantization": "fp8"}}
    result = plan(parse_spec(spec))
    assert not result.ok and result.refusals[0].startswith("workload.quantization = 'fp8': vLLM 0.32.0 quantizes")


# --- --speculative-config as vLLM's SpeculativeConfig reads it -------------------------------------------------------

SPECULATIVE_JUDGE = r"""
import dataclasses, json, os, sys
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
from vllm.config.speculative import SpeculativeConfig
print(json.dumps(sorted(f.name for f in dataclasses.fields(SpeculativeConfig))))
"""


def test_every_key_of_the_planned_mtp_config_is_a_speculative_config_field(vllm_python: Path) -> None:
    """vLLM's argument parser takes --speculative-config as any JSON object (vllm_argcheck accepts an unknown key);
    SpeculativeConfig's fields are what the engine reads. A pinned assistant from the hub adds `revision`; one from
    the bucket is named by its local directory."""
    proc = subprocess.run([str(vllm_python), "-c", SPECULATIVE_JUDGE], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fields = set(json.loads(proc.stdout.splitlines()[-1]))
    base = {"model": "31b", "accelerator": {"kind": "h200"}, "workload": {"speculative": {"method": "mtp"}}}
    pinned = {"assistant_revision": "e" * 40}
    bucket = {"source": "bucket", "bucket": "gs://acme", "revision": "d" * 40}
    for weights in ({}, pinned, bucket | pinned):
        argv = plan(parse_spec(base | {"weights": weights})).require_ok().replicas[0].argv
        config = json.loads(argv[argv.index("--speculative-config") + 1])
        assert set(config) <= fields, set(config) - fields
    assert "revision" in fields
