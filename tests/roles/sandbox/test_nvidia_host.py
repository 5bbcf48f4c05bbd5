"""The nvidia role for real on a sandbox host made to look like an 8 x H100 HGX box, then systemd's own
tools on the replica units it leaves room for.

What the host is given (nothing else is faked):
  - a local apt repository standing in for NVIDIA's CUDA repository for Debian 12 (tests/roles/sandbox/
    cuda_repo.py: published names and versions, signed, with 580 and 595 branches both offered), bound
    read-only at /srv/gemmaserve-cuda-repo; the role is pointed at it with nvidia_repo_url;
  - /usr/local/sbin/lspci answering `lspci -nn -D -d 10de:` with a real HGX H100's recorded lines (the real
    pciutils is installed by the role and answers everything else);
  - the repository's nvidia-smi prints a real 8 x H100's recorded `nvidia-smi -q` and `topo -m`.
No kernel module can load in a container: the role must say a reboot is needed and not reboot.
For the unit checks, /opt/gemmaserve/venvs is covered with a tmpfs holding an executable stub at the
planned venv's bin/vllm (no CUDA vLLM on a CPU host).
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest

from gemmaserve.ops import fleet
from gemmaserve.plan import plan
from gemmaserve.sandbox import machine, state
from gemmaserve.spec import parse_spec
from gemmaserve.topology import parse_topo_matrix, with_topology
from roles._lib.render import render
from roles.replicas import TEMPLATES, affinity_dropin, unit_context
from tests.roles.sandbox.cuda_repo import DRIVER, MOUNT, NEWER, RECORDED, build_repo
from tests.sandbox_fixtures import bring_up_new

pytestmark = pytest.mark.sandbox

DEPLOY = "tests/roles/sandbox/nvidia_deploy.py"
SPEC = {"model": "31b", "accelerator": {"kind": "h100-80gb", "count": 8}, "serving": {"tensor_parallel_size": 2}}
LSPCI_STUB = """#!/bin/sh
# gemmaserve sandbox: NVIDIA devices from a real HGX H100's recorded `lspci -nn -D`; the rest from pciutils.
case " $* " in *" 10de: "*) exec cat /usr/local/share/gemmaserve-recorded/lspci-nn.txt ;; esac
exec /usr/bin/lspci "$@"
"""


def sh(host: state.Host, command: str, timeout: float = 120):
    current = state.load_state().host(host.name)
    return machine.in_host(current, "/bin/sh", "-c", command, timeout=timeout)


@pytest.fixture(scope="module")
def gpu_host(request, sandbox_ready, served_assets, tmp_path_factory):
    kernel = os.uname().release
    repo = build_repo(tmp_path_factory.mktemp("cuda-repo") / "repo", kernel)
    [host] = bring_up_new(1, request, bind_ro=(f"{repo}:{MOUNT}",))
    recorded = host.rootfs / "usr/local/share/gemmaserve-recorded"
    recorded.mkdir(parents=True, exist_ok=True)
    (recorded / "lspci-nn.txt").write_text((RECORDED / "h100_hgx_lspci_nn.txt").read_text())
    stub = host.rootfs / "usr/local/sbin/lspci"
    stub.write_text(LSPCI_STUB)
    stub.chmod(0o755)
    data = {
        **host.ssh_data(),
        "gemmaserve_model": SPEC["model"],
        "gemmaserve_accelerator": SPEC["accelerator"],
        "gemmaserve_serving": SPEC["serving"],
        "nvidia_repo_url": f"file://{MOUNT}",
    }
    inventory = tmp_path_factory.mktemp("inventory") / "hgx_on_sandbox.py"
    inventory.write_text(f"hgx = [({'hgx-on-' + host.name!r}, {data!r})]\n")
    first = fleet.run_pyinfra(inventory, DEPLOY, timeout=900)
    second = fleet.run_pyinfra(inventory, DEPLOY, timeout=600)
    return host, first, second


def test_the_role_converges(gpu_host):
    _, first, _ = gpu_host
    assert first.ok, first.output[-4000:]
    # No module can load here: the role says a reboot is needed and does not reboot.
    # pyinfra reads the facts when the operation runs: after the install, so the module is what is missing.
    reboot = re.search(r"reboot needed \((.*?)\); set nvidia_allow_reboot", first.output)
    assert reboot and reboot[1] in ("the driver is being installed", "no NVIDIA kernel module is loaded"), first.output[
        -4000:
    ]


def test_a_second_run_changes_nothing(gpu_host):
    _, _, second = gpu_host
    assert second.ok, second.output[-4000:]
    assert second.totals()[1] == 0, second.output[-4000:]


def dpkg_versions(host) -> dict[str, str]:
    out = sh(host, "dpkg-query -W -f='${Package} ${Version} ${db:Status-Abbrev}\\n'").stdout
    return {p: v for p, v, status in (line.split(" ", 2) for line in out.splitlines()) if status.startswith("ii")}


def test_driver_held_on_branch_580_with_fabric_manager_at_its_version(gpu_host):
    host, _, _ = gpu_host
    installed = dpkg_versions(host)
    wanted = ("nvidia-open", "nvidia-driver", "nvidia-driver-cuda", "nvidia-kernel-open-dkms", "libcuda1", "nvidia-smi")
    assert {p: installed.get(p) for p in wanted} == dict.fromkeys(wanted, DRIVER)
    assert installed["nvidia-driver-pinning-580"] == DRIVER and "nvidia-driver-pinning-595" not in installed
    # NVSwitches on the (recorded) PCI bus: fabric manager, at the driver's version.
    assert installed["nvidia-fabricmanager"] == DRIVER
    assert f"linux-headers-{os.uname().release}" in installed


def test_without_nvidias_pin_apt_would_take_the_newer_branch(gpu_host):
    """The oracle is apt: with the pinning package's preferences ignored, the same repository gives 595, and
    even nvidia-open=580 pulls a 595 nvidia-driver (its Depends is a floor, as NVIDIA's forum reported)."""
    host, _, _ = gpu_host
    unpinned = "-o Dir::Etc::PreferencesParts=/nonexistent -o Dir::Etc::Preferences=/nonexistent"
    policy = sh(host, f"apt-cache {unpinned} policy nvidia-open").stdout
    assert f"Candidate: {NEWER}" in policy
    assert f"Candidate: {DRIVER}" in sh(host, "apt-cache policy nvidia-open").stdout
    upgrade = sh(host, f"apt-get -s {unpinned} install nvidia-driver").stdout
    assert f"Inst nvidia-driver [{DRIVER}] ({NEWER}" in upgrade, upgrade


@pytest.mark.parametrize(
    ("unit", "enabled"),
    [
        ("gemmaserve-nvidia-devices.service", "enabled"),
        ("nvidia-persistenced", "enabled"),
        ("nvidia-fabricmanager", "enabled"),
    ],
)
def test_driver_units_are_enabled_for_the_next_boot(gpu_host, unit, enabled):
    host, _, _ = gpu_host
    assert sh(host, f"systemctl is-enabled {unit}").stdout.strip() == enabled


def test_persistence_mode_is_on_in_the_daemons_command(gpu_host):
    host, _, _ = gpu_host
    shown = sh(host, "systemctl show -p ExecStart -p StopWhenUnneeded nvidia-persistenced").stdout
    assert "argv[]=/usr/bin/nvidia-persistenced --verbose ;" in shown and "no-persistence-mode" not in shown
    assert "StopWhenUnneeded=no" in shown


def test_apt_and_needrestart_leave_the_driver_alone(gpu_host):
    host, _, _ = gpu_host
    dump = sh(host, "apt-config dump").stdout
    assert 'Unattended-Upgrade::Package-Blacklist:: "^nvidia-";' in dump
    assert (
        "$nrconf{override_rc}->{qr(^nvidia-persistenced)} = 0;"
        in sh(host, "cat /etc/needrestart/conf.d/gemmaserve.conf").stdout
    )


def test_preflight_on_the_host_reads_the_repositorys_nvidia_smi(gpu_host):
    """The installed preflight, the installed nvidia-smi (recorded output): healthy GPUs pass; without a
    loaded module it refuses, so the replica never reaches the balancer."""
    host, _, _ = gpu_host
    version = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  565.57.01  Release Build"
    env = "CUDA_VISIBLE_DEVICES=0,1 CUDA_DEVICE_ORDER=PCI_BUS_ID"
    ok = sh(
        host, f"echo '{version}' > /tmp/v && {env} python3 /opt/gemmaserve/lib/gpu_preflight.py --proc-version /tmp/v"
    )
    assert ok.returncode == 0, ok.stderr
    no_module = sh(host, f"{env} python3 /opt/gemmaserve/lib/gpu_preflight.py")
    assert no_module.returncode == 1 and "no NVIDIA kernel module is loaded" in no_module.stderr


def install_unit(host, host_plan, extra: dict[str, str] | None = None) -> None:
    """The rendered vllm@.service (and drop-ins) into the host, with a stub at the venv's vllm."""
    unit = render(TEMPLATES / "vllm@.service.j2", **unit_context(host_plan))
    files = {"/etc/systemd/system/vllm@.service": unit, **(extra or {})}
    # The sandbox binds the shared venvs read-only there: cover them (once) with a tmpfs for the stub.
    script = ['[ "$(stat -f -c %T /opt/gemmaserve/venvs)" = tmpfs ] || mount -t tmpfs tmpfs /opt/gemmaserve/venvs']
    script.append(
        f"mkdir -p {host_plan.engine.venv}/bin && printf '#!/bin/sh\\nexit 0\\n' > {host_plan.engine.vllm_executable}"
    )
    script.append(f"chmod 755 {host_plan.engine.vllm_executable}")
    for path, content in files.items():
        script.append(f"mkdir -p {shlex.quote(str(Path(path).parent))}")
        script.append(f"printf %s {shlex.quote(content)} > {shlex.quote(path)}")
    script.append("systemctl daemon-reload")
    result = sh(host, " && ".join(script))
    assert result.returncode == 0, result.stderr


def show(host, unit: str, *properties: str) -> dict[str, str]:
    out = sh(host, f"systemctl show {unit} " + " ".join(f"-p {p}" for p in properties)).stdout
    shown: dict[str, str] = {}
    for line in out.splitlines():
        key, _, value = line.partition("=")
        shown[key] = f"{shown[key]}\n{value}" if key in shown else value
    return shown


def device_allow(shown: dict[str, str]) -> list[str]:
    """The unit's own DeviceAllow= entries, sorted (systemd lists them in no fixed order): ProtectClock=yes
    adds "char-rtc r" (systemd.exec(5))."""
    entries = shown["DeviceAllow"].splitlines()
    assert "char-rtc r" in entries, entries
    return sorted(e for e in entries if e != "char-rtc r")


def test_nvidia_unit_passes_systemd_analyze_and_shows_its_policy(gpu_host):
    host, first, _ = gpu_host
    assert first.ok
    host_plan = plan(parse_spec(SPEC)).require_ok()
    topology = parse_topo_matrix((RECORDED / "h100_hgx_topo_m.txt").read_text())
    host_plan = with_topology(host_plan, topology)
    dropin = affinity_dropin(host_plan.replicas[2])
    install_unit(host, host_plan, {"/etc/systemd/system/vllm@2.service.d/gemmaserve-affinity.conf": dropin})
    verify = sh(host, "systemd-analyze verify vllm@2.service gemmaserve-nvidia-devices.service")
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "Unknown" not in verify.stdout + verify.stderr and "ignoring" not in verify.stdout + verify.stderr
    shown = show(
        host,
        "vllm@2.service",
        "DevicePolicy",
        "DeviceAllow",
        "After",
        "Requires",
        "Wants",
        "CPUAffinity",
        "NUMAPolicy",
        "NUMAMask",
    )
    assert shown["DevicePolicy"] == "closed"
    # The GPUs, unified memory, and MIG's capability nodes (/dev/nvidia-caps, roles/replicas).
    assert device_allow(shown) == ["char-nvidia rw", "char-nvidia-caps rw", "char-nvidia-uvm rw"]
    after = shown["After"].split()
    for unit in ("gemmaserve-nvidia-devices.service", "nvidia-persistenced.service", "nvidia-fabricmanager.service"):
        assert unit in after
    assert "gemmaserve-nvidia-devices.service" in shown["Requires"].split()
    assert "nvidia-fabricmanager.service" in shown["Wants"].split()
    # Replica 2's GPUs (4, 5) hang off NUMA node 1 (the recorded topology): its CPUs and memory are node 1's.
    assert (shown["CPUAffinity"], shown["NUMAPolicy"], shown["NUMAMask"]) == ("52-103 156-207", "bind", "1")
    devices = show(host, "gemmaserve-nvidia-devices.service", "ExecStart")["ExecStart"]
    assert "argv[]=/usr/bin/nvidia-modprobe -c 255 -c 0 -c 1 -c 2 -c 3 -c 4 -c 5 -c 6 -c 7 ;" in devices
    assert "argv[]=/usr/bin/nvidia-modprobe -u -c 0 ;" in devices


@pytest.mark.parametrize(
    ("spec", "allow", "memlock"),
    [
        ({"model": "31b", "accelerator": {"kind": "mi300x", "count": 8}}, ["char-kfd rw", "char-drm rw"], "default"),
        ({"model": "e2b", "accelerator": {"kind": "tpu-v6e", "count": 4}}, None, "infinity"),
    ],
    ids=["amd", "tpu"],
)
def test_amd_and_tpu_units_pass_systemd_analyze(gpu_host, spec, allow, memlock):
    host, _, _ = gpu_host
    host_plan = plan(parse_spec(spec)).require_ok()
    assert host_plan.engine.kind == "wheel"
    install_unit(host, host_plan)
    verify = sh(host, "systemd-analyze verify vllm@0.service")
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "Unknown" not in verify.stdout + verify.stderr
    shown = show(host, "vllm@0.service", "DeviceAllow", "LimitMEMLOCK", "Requires")
    if allow:
        assert device_allow(shown) == sorted(allow)
    assert (shown["LimitMEMLOCK"] == "infinity") is (memlock == "infinity"), shown["LimitMEMLOCK"]
    assert "gemmaserve-nvidia-devices.service" not in shown["Requires"]


def test_units_that_systemd_rejects_are_caught(gpu_host):
    """The oracle can fail: a directive systemd does not know is an error of systemd-analyze verify."""
    host, _, _ = gpu_host
    host_plan = plan(parse_spec(SPEC)).require_ok()
    install_unit(
        host, host_plan, {"/etc/systemd/system/vllm@0.service.d/broken.conf": "[Service]\nDeviceAlow=char-nvidia rw\n"}
    )
    verify = sh(host, "systemd-analyze verify vllm@0.service")
    sh(host, "rm -rf /etc/systemd/system/vllm@0.service.d && systemctl daemon-reload")
    # systemd 252 (Debian 12) says "Unknown key 'X'", later releases "Unknown key name 'X'".
    assert re.search(r"Unknown key (name )?'DeviceAlow'", verify.stdout + verify.stderr)
