"""The static and stack-output inventories carry host data that validates into the planned spec."""

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

from gemmaserve.hostdata import spec_from_host_data
from gemmaserve.plan import plan

ROOT = Path(__file__).resolve().parents[2]


def load(inventory, env):
    old = dict(os.environ)
    os.environ.update(env)
    try:
        return runpy.run_path(str(ROOT / "hosts" / inventory))
    finally:
        os.environ.clear()
        os.environ.update(old)


def test_gpu8_is_four_tp2_replicas_of_31b():
    ((name, data),) = load("gpu8.py", {"GEMMASERVE_GPU8_HOST": "10.9.9.9", "GEMMASERVE_GPU8_USER": "ubuntu"})["gpu8"]
    assert name == "10.9.9.9" and data["ssh_user"] == "ubuntu" and data["_sudo"] is True
    serving = plan(spec_from_host_data(data, name)).require_ok()
    assert [r.env["CUDA_VISIBLE_DEVICES"] for r in serving.replicas] == ["0,1", "2,3", "4,5", "6,7"]
    assert serving.model.hf_id == "google/gemma-4-31B-it"


def test_stack_inventory_reads_saved_outputs(tmp_path):
    saved = tmp_path / "hosts.json"
    saved.write_text(
        json.dumps(
            [
                {
                    "name": "gemmaserve-tpu-v6e4-0",
                    "internal_ip": "10.128.0.7",
                    "zone": "us-east5-b",
                    "ssh_user": "gemmaserve",
                }
            ]
        )
    )
    inventory = load("stack.py", {"GEMMASERVE_STACK": "tpu-v6e4", "GEMMASERVE_HOSTS_JSON": str(saved)})
    ((name, data),) = inventory["serving"]
    assert data["ssh_hostname"] == "10.128.0.7"
    serving = plan(spec_from_host_data(data, name)).require_ok()
    assert serving.accelerator.name == "tpu-v6e" and serving.replicas[0].tensor_parallel_size == 4


def test_stack_inventory_needs_a_stack_name():
    result = subprocess.run(
        [sys.executable, str(ROOT / "hosts" / "stack.py")],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "GEMMASERVE_STACK"},
        cwd=ROOT,
    )
    assert result.returncode != 0 and "GEMMASERVE_STACK" in result.stderr
