"""`pyinfra --dry` with a gpu8-style inventory against a sandbox host whose GPU facts are overridden:
the driver, engine and replica operations a real 8 x RTX PRO 6000 box would get, and no change made."""

from __future__ import annotations

import runpy

import pytest

from gemmaserve.ops import fleet
from gemmaserve.sandbox import credentials, state
from tests import ROOT

pytestmark = pytest.mark.sandbox


@pytest.fixture(scope="module")
def dry_run(sandbox_hosts, tmp_path_factory):
    host = sandbox_hosts[0]
    gpu8_data = dict(runpy.run_path(str(ROOT / "hosts" / "gpu8.py"))["gpu8"][0][1])
    gpu8_data.pop("_sudo", None)
    token = tmp_path_factory.mktemp("token") / "hf-token"
    token.write_text("hf_dryrunTESTtoken\n")
    tls_bundle = token.parent / "tls.pem"
    ca_cert, ca_key = credentials.make_ca("gpu8 dry-run test CA")
    tls_bundle.write_bytes(credentials.issue_server_bundle(ca_cert, ca_key, ["gpu8"]))
    data = {
        **gpu8_data,
        **host.ssh_data(),
        "gemmaserve_gpu_facts": {"gpu_count": 8, "kernel_module": None},
        # gpu8 reads its token and its TLS certificate from files on the host; a dry run only plans the uploads.
        "hf_token_src": str(token),
        "access_tls_src": str(tls_bundle),
    }
    inventory = tmp_path_factory.mktemp("inventory") / "gpu8_on_sandbox.py"
    inventory.write_text(f"gpu8 = [({'gpu8-on-' + host.name!r}, {data!r})]\n")
    before = _snapshot(host)
    # No -y: the change-detection listing is what a dry run is for; --dry then stops before executing.
    result = fleet.run_pyinfra(inventory, "tests/roles/sandbox/gpu_facts_deploy.py", dry=True, timeout=600)
    return result, before, host


def _snapshot(host) -> str:
    from gemmaserve.sandbox import machine

    current = state.load_state().host(host.name)  # its PID changes if another test rebooted it
    return machine.in_host(
        current,
        "/bin/sh",
        "-c",
        "ls -la /etc/apt/preferences.d /etc/apt/sources.list.d /etc/gemmaserve 2>&1; dpkg -l | grep -c '^ii'",
    ).stdout


def test_dry_run_succeeds(dry_run):
    result, _, _ = dry_run
    assert result.ok, result.output[-4000:]


@pytest.mark.parametrize(
    "operation",
    [
        "Install the NVIDIA driver |",
        "Install vllm==0.32.0 into /opt/gemmaserve/venvs/vllm-0.32.0",
        "Install vLLM 0.32.0's Gemma 4 tool chat template",
        "Check replica 3's vLLM flags with vLLM's own parser, then install them",
        "Drain replica 3 in HAProxy",
        "Install the TLS certificate /etc/gemmaserve/tls.pem",
        "Create the API key store /etc/gemmaserve/api-keys",
    ],
)
def test_dry_run_plans_the_gpu_host_operations(dry_run, operation):
    assert operation in dry_run[0].output


def test_no_fabric_manager_on_a_pcie_host(dry_run):
    assert "fabricmanager" not in dry_run[0].output.lower()
    assert "no NVSwitch on the PCI bus" in dry_run[0].output


def test_token_not_in_dry_run_output(dry_run):
    assert "hf_dryrunTESTtoken" not in dry_run[0].output


def test_dry_run_changed_nothing(dry_run):
    _, before, host = dry_run
    assert _snapshot(host) == before
