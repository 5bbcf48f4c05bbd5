"""The static and stack-output inventories, loaded by pyinfra's own inventory loader (ops.fleet), carry host
data that validates into the planned spec; the stack's `hosts` output is read through its typed record."""

import json
import os
import subprocess
import sys

import pytest

from gemmaserve.ops import fleet
from gemmaserve.plan import plan
from gemmaserve.records import HostRecord, parse_host_records
from gemmaserve.sources import capacity_from_host_data, load_stack_spec
from gemmaserve.spec import SpecError
from tests import ROOT


@pytest.fixture
def environ(monkeypatch):
    def set_env(**values):
        for key, value in values.items():
            monkeypatch.setenv(key, value)

    return set_env


def test_gpu8_is_four_tp2_replicas_of_31b(environ):
    environ(GEMMASERVE_GPU8_HOST="10.9.9.9", GEMMASERVE_GPU8_USER="ubuntu")
    (host,) = fleet.load("hosts/gpu8.py")
    assert host.name == "10.9.9.9" and host.data["ssh_user"] == "ubuntu" and host.data["_sudo"] is True
    assert [r.env["CUDA_VISIBLE_DEVICES"] for r in host.plan.replicas] == ["0,1", "2,3", "4,5", "6,7"]
    assert host.plan.model.hf_id == "google/gemma-4-31B-it"


def tpu_record(**changes) -> dict:
    host_plan = plan(load_stack_spec("tpu-v6e4", ROOT)).require_ok()
    record = HostRecord.for_plan(
        host_plan,
        name="gemmaserve-tpu-v6e4-0",
        internal_ip="10.128.0.7",
        external_ip=None,
        zone="us-east5-b",
        ssh_user="gemmaserve",
        kind="tpu-vm",
        instance_type="v6e-4",
    ).model_dump(mode="json")
    return {**record, **changes}


def test_stack_inventory_reads_saved_outputs(tmp_path, environ):
    saved = tmp_path / "hosts.json"
    saved.write_text(json.dumps([tpu_record()]))
    environ(GEMMASERVE_STACK="tpu-v6e4", GEMMASERVE_HOSTS_JSON=str(saved))
    (host,) = fleet.load("hosts/stack.py")
    assert host.name == "gemmaserve-tpu-v6e4-0" and host.data["ssh_hostname"] == "10.128.0.7"
    assert host.plan.accelerator.name == "tpu-v6e" and host.plan.replicas[0].tensor_parallel_size == 4
    # A TPU VM gets the preemption drain; the secret is the one the stack created.
    assert host.data["gemmaserve_capacity"] == {"kind": "tpu-vm", "provisioning": "standard"}
    assert capacity_from_host_data(host.data, host.name).preemptible
    assert host.data["gemmaserve_secret"] == {"secret_manager": "gs-tpu-v6e4-hf-token"}


def test_stack_inventory_marks_spot_gpu_hosts_preemptible(tmp_path, environ):
    saved = tmp_path / "hosts.json"
    saved.write_text(json.dumps([tpu_record(kind="gce-vm", provisioning="spot", name="gs-a100-gpu-0")]))
    environ(GEMMASERVE_STACK="a100", GEMMASERVE_HOSTS_JSON=str(saved))
    (host,) = fleet.load("hosts/stack.py")
    assert host.data["gemmaserve_capacity"] == {"kind": "gce-vm", "provisioning": "spot"}


def test_host_record_round_trips_through_json():
    record = tpu_record()
    (parsed,) = parse_host_records(json.loads(json.dumps([record])), "saved")
    assert parsed.model_dump(mode="json") == record and parsed.address == "10.128.0.7"


def test_a_bad_host_record_names_index_field_and_value():
    with pytest.raises(SpecError) as caught:
        parse_host_records([tpu_record(), tpu_record(kind="k8s-pod", router_port="x")], "stack tpu-v6e4 output hosts")
    message = str(caught.value)
    assert "stack tpu-v6e4 output hosts" in message
    assert "hosts[1].kind = 'k8s-pod'" in message and "hosts[1].router_port = 'x'" in message
    with pytest.raises(SpecError, match="must be a list of host records"):
        parse_host_records({"name": "x"}, "saved")


def test_stack_inventory_needs_a_stack_name():
    result = subprocess.run(
        [sys.executable, str(ROOT / "hosts" / "stack.py")],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "GEMMASERVE_STACK"},
        cwd=ROOT,
    )
    assert result.returncode != 0 and "GEMMASERVE_STACK" in result.stderr
