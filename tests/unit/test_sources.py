"""Host data is validated into the same spec as stack config."""

import pytest

from gemmaserve.sources import capacity_from_host_data, spec_from_host_data, stack_prefix, stack_secret_name
from gemmaserve.spec import SpecError
from tests import ROOT

GPU8 = {"gemmaserve_model": "31b", "gemmaserve_accelerator": {"kind": "rtx-pro-6000", "count": 8}, "ssh_user": "ubuntu"}


def test_host_data_becomes_a_spec():
    spec = spec_from_host_data(GPU8)
    assert spec.model == "google/gemma-4-31B-it" and spec.accelerator.count == 8


def test_unknown_gemmaserve_key_names_host_and_allowed_keys():
    with pytest.raises(SpecError) as caught:
        spec_from_host_data({**GPU8, "gemmaserve_modle": "31b"}, "gpu8")
    message = str(caught.value)
    assert "host data of gpu8" in message and "gemmaserve_modle" in message and "gemmaserve_model" in message


def test_bad_value_names_host_field_and_value():
    with pytest.raises(SpecError) as caught:
        spec_from_host_data({**GPU8, "gemmaserve_workload": {"kv_cache_dtype": "int8"}}, "gpu8")
    assert "host data of gpu8" in str(caught.value) and "workload.kv_cache_dtype = 'int8'" in str(caught.value)


def test_other_keys_are_left_alone():
    assert spec_from_host_data({**GPU8, "ssh_port": 22, "gemmaserve_sandbox": True}).accelerator.kind == "rtx-pro-6000"


@pytest.mark.parametrize("stack, prefix", [("tpu-v6e4", "gs-tpu-v6e4"), ("GPU8", "gs-gpu8"), ("a_100", "gs-a-100")])
def test_stack_prefix_keeps_short_names(stack, prefix):
    assert stack_prefix(stack) == prefix


def test_long_stack_names_never_share_a_prefix():
    # Truncated alone, both would be "gs-tpu-v6e4-product".
    a, b = stack_prefix("tpu-v6e4-production-east"), stack_prefix("tpu-v6e4-production-west")
    assert a != b and len(a) <= 20 and len(b) <= 20 and a.startswith("gs-tpu-v6e4")


@pytest.mark.parametrize(
    "secret, name",
    [
        ("hf-token", "gs-tpu-v6e4-hf-token"),
        ("hf-token/versions/3", "gs-tpu-v6e4-hf-token/versions/3"),
        ("projects/shared/secrets/hf-token", "projects/shared/secrets/hf-token"),
    ],
)
def test_a_stack_owns_its_secret_unless_a_full_path_is_given(secret, name):
    assert stack_secret_name("tpu-v6e4", secret) == name


def test_capacity_host_data_is_validated():
    assert not capacity_from_host_data({}).preemptible
    assert capacity_from_host_data({"gemmaserve_capacity": {"kind": "tpu-vm"}}).preemptible
    assert capacity_from_host_data({"gemmaserve_capacity": {"kind": "gce-vm", "provisioning": "spot"}}).preemptible
    with pytest.raises(SpecError) as caught:
        capacity_from_host_data({"gemmaserve_capacity": {"kind": "gce-vm", "provisioning": "preemptible"}}, "h1")
    assert "host data of h1" in str(caught.value) and "gemmaserve_capacity.provisioning = 'preemptible'" in str(
        caught.value
    )


def test_every_secret_of_a_stack_is_named_once_for_plan_program_and_hosts():
    """HF token, API keys and TLS certificate: the spec a stack deploys (load_stack_spec, which the
    program's read_settings matches) and its hosts' data (stack_host_data) name the same stack-owned secrets."""

    from gemmaserve.sources import load_stack_spec, stack_host_data

    spec, data = load_stack_spec("gpu8", ROOT), stack_host_data("gpu8", ROOT)
    assert spec.secret.secret_manager == data["gemmaserve_secret"]["secret_manager"] == "gs-gpu8-hf-token"
    assert spec.serving.api_keys.secret_manager == data["gemmaserve_serving"]["api_keys"]["secret_manager"]
    assert spec.serving.api_keys.secret_manager == "gs-gpu8-api-keys"
    assert spec.serving.tls.secret_manager == data["gemmaserve_serving"]["tls"]["secret_manager"] == "gs-gpu8-tls"
