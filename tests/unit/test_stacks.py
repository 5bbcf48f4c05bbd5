"""Every Pulumi.<stack>.yaml validates into a spec that plans, and bad stack config is refused by name."""

import pytest

from gemmaserve.plan import plan
from gemmaserve.sources import load_stack_spec, read_stack_config
from gemmaserve.spec import SpecError
from tests import ROOT

STACKS = sorted(p.name.removeprefix("Pulumi.").removesuffix(".yaml") for p in ROOT.glob("Pulumi.*.yaml"))


def test_the_five_stacks_exist():
    assert set(STACKS) >= {"tpu-v6e4", "tpu-v6e1", "gpu8", "a100", "h100"}


@pytest.mark.parametrize("stack", STACKS)
def test_stack_plans(stack):
    result = plan(load_stack_spec(stack, ROOT))
    assert result.ok, result.refusals


@pytest.mark.parametrize(
    "stack, model, accelerator, replicas, tp",
    [
        ("tpu-v6e4", "google/gemma-4-26B-A4B-it", "tpu-v6e", 1, 4),
        ("tpu-v6e1", "google/gemma-4-E2B-it", "tpu-v6e", 1, 1),
        ("gpu8", "google/gemma-4-31B-it", "rtx-pro-6000", 4, 2),
        ("a100", "google/gemma-4-26B-A4B-it", "a100-80gb", 1, 1),
        ("h100", "google/gemma-4-31B-it", "h100-80gb", 4, 2),
    ],
)
def test_stack_shapes(stack, model, accelerator, replicas, tp):
    result = plan(load_stack_spec(stack, ROOT))
    assert (result.model.hf_id, result.accelerator.name) == (model, accelerator)
    assert len(result.replicas) == replicas
    assert {r.tensor_parallel_size for r in result.replicas} == {tp}


def test_unknown_stack_lists_the_real_ones(tmp_path):
    (tmp_path / "Pulumi.dev.yaml").write_text("config: {}\n")
    with pytest.raises(SpecError, match="allowed: dev"):
        read_stack_config("prod", tmp_path)


def test_unknown_namespace_key_is_refused(tmp_path):
    (tmp_path / "Pulumi.x.yaml").write_text("config:\n  gemmaserve:modle: 31b\n")
    with pytest.raises(SpecError, match="gemmaserve:modle: unknown config key; allowed: model"):
        read_stack_config("x", tmp_path)


def test_bad_stack_value_names_the_file_and_field(tmp_path):
    (tmp_path / "Pulumi.x.yaml").write_text(
        "config:\n  gemmaserve:model: 31b\n  gemmaserve:accelerator: {kind: rtx-pro-6000, count: 8}\n"
        "  gemmaserve:workload: {gpu_memory_utilization: 1.2}\n"
    )
    with pytest.raises(SpecError) as caught:
        load_stack_spec("x", tmp_path)
    assert "Pulumi.x.yaml" in str(caught.value)
    assert "workload.gpu_memory_utilization = 1.2" in str(caught.value)


def test_other_namespaces_are_ignored(tmp_path):
    (tmp_path / "Pulumi.x.yaml").write_text(
        "config:\n  gcp:project: p\n  gemmaserve:model: e2b\n  gemmaserve:accelerator: {kind: l4}\n"
    )
    assert load_stack_spec("x", tmp_path).model == "google/gemma-4-E2B-it"
