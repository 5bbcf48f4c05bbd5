"""workload.extra_args may not set a flag the plan sets: every flag any plan emits is in the table, and each form
vLLM's parser reads (underscores, `=value`, abbreviations, short options, `--no-`) is refused naming the field."""

from __future__ import annotations

import pytest

from gemmaserve.plan import plan
from gemmaserve.planned_flags import PLANNED, planned_destination, planned_flag_problems
from gemmaserve.sources import load_stack_spec
from gemmaserve.spec import SpecError, parse_spec
from tests import ROOT
from tests.unit.test_stacks import STACKS

VARIANTS = [
    {"model": "31b", "accelerator": {"kind": "h100-80gb", "count": 2}, "workload": {"speculative": {"method": "mtp"}}},
    {
        "model": "e4b",
        "accelerator": {"kind": "l4"},
        "workload": {
            "speculative": {"method": "ngram"},
            "vision_token_budget": 560,
            "kv_cache_dtype": "fp8",
            "block_size": 32,
            "max_num_seqs": 16,
            "max_num_batched_tokens": 4096,
            "enable_prefix_caching": False,
            "enforce_eager": True,
            "dtype": "bfloat16",
            "allowed_media_domains": ["images.example.com"],
        },
    },
    {"model": "tiny", "accelerator": {"kind": "cpu"}},
    {"model": "e2b", "accelerator": {"kind": "tpu-v6e", "count": 4}},
    {
        "model": "31b",
        "accelerator": {"kind": "h200"},
        "weights": {"source": "bucket", "bucket": "gs://acme", "revision": "a" * 40, "load": "stream"},
    },
]


def planned_argvs(tmp_path) -> list[list[str]]:
    """Every replica's argv of every stack and the variants (a LoRA adapter, a pinned revision too), less the spec's
    own extra_args."""
    adapter = tmp_path / "sql"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8, "target_modules": ["q_proj"]}')
    lora = {
        "model": "31b",
        "accelerator": {"kind": "h200"},
        "weights": {"revision": "b" * 40},
        "serving": {"lora_adapters": [{"name": "sql", "source": str(adapter)}]},
    }
    results = [plan(load_stack_spec(stack, ROOT)) for stack in STACKS]
    results += [plan(parse_spec(data)) for data in [*VARIANTS, lora]]
    argvs = []
    for result in results:
        extra = list(result.spec.workload.extra_args)
        for replica in result.require_ok().replicas:
            argv = list(replica.argv)
            if extra:
                at = next(i for i in range(len(argv)) if argv[i : i + len(extra)] == extra)
                del argv[at : at + len(extra)]
            argvs.append(argv)
    return argvs


def test_every_flag_a_plan_emits_is_one_extra_args_may_not_set(tmp_path):
    """Were a flag the plan emits missing from the table, extra_args could set it a second time, and vLLM would
    take the extra one."""
    emitted = {word.split("=")[0] for argv in planned_argvs(tmp_path) for word in argv[3:] if word.startswith("--")}
    assert len(emitted) > 25
    assert {flag for flag in emitted if planned_destination(flag) is None} == set()
    # ... and each destination the table names has a field or a reason.
    assert all(PLANNED[planned_destination(flag)] for flag in emitted)


@pytest.mark.parametrize(
    "word, dest",
    [
        ("--kv-cache-dtype", "kv_cache_dtype"),
        ("--kv_cache_dtype", "kv_cache_dtype"),  # vLLM reads underscores as dashes
        ("--max-model-len=4096", "max_model_len"),
        ("--max-model", "max_model_len"),  # an abbreviation vLLM's parser takes (allow_abbrev)
        ("--no-enable-prefix-caching", "enable_prefix_caching"),
        ("-tp", "tensor_parallel_size"),
        ("-tp4", "tensor_parallel_size"),
        ("-q", "quantization"),
        ("--device-memory-utilization", "gpu_memory_utilization"),
        ("--api-key", "api_key"),
        ("--safetensors-load-strategy", None),
        ("--max-cpu-loras", None),
        ("prefetch", None),
        ("-1", None),
        ("--", None),
    ],
)
def test_each_form_vllm_reads_is_matched(word: str, dest: str | None):
    assert planned_destination(word) == dest


def test_an_extra_flag_the_plan_sets_is_refused_naming_the_field():
    base = {"model": "31b", "accelerator": {"kind": "h100-80gb", "count": 2}}
    with pytest.raises(SpecError) as caught:
        parse_spec(base | {"workload": {"extra_args": ["--kv-cache-dtype", "fp8", "--safetensors-load-strategy", "x"]}})
    assert caught.value.problems == [
        "workload.extra_args = ['--kv-cache-dtype', 'fp8', '--safetensors-load-strategy', 'x']: '--kv-cache-dtype' "
        "sets vLLM's kv_cache_dtype, which the plan sets from workload.kv_cache_dtype; allowed: that field "
        "(extra_args are for flags gemmaserve does not plan)"
    ]
    # What the plan does not set passes (the tpu-v6e4 stack's own extra flag).
    assert parse_spec(base | {"workload": {"extra_args": ["--safetensors-load-strategy", "prefetch"]}})


def test_runtime_weight_quantization_on_tpu_is_refused_with_the_reason():
    """tpu-inference 0.32.0's JAX Gemma 4 quantizes nothing at load: a 16-bit checkpoint runs in 16 bits, or the
    model is a QAT or FP8-serialized checkpoint."""
    tpu = {"model": "e2b", "accelerator": {"kind": "tpu-v6e", "count": 4}}
    problems = planned_flag_problems(("--quantization", "fp8"), tpu=True)
    assert len(problems) == 1 and "tpu-inference 0.32.0 quantizes no 16-bit Gemma 4 weights" in problems[0]
    with pytest.raises(SpecError, match="a QAT or FP8-serialized checkpoint"):
        parse_spec(tpu | {"workload": {"extra_args": ["--quantization=fp8"]}})
    gpu = planned_flag_problems(("--quantization", "fp8"))
    assert "quantization_config, which vLLM detects" in gpu[0]
