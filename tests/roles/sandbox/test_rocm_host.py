"""The rocm role for real on a sandbox host made to look like an MI300X box: it converges, a second run changes
nothing, and a plan that wants more GPUs than the host's rocm-smi lists stops the deploy.

What the host is given (nothing else is faked):
  - a local stand-in for repo.radeon.com's ROCm 7.2.3 tree (tests/roles/sandbox/rocm_repo.py: the published
    installer file name, package names, versions and relations, signed), bound read-only at
    /srv/gemmaserve-rocm-repo; the role is pointed at it with rocm_repo_base;
  - a flat repository with the sandbox kernel's headers, standing in for the distribution's;
  - the repository's rocm-smi prints a real 4 x MI300X host's recorded table.
The role runs with its defaults: the amdgpu DKMS driver and no reboot allowed. No module can load in a
container, so the role must say a reboot is needed, and not reboot.
"""

from __future__ import annotations

import os
import re
import time

import pytest

from gemmaserve.ops import fleet
from gemmaserve.sandbox import machine, state
from roles.rocm import Settings as RocmSettings
from roles.rocm import installer_deb
from tests.roles.sandbox.rocm_repo import (
    AMDGPU,
    BASE,
    DKMS_VERSION,
    HEADERS_DIR,
    INSTALLER_DEB,
    INSTALLER_VERSION,
    MOUNT,
    PREFIX,
    RELEASE,
    ROCM_BUILD,
    ROCM_DEPENDS,
    ROCM_VERSION,
    build_repo,
)
from tests.sandbox_fixtures import bring_up_new

pytestmark = pytest.mark.sandbox

DEPLOY = "tests/roles/sandbox/rocm_deploy.py"
# The recorded rocm-smi lists 4 GPUs; 31B fits one MI300X per replica.
SPEC = {"model": "31b", "accelerator": {"kind": "mi300x", "count": 4}}
HEADERS_LIST = "/etc/apt/sources.list.d/gemmaserve-sandbox-kernel-headers.list"


def sh(host: state.Host, command: str, timeout: float = 120):
    current = state.load_state().host(host.name)
    return machine.in_host(current, "/bin/sh", "-c", command, timeout=timeout)


def inventory(path, host: state.Host, spec: dict) -> str:
    data = {
        **host.ssh_data(),
        "gemmaserve_model": spec["model"],
        "gemmaserve_accelerator": spec["accelerator"],
        "rocm_repo_base": BASE,
    }
    path.write_text(f"mi300x = [({'mi300x-on-' + host.name!r}, {data!r})]\n")
    return str(path)


@pytest.fixture(scope="module")
def amd_host(request, sandbox_ready, served_assets, tmp_path_factory):
    started = time.monotonic()
    repo = build_repo(tmp_path_factory.mktemp("rocm-repo") / "repo", os.uname().release)
    [host] = bring_up_new(1, request, bind_ro=(f"{repo}:{MOUNT}",))
    up = time.monotonic() - started
    # The distribution's headers for the running kernel (Debian has none for the outer machine's kernel).
    (host.rootfs / HEADERS_LIST.lstrip("/")).write_text(
        f"deb [signed-by={MOUNT}/keyring.gpg] file:{MOUNT}/{HEADERS_DIR}/ /\n"
    )
    workdir = tmp_path_factory.mktemp("inventory")
    first = fleet.run_pyinfra(inventory(workdir / "mi300x.py", host, SPEC), DEPLOY, timeout=900)
    second = fleet.run_pyinfra(workdir / "mi300x.py", DEPLOY, timeout=600)
    more = {**SPEC, "accelerator": {"kind": "mi300x", "count": 8}}
    too_many = fleet.run_pyinfra(inventory(workdir / "mi300x_8.py", host, more), DEPLOY, timeout=600)
    print(
        f"\n[figure] rocm role on a sandbox host: host up + repository {up:.1f} s, first run {first.seconds:.1f} s, "
        f"second run {second.seconds:.1f} s, refused run {too_many.seconds:.1f} s, "
        f"total {time.monotonic() - started:.1f} s"
    )
    return host, first, second, too_many


def test_the_installer_is_the_published_file_for_the_pinned_release():
    assert installer_deb(RocmSettings().version) == INSTALLER_DEB and RocmSettings().version == RELEASE


def test_the_role_converges_and_does_not_reboot(amd_host):
    _, first, _, _ = amd_host
    assert first.ok, first.output[-4000:]
    assert first.totals()[1] > 0
    # No module can load here: the role says a reboot is needed and does not reboot (depending on when pyinfra
    # read the package fact, before or after the install, it names the install or the missing module).
    reboot = re.search(r"reboot needed \((.*?)\); set rocm_allow_reboot", first.output)
    assert reboot and reboot[1] in ("the amdgpu DKMS driver is being installed", "amdgpu is not loaded"), first.output[
        -4000:
    ]


def test_a_second_run_changes_nothing(amd_host):
    _, _, second, _ = amd_host
    assert second.ok, second.output[-4000:]
    assert second.totals()[1] == 0, second.output[-4000:]
    # Converged, the driver is installed and only its loading is missing: still no reboot.
    reboot = re.search(r"reboot needed \((.*?)\); set rocm_allow_reboot", second.output)
    assert reboot and reboot[1] == "amdgpu is not loaded", second.output[-4000:]


def test_rocm_list_names_the_release_and_amdgpu_list_its_driver_repository(amd_host):
    host, _, _, _ = amd_host
    rocm_list = sh(host, "cat /etc/apt/sources.list.d/rocm.list").stdout.splitlines()
    assert f"deb [arch=amd64 signed-by=/etc/apt/keyrings/rocm.gpg] {BASE}/rocm/apt/{RELEASE} jammy main" in rocm_list
    amdgpu_list = sh(host, "cat /etc/apt/sources.list.d/amdgpu.list").stdout
    assert f"{BASE}/amdgpu/{AMDGPU}/ubuntu jammy main" in amdgpu_list


def dpkg_versions(host) -> dict[str, str]:
    out = sh(host, "dpkg-query -W -f='${Package} ${Version} ${db:Status-Abbrev}\\n'").stdout
    return {p: v for p, v, status in (line.split(" ", 2) for line in out.splitlines()) if status.startswith("ii")}


def test_packages_are_installed_at_the_published_versions(amd_host):
    host, _, _, _ = amd_host
    installed = dpkg_versions(host)
    assert installed["amdgpu-install"] == INSTALLER_VERSION
    assert installed["rocm"] == ROCM_VERSION
    assert {name: installed.get(name) for name in ROCM_DEPENDS} == {
        name: f"{version}.{ROCM_BUILD}" for name, version in ROCM_DEPENDS.items()
    }
    assert installed["amdgpu-dkms"] == DKMS_VERSION
    assert f"linux-headers-{os.uname().release}" in installed


def test_apt_prefers_amds_repository_through_the_installers_pin(amd_host):
    """The oracle is apt: amdgpu-install's pin (release o=repo.radeon.com, 600) applies to the repository."""
    host, _, _, _ = amd_host
    policy = sh(host, "apt-cache policy rocm").stdout
    assert re.search(
        rf"^\s+600 {re.escape('file:' + MOUNT)}/rocm/apt/{RELEASE} jammy/main amd64 Packages$", policy, re.M
    ), policy


def test_opt_rocm_is_the_release_and_says_its_version(amd_host):
    host, _, _, _ = amd_host
    assert sh(host, "readlink -f /opt/rocm").stdout.strip() == PREFIX
    assert sh(host, "cat /opt/rocm/.info/version").stdout.strip() == RELEASE
    # Not on PATH: the role has to look under /opt/rocm/bin.
    assert sh(host, "command -v rocm-smi").returncode != 0
    assert "AMD Instinct MI300X" in sh(host, "/opt/rocm/bin/rocm-smi").stdout


def test_gemmaserve_is_in_render_and_video(amd_host):
    host, _, _, _ = amd_host
    assert {"render", "video"} <= set(sh(host, "id -nG gemmaserve").stdout.split())


def test_a_plan_wanting_more_gpus_than_rocm_smi_lists_stops_the_deploy(amd_host):
    _, _, _, too_many = amd_host
    assert not too_many.ok
    assert "the plan wants 8 AMD GPUs, rocm-smi lists 4" in too_many.output, too_many.output[-4000:]
