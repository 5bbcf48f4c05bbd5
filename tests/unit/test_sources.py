"""Host data is validated into the same spec as stack config."""

import pytest

from gemmaserve.sources import spec_from_host_data
from gemmaserve.spec import SpecError

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
