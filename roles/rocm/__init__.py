"""AMD ROCm: a pinned ROCm (and amdgpu DKMS driver) for MI300X/MI325X/MI355X through amdgpu-install,
the render/video groups for the gemmaserve user, and a reboot only when the loaded amdgpu is stale."""

from __future__ import annotations

import re
import shlex
from typing import Annotated

from packaging.version import Version
from pydantic import field_validator
from pyinfra import host
from pyinfra.api import FactBase, deploy, operation
from pyinfra.facts.files import FileContents
from pyinfra.facts.server import Groups, LinuxDistribution, Users
from pyinfra.operations import server

from gemmaserve.plan import Plan
from roles._lib.apt import APT_GET, install_packages, installed_version, upstream_version
from roles._lib.distro import distro_name
from roles._lib.reboot import allow_reboot, reboot_for
from roles._lib.settings import Release, RoleSettings, matching


class Settings(RoleSettings):
    prefix = "rocm_"
    # The ROCm release vLLM 0.32.0's ROCm wheels are built on (rocm723: see gemmaserve/engines.py).
    version: Release = "7.2.3"
    # amdgpu-install's .deb name; None derives it from rocm_version (7.2.3 -> amdgpu-install_7.2.3.70203-1_all.deb,
    # the name AMD's quick-start and published install scripts fetch from repo.radeon.com/amdgpu-install/7.2.3/).
    installer_deb: (
        Annotated[
            str,
            matching(
                r"amdgpu-install_[0-9][0-9.]*-[0-9]+_all\.deb", "a name such as amdgpu-install_7.2.3.70203-1_all.deb"
            ),
        ]
        | None
    ) = None
    # Bare-metal Instinct hosts run AMD's amdgpu DKMS driver; False keeps the distribution kernel's amdgpu
    # (e.g. a VM image that ships it), so only ROCm userspace is installed and no reboot is ever needed.
    dkms: bool = True
    # None: follow gemmaserve_allow_reboot (default False).
    allow_reboot: bool | None = None
    # Where repo.radeon.com's tree is read from: AMD's server, a mirror of it, or a local copy (file:///...,
    # as the sandbox tests use). The installer is fetched from <repo_base>/amdgpu-install/<release>/ubuntu/...
    repo_base: str = "https://repo.radeon.com"

    @field_validator("repo_base")
    @classmethod
    def _repo_base_is_a_url(cls, value: str) -> str:
        if not re.fullmatch(r"(https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?|file://)(/[A-Za-z0-9._~%+-]+)*", value):
            raise ValueError(
                "must be an http(s):// or file:/// URL of repo.radeon.com's tree, without a trailing slash "
                "(e.g. https://repo.radeon.com); allowed: A-Z, a-z, 0-9 and . _ ~ % + - / : characters"
            )
        return value


SUPPORTED = {"mi300x", "mi325x", "mi355x"}
# What amdgpu-install registers: "deb [...] https://repo.radeon.com/rocm/apt/<release> <codename> main"
# (the repositories apt reads after `amdgpu-install`, e.g. "Get: https://repo.radeon.com/rocm/apt/6.4.1
# jammy InRelease" in published install logs). Its own package version never names the ROCm release
# (dpkg shows 30.30.1.0.30300100-2303411.24.04 for ROCm 7.2.1's installer, github.com/ROCm/ROCm/issues/6101),
# so the repository line is what says which release is configured.
ROCM_LIST = "/etc/apt/sources.list.d/rocm.list"
INSTALLER_URL = "{base}/amdgpu-install/{version}/ubuntu/{codename}/{deb}"
# ROCm's packages install under /opt/rocm-<release>, reached through the /opt/rocm alternative rocm-core's
# postinst registers (rocm-core.postinst at github.com/ROCm/rocm-core); nothing puts rocm-smi on PATH
# (ROCm's post-install steps: "set the PATH variable to /opt/rocm-<ver>/bin").
ROCM_SMI = "/opt/rocm/bin/rocm-smi"
# ROCm publishes Ubuntu builds; Debian 12 installs the jammy ones (ROCm's Debian instructions do the same).
CODENAMES = {("ubuntu", "22.04"): "jammy", ("ubuntu", "24.04"): "noble", ("debian", "12"): "jammy"}
# What a ROCm container needs from the host (the `docker run` of https://docs.vllm.ai/projects/recipes/en/latest/Google/Gemma4.html): the compute and render device
# nodes, and membership of the groups that own them.
CONTAINER_DEVICES = ("/dev/kfd", "/dev/dri")
DEVICE_GROUPS = ("render", "video")
SERVICE_USER = "gemmaserve"


class RocmVersion(FactBase[str | None]):
    """The installed ROCm release (/opt/rocm/.info/version), or None:

    .. code:: python

        "7.2.1-81"
    """

    def command(self) -> str:
        return "cat /opt/rocm/.info/version 2>/dev/null || true"

    def process(self, output: list[str]) -> str | None:
        return output[0].strip() if output and output[0].strip() else None


class AmdgpuModule(FactBase[str | None]):
    """The loaded amdgpu module: AMD's DKMS build reports a version, the distribution kernel's
    in-tree module reports none ("in-tree"); None when amdgpu is not loaded:

    .. code:: python

        "6.16.6"
    """

    def command(self) -> str:
        return "test -d /sys/module/amdgpu && (cat /sys/module/amdgpu/version 2>/dev/null || echo in-tree) || true"

    def process(self, output: list[str]) -> str | None:
        return output[0].strip() if output and output[0].strip() else None


class RocmSmiGpus(FactBase[int | None]):
    """GPUs `rocm-smi` lists once ROCm is installed (its concise table: one `N  [0xDEVICE : 0xREV]` row per
    GPU), or None before ROCm is there:

    .. code:: python

        8
    """

    def command(self) -> str:
        return (
            f"if [ -x {ROCM_SMI} ]; then {ROCM_SMI} 2>/dev/null; "
            "elif command -v rocm-smi >/dev/null 2>&1; then rocm-smi 2>/dev/null; fi; true"
        )

    def process(self, output: list[str]) -> int | None:
        if not any("ROCm System Management Interface" in line for line in output):
            return None
        return sum(1 for line in output if re.match(r"^\d+\s+\[0x[0-9a-f]+ : 0x[0-9a-f]+\]", line))


def installer_deb(version: str) -> str:
    """ROCm 7 names the installer with its release and a 5-digit build: 7.2.3 -> ..._7.2.3.70203-1_all.deb."""
    major, minor, patch = (Version(version).release + (0, 0))[:3]
    return f"amdgpu-install_{version}.{major}{minor:02d}{patch:02d}-1_all.deb"


def ubuntu_codename(distribution: dict) -> str:
    return distro_name(distribution, CODENAMES, "ROCm")


def configured_release(lines: list[str] | None) -> str | None:
    """The ROCm release rocm.list points apt at (<repo base>/rocm/apt/<release>), or None. Any base counts:
    AMD's installer writes repo.radeon.com even when it was fetched from a mirror."""
    for line in lines or []:
        match = re.match(r"\s*deb\s.*/rocm/apt/([0-9.]+)\s", line)
        if match:
            return match.group(1)
    return None


@operation()
def rocm_release(version: str, dkms: bool, deb: str | None = None, repo_base: str = "https://repo.radeon.com"):
    """Install amdgpu-install for the pinned ROCm release, then ROCm (and the amdgpu DKMS driver)."""
    codename = ubuntu_codename(host.get_fact(LinuxDistribution))
    deb = deb or installer_deb(version)
    changed = False
    if configured_release(host.get_fact(FileContents, path=ROCM_LIST)) != version:
        url = INSTALLER_URL.format(base=repo_base, version=version, codename=codename, deb=deb)
        local = shlex.quote(f"/tmp/{deb}")
        yield f"curl -fsSL -o {local} {shlex.quote(url)} && {APT_GET} --allow-downgrades install {local} && rm -f {local}"
        yield f"{APT_GET} update"
        changed = True
    current = host.get_fact(RocmVersion)
    on_version = current is not None and (current == version or current.startswith(f"{version}-"))
    needs_dkms = dkms and installed_version("amdgpu-dkms") is None
    if changed or not on_version or needs_dkms:
        if dkms:
            yield f"{APT_GET} install linux-headers-$(uname -r)"
        yield "amdgpu-install -y --usecase=rocm" + ("" if dkms else " --no-dkms")
        return
    host.noop(f"ROCm {current} is installed from {ROCM_LIST}")


@operation()
def device_groups(user: str = SERVICE_USER, groups: tuple[str, ...] = DEVICE_GROUPS):
    """Add the service user to the groups owning /dev/kfd and /dev/dri/renderD*, creating a group the host
    lacks: udev gives the GPU nodes to `render` (systemd's 50-udev-default.rules), but a host without udev
    (a minimal image, a container) has no such group and usermod would fail."""
    account = host.get_fact(Users).get(user)
    missing = [g for g in groups if account is None or g not in (account.get("groups") or [])]
    if not missing:
        host.noop(f"{user} is in {', '.join(groups)}")
        return
    existing = set(host.get_fact(Groups))
    for group in missing:
        if group not in existing:
            yield from server.group._inner(group=group, system=True)
    # The user may be created by the base role in this same deploy, so this runs by name, not by fact.
    yield f"usermod -aG {','.join(missing)} {user}"


def reboot_reason(loaded: str | None, dkms_installed: str | None, dkms: bool) -> str | None:
    """Why the running amdgpu is not the one this deploy installed, or None when it is."""
    if not dkms:
        return None  # the distribution kernel's amdgpu: installing ROCm userspace never needs a reboot
    if dkms_installed is None:
        return "the amdgpu DKMS driver is being installed"
    if loaded is None:
        return "amdgpu is not loaded"
    if loaded == "in-tree":
        return "the in-tree amdgpu is loaded, not the DKMS driver"
    if not upstream_version(dkms_installed).startswith(f"{loaded}."):
        return f"loaded amdgpu {loaded} differs from installed {upstream_version(dkms_installed)}"
    return None


@operation(is_idempotent=False)
def reboot_for_amdgpu(dkms: bool, allow_reboot: bool):
    """Reboot when the loaded amdgpu differs from the installed DKMS driver, if allowed."""
    reason = reboot_reason(host.get_fact(AmdgpuModule), installed_version("amdgpu-dkms"), dkms)
    yield from reboot_for(reason, allow_reboot, "rocm_allow_reboot", "the loaded amdgpu is the installed driver")


@deploy("Install ROCm", data_defaults=Settings.defaults())
def rocm(plan: Plan) -> None:
    if plan.accelerator.name not in SUPPORTED:
        raise ValueError(f"{plan.accelerator.name}: the rocm role supports {', '.join(sorted(SUPPORTED))}")
    settings = Settings.from_host(host)
    found = host.get_fact(RocmSmiGpus)
    if found is not None and found < plan.spec.accelerator.count:
        raise ValueError(f"{host.name}: the plan wants {plan.spec.accelerator.count} AMD GPUs, rocm-smi lists {found}")
    version, dkms = settings.version, settings.dkms
    install_packages("Install ROCm prerequisites", ["curl", "ca-certificates", "gnupg"])
    rocm_release(
        name=f"Install ROCm {version}" + (" with the amdgpu DKMS driver" if dkms else ""),
        version=version,
        dkms=dkms,
        deb=settings.installer_deb,
        repo_base=settings.repo_base,
    )
    device_groups(name=f"Add {SERVICE_USER} to the render and video groups")
    reboot_for_amdgpu(
        name="Reboot into the new amdgpu driver",
        dkms=dkms,
        allow_reboot=allow_reboot(settings.allow_reboot, host.data.dict()),
    )
