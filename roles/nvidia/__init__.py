"""NVIDIA driver: a driver branch held by NVIDIA's own pinning package, the kernel headers DKMS needs for
every kernel the host will boot, the modules loaded and device nodes made before any replica starts,
persistence mode, fabric manager (and the NVLink subnet manager) where NVSwitches are on the PCI bus,
the container toolkit in container mode, and a reboot only when the loaded module is stale."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Annotated

from pyinfra import host
from pyinfra.api import FactBase, deploy, operation
from pyinfra.facts.deb import DebPackages
from pyinfra.facts.files import File
from pyinfra.facts.server import KernelVersion, LinuxDistribution
from pyinfra.operations import systemd

from gemmaserve.plan import Plan
from roles._lib.apt import APT_GET, install_packages, installed_version, upstream_version
from roles._lib.distro import distro_name
from roles._lib.facts import HostState
from roles._lib.managed import driver_daemons, install_programs, managed_directory, managed_file, managed_service
from roles._lib.programs import GPU_PREFLIGHT, LIB_DIR
from roles._lib.reboot import allow_reboot, reboot_for
from roles._lib.render import render
from roles._lib.settings import RoleSettings, matching

TEMPLATES = Path(__file__).parent / "templates"


class Settings(RoleSettings):
    prefix = "nvidia_"
    # vLLM 0.32.0's PyPI wheels are CUDA 13.0 (torch 2.13.0 -> nvidia-cuda-runtime 13.0.x), and "CUDA 13
    # requires an R580 or newer driver" (docs/getting_started/installation/gpu.cuda.inc.md at v0.32.0).
    # 580 is NVIDIA's production branch; held with nvidia-driver-pinning-580.
    driver_branch: int = 580
    # None: open kernel modules (NVIDIA's default since 560, required on Blackwell). False keeps the
    # proprietary modules on pre-Blackwell GPUs only.
    driver_open: bool | None = None
    # None: follow gemmaserve_allow_reboot (default False). A reboot is the only way to load a new module.
    allow_reboot: bool | None = None
    # NVIDIA's CUDA repository for this distribution ({distro}: ubuntu2204, ubuntu2404, debian12); a mirror
    # (or the sandbox's local copy, file:///...) may stand in for it.
    repo_url: Annotated[
        str,
        matching(
            r"(https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?|file://)(/([A-Za-z0-9._~%+-]|\{distro\})+)+",
            "an http(s):// or file:/// URL of A-Z, a-z, 0-9 and . _ ~ % + - / : characters, where {distro} "
            "stands for ubuntu2204, ubuntu2404 or debian12",
        ),
    ] = "https://developer.download.nvidia.com/compute/cuda/repos/{distro}/x86_64"
    # None: install fabric manager exactly when NVSwitches are on the PCI bus; True/False force it.
    fabric_manager: bool | None = None


CUDA_KEYRING = "cuda-keyring_1.1-1_all.deb"
CUDA_DISTROS = {("ubuntu", "22.04"): "ubuntu2204", ("ubuntu", "24.04"): "ubuntu2404", ("debian", "12"): "debian12"}
# gemmaserve's own pin file from before NVIDIA published pinning packages; removed in favour of them.
OLD_PIN_FILE = "/etc/apt/preferences.d/gemmaserve-nvidia-driver"
# Blackwell GPUs have no proprietary kernel module at all.
OPEN_MODULES_ONLY = {"rtx-pro-6000", "b200"}
TOOLKIT = "nvidia-container-toolkit"
NVIDIA_VENDOR = "10de"
# PCI ids (the pci.ids database, Debian's pci.ids 0.0~2026.10.24): NVSwitch bridges of HGX A100 (1af1) and
# HGX H100/H200 (22a3), PCI class 0680 "Bridge". Fourth-generation (NVLink 5) switches of HGX B200/B300 are
# not PCI devices of the host; those boards are known by their GPUs: GB100 [B200] 2901/290a, [HGX B200]
# 2909, GB110 [B300 SXM6 AC] 3182. They need the NVLink subnet manager besides fabric manager (NVIDIA
# Fabric Manager user guide, "Systems Using Fourth Generation NVSwitches" and "What is NVLink Subnet
# Manager?": https://docs.nvidia.com/datacenter/tesla/fabric-manager-user-guide/).
NVSWITCH_DEVICE_IDS = {"1af1", "22a3"}
NVLINK5_GPU_DEVICE_IDS = {"2901", "2909", "290a", "3182"}
NVLSM = "nvlsm"
# Device files: nvidia.ko registers major 195 as "nvidia" (minors 0-254) and "nvidiactl" (255);
# nvidia-uvm.ko a dynamic major named "nvidia-uvm" (kernel-open/nvidia/nv.c and
# kernel-open/nvidia-uvm/uvm.c at tag 580.95.05 of github.com/NVIDIA/open-gpu-kernel-modules).
DEVICES_UNIT = "gemmaserve-nvidia-devices.service"
PERSISTENCED_DROPIN = "/etc/systemd/system/nvidia-persistenced.service.d/gemmaserve.conf"
UNATTENDED_UPGRADES_CONF = "/etc/apt/apt.conf.d/51gemmaserve-nvidia"
NEEDRESTART_CONF = "/etc/needrestart/conf.d/gemmaserve.conf"
# What unattended-upgrades must leave alone: a driver upgrade needs a reboot the deploy decides on, and a
# new kernel without its headers would boot without a driver (Package-Blacklist entries are Python
# regular expressions since unattended-upgrades 1.x: its README, "Unattended-Upgrade::Package-Blacklist").
DRIVER_PACKAGE_PATTERNS = (
    "nvidia-",
    "libnvidia-",
    "libcuda1",
    "libnvcuvid",
    "libnvoptix",
    "firmware-nvidia-",
    "cuda-drivers",
    "libxnvctrl",
    "xserver-xorg-video-nvidia",
    "nvlsm",
    "libnvsdm",
)
# What needrestart must never restart on its own ($nrconf{override_rc}: needrestart.conf's own example).
NO_AUTO_RESTART = ("nvidia-persistenced", "nvidia-fabricmanager", "nvidia-dcgm", "vllm@", "gemmaserve")
# Where `nvidia-ctk cdi generate` writes the GPUs podman resolves `--device nvidia.com/gpu=N` against.
CDI_SPEC = "/etc/cdi/nvidia.yaml"


class NvidiaKernelModule(FactBase[dict | None]):
    """The loaded NVIDIA kernel module, or None when none is loaded:

    .. code:: python

        {"version": "580.95.05", "open": True}
    """

    def command(self) -> str:
        return "cat /proc/driver/nvidia/version 2>/dev/null || true"

    def process(self, output: list[str]) -> dict | None:
        for line in output:
            if line.startswith("NVRM version:"):
                match = re.search(r"\s(\d+\.\d+(?:\.\d+)?)\s", line)
                if match:
                    return {"version": match.group(1), "open": "Open Kernel Module" in line}
        return None


class NvidiaPciDevices(FactBase[dict]):
    """NVIDIA devices on the PCI bus, from `lspci -nn -D` or, where pciutils is not installed yet, from
    /sys/bus/pci/devices (the same slots, classes and ids), so nothing has to be installed first:

    .. code:: python

        {"gpus": [("0000:18:00.0", "2330")], "nvswitches": [("0000:05:00.0", "22a3")]}
    """

    def command(self) -> str:
        sysfs = (
            'for d in /sys/bus/pci/devices/*; do [ "$(cat $d/vendor)" = 0x10de ] && '
            'printf "%s %s: 10de:%s\\n" "${d##*/}" "$(cut -c3-6 $d/class)" "$(cut -c3-6 $d/device)"; done; true'
        )
        return f"if command -v lspci >/dev/null 2>&1; then lspci -nn -D -d {NVIDIA_VENDOR}:; else {sysfs}; fi"

    def process(self, output: list[str]) -> dict:
        return parse_pci_devices(output)

    @staticmethod
    def default() -> dict:
        return {"gpus": [], "nvswitches": []}


def parse_pci_devices(lines: list[str]) -> dict:
    """`lspci -nn -D` lines ("0000:18:00.0 3D controller [0302]: ... [10de:2330] (rev a1)") or the sysfs
    form ("0000:18:00.0 0302: 10de:2330") -> GPUs (classes 0300/0302) and NVSwitches."""
    found: dict = {"gpus": [], "nvswitches": []}
    for line in lines:
        slot = line.split(" ", 1)[0]
        klass = re.search(r"\[([0-9a-f]{4})\]:", line) or re.match(r"^\S+\s+([0-9a-f]{4}):", line)
        ids = re.findall(rf"{NVIDIA_VENDOR}:([0-9a-f]{{4}})", line)
        if not (klass and ids):
            continue
        device = ids[0]
        if klass.group(1) in ("0300", "0302"):
            found["gpus"].append((slot, device))
        elif klass.group(1) == "0680" or device in NVSWITCH_DEVICE_IDS:
            found["nvswitches"].append((slot, device))
    return found


class NvidiaCdiDevices(FactBase[list[str]]):
    """The GPUs the host's CDI specs name, as `nvidia-ctk cdi list` prints them (what podman resolves
    `--device nvidia.com/gpu=N` against):

    .. code:: python

        ["nvidia.com/gpu=0", "nvidia.com/gpu=1", "nvidia.com/gpu=all"]
    """

    def command(self) -> str:
        return "nvidia-ctk cdi list 2>/dev/null || true"

    def process(self, output: list[str]) -> list[str]:
        return [line.strip() for line in output if line.strip().startswith("nvidia.com/gpu=")]

    @staticmethod
    def default() -> list[str]:
        return []


class NvidiaTopology(FactBase[str | None]):
    """`nvidia-smi topo -m` while a driver is loaded (gemmaserve.topology parses it), else None."""

    def command(self) -> str:
        return "test -e /proc/driver/nvidia/version && nvidia-smi topo -m 2>/dev/null || true"

    def process(self, output: list[str]) -> str | None:
        text = "\n".join(output)
        return text if "GPU0" in text else None


def cuda_distro(distribution: dict) -> str:
    """`server.LinuxDistribution` -> the CUDA repository's distro name (ubuntu2204, ubuntu2404, debian12)."""
    return distro_name(distribution, CUDA_DISTROS, "NVIDIA driver")


def driver_package(open_modules: bool) -> str:
    # NVIDIA's metapackages on Debian and Ubuntu: nvidia-open (open modules) or cuda-drivers (proprietary).
    return "nvidia-open" if open_modules else "cuda-drivers"


def pinning_package(branch: int) -> str:
    """NVIDIA's branch lock for apt (driver installation guide, "Version locking", APT): it pins every driver
    package (libcuda1, firmware, GL/EGL libraries included) to the branch, which gemmaserve's own pattern
    could not; without it `cuda-drivers-580` depends on `nvidia-driver (>= 580.65.06)` and pulls 590
    (forums.developer.nvidia.com/t/353805). Install it before the driver (the guide's own advice)."""
    return f"nvidia-driver-pinning-{branch}"


def fabric_manager_package(branch: int) -> str:
    """From branch 580 the package is `nvidia-fabricmanager` (the branch moved into its version); below it,
    `nvidia-fabricmanager-<branch>` (github.com/Azure/azhpc-images components/install_nvidia_fabric_manager.sh,
    and NVIDIA/apt-packaging-fabric-manager's control template for the older names)."""
    return "nvidia-fabricmanager" if branch >= 580 else f"nvidia-fabricmanager-{branch}"


def kernel_header_packages(kernel: str, packages: dict) -> list[str]:
    """Headers for the running kernel and for every kernel metapackage installed (linux-image-amd64,
    linux-image-cloud-amd64, linux-image-generic, linux-image-gcp, ...), so a kernel upgrade brings its
    headers and DKMS builds the driver for it before the next boot."""
    wanted = [f"linux-headers-{kernel}"]
    for name in sorted(packages):
        flavour = name.removeprefix("linux-image-")
        if name.startswith("linux-image-") and flavour and not flavour[0].isdigit() and "unsigned" not in flavour:
            wanted.append(f"linux-headers-{flavour}")
    return wanted


def _on_branch(version: str | None, branch: int) -> bool:
    return version is not None and upstream_version(version).startswith(f"{branch}.")


@operation()
def driver(branch: int, open_modules: bool, repo: str, headers: list[str]):
    """NVIDIA's repository keyring, the branch's pinning package, then the driver metapackage and headers."""
    refresh = False
    if installed_version("cuda-keyring") is None:
        yield (
            f"curl -fsSL -o /tmp/{CUDA_KEYRING} {shlex.quote(f'{repo}/{CUDA_KEYRING}')} && dpkg -i /tmp/{CUDA_KEYRING}"
            f" && rm -f /tmp/{CUDA_KEYRING}"
        )
        refresh = True
    if host.get_fact(File, path=OLD_PIN_FILE):
        yield f"rm -f {OLD_PIN_FILE}"
        refresh = True
    pinning = pinning_package(branch)
    package = driver_package(open_modules)
    missing_headers = [h for h in headers if installed_version(h) is None]
    pinned = installed_version(pinning) is not None
    if pinned and _on_branch(installed_version(package), branch) and not missing_headers and not refresh:
        host.noop(f"{package} {branch} is installed, held by {pinning}; kernel headers present")
        return
    yield f"{APT_GET} update"
    if not pinned:
        # Its own transaction, so apt resolves the driver with the pin in place. It Conflicts/Provides
        # nvidia-driver-pinning, so another branch's pin is replaced.
        yield f"{APT_GET} --allow-downgrades install {pinning}"
    other = driver_package(not open_modules)
    # --allow-downgrades: a branch change down (e.g. 590 -> 580) is a downgrade apt must be allowed.
    yield (
        f"{APT_GET} --allow-downgrades install {' '.join(headers)} {package}"
        + (f" {other}-" if installed_version(other) else "")
    )


@operation()
def fabric_manager(install: bool, nvlink5: bool, branch: int, open_modules: bool):
    """Fabric manager at exactly the driver's upstream version (and NVLSM on NVLink 5), NVSwitch hosts only."""
    if not install:
        host.noop("no NVSwitch on the PCI bus: no fabric to manage")
        return
    package = fabric_manager_package(branch)
    driver_version = installed_version(driver_package(open_modules))
    fm_version = installed_version(package)
    same = driver_version and fm_version and upstream_version(fm_version) == upstream_version(driver_version)
    need_nvlsm = nvlink5 and installed_version(NVLSM) is None
    if same and not need_nvlsm:
        host.noop(f"{package} {fm_version} matches the driver {driver_version}")
        return
    # Debian revisions of the two packages may differ (580.126.20-1 vs -0ubuntu1): match the upstream
    # version with apt's version glob, read when the command runs (the driver may be installed just before).
    query = f"dpkg-query -W -f='${{Version}}' {driver_package(open_modules)} | sed 's/^[0-9]*://; s/-[^-]*$//'"
    extra = f" {NVLSM}" if nvlink5 else ""
    yield f'{APT_GET} --allow-downgrades install "{package}=$({query})-*"{extra}'


@operation()
def container_toolkit(engine: str, gpu_count: int, driver_loaded: bool):
    """In container mode: the NVIDIA container toolkit and a CDI spec naming every GPU, so podman gives
    each replica exactly its own (`--device nvidia.com/gpu=N`), numbered from 0 inside the container
    (https://docs.nvidia.com/datacenter/cloud-native/container-toolkit/latest/cdi-support.html)."""
    if engine != "container":
        host.noop(f"{engine} engine: no container runtime needed")
        return
    if installed_version(TOOLKIT) is None:
        # The CUDA repository carries the toolkit too (no second apt source).
        yield f"{APT_GET} install {TOOLKIT}"
    listed = host.get_fact(NvidiaCdiDevices)
    if all(f"nvidia.com/gpu={i}" in listed for i in range(gpu_count)):
        host.noop(f"{CDI_SPEC} names all {gpu_count} GPUs")
        return
    if not driver_loaded:
        # nvidia-ctk reads the GPUs and driver libraries from the loaded driver: after the reboot.
        host.noop("the CDI spec is generated once the driver is loaded (next deploy, after the reboot)")
        return
    yield f"nvidia-ctk cdi generate --output={CDI_SPEC}"


def reboot_reason(loaded: dict | None, installed: str | None, branch: int, open_modules: bool) -> str | None:
    """Why the running kernel module is not the one this deploy wants, or None when it is."""
    if installed is None:
        return "the driver is being installed"
    if loaded is None:
        return "no NVIDIA kernel module is loaded"
    if not loaded["version"].startswith(f"{branch}."):
        return f"loaded module {loaded['version']} is not on branch {branch}"
    if upstream_version(installed) != loaded["version"]:
        return f"loaded module {loaded['version']} differs from installed {upstream_version(installed)}"
    if loaded["open"] != open_modules:
        return f"loaded module is {'open' if loaded['open'] else 'proprietary'}, wanted the other flavour"
    return None


@operation(is_idempotent=False)
def reboot_for_driver(branch: int, open_modules: bool, allow_reboot: bool):
    """Reboot when the loaded module is missing or differs from the installed driver, if allowed."""
    reason = reboot_reason(
        host.get_fact(NvidiaKernelModule), installed_version(driver_package(open_modules)), branch, open_modules
    )
    yield from reboot_for(
        reason, allow_reboot, "nvidia_allow_reboot", "the loaded NVIDIA module is the installed driver"
    )


def open_modules_for(accelerator: str, wanted: bool | None) -> bool:
    if wanted is False and accelerator in OPEN_MODULES_ONLY:
        raise ValueError(f"nvidia_driver_open: false is impossible on {accelerator} (Blackwell has open modules only)")
    return True if wanted is None else bool(wanted)


def devices_unit(gpu_count: int) -> str:
    return render(TEMPLATES / f"{DEVICES_UNIT}.j2", minors=list(range(gpu_count)))


def unattended_upgrades_conf() -> str:
    return render(TEMPLATES / "51gemmaserve-nvidia.j2", patterns=DRIVER_PACKAGE_PATTERNS)


def needrestart_conf() -> str:
    return render(TEMPLATES / "needrestart-gemmaserve.conf.j2", units=NO_AUTO_RESTART)


def persistenced_dropin() -> str:
    return render(TEMPLATES / "nvidia-persistenced.conf.j2")


@deploy("Install the NVIDIA driver", data_defaults=Settings.defaults())
def nvidia(plan: Plan) -> None:
    settings = Settings.from_host(host)
    branch = settings.driver_branch
    open_modules = open_modules_for(plan.accelerator.name, settings.driver_open)
    wanted_gpus = plan.spec.accelerator.count
    pci = host.get_fact(NvidiaPciDevices)
    found = len(pci["gpus"])
    if found < wanted_gpus:
        raise ValueError(f"{host.name}: the plan wants {wanted_gpus} NVIDIA GPUs, the PCI bus shows {found}")
    nvlink5 = any(device in NVLINK5_GPU_DEVICE_IDS for _, device in pci["gpus"])
    with_fabric = settings.fabric_manager if settings.fabric_manager is not None else bool(pci["nvswitches"]) or nvlink5
    # Package lists are refreshed first unless apt updated them in the last hour (a fresh image has none).
    install_packages("Install DKMS prerequisites", ["dkms", "curl", "pciutils"])
    repo = settings.repo_url.format(distro=cuda_distro(host.get_fact(LinuxDistribution)))
    headers = kernel_header_packages(host.get_fact(KernelVersion), host.get_fact(DebPackages))
    driver(
        name=f"Install NVIDIA driver branch {branch} ({'open' if open_modules else 'proprietary'} modules)",
        branch=branch,
        open_modules=open_modules,
        repo=repo,
        headers=headers,
    )
    fabric_manager(
        name="Install NVIDIA fabric manager (NVSwitches on the PCI bus)",
        install=with_fabric,
        nvlink5=nvlink5,
        branch=branch,
        open_modules=open_modules,
    )
    container_toolkit(
        name="Install the NVIDIA container toolkit and its CDI spec (podman's GPU names)",
        engine=plan.engine.kind,
        gpu_count=wanted_gpus,
        driver_loaded=host.get_fact(NvidiaKernelModule) is not None,
    )
    _host_files(found)
    reboot_for_driver(
        name="Reboot into the new NVIDIA driver",
        branch=branch,
        open_modules=open_modules,
        allow_reboot=allow_reboot(settings.allow_reboot, host.data.dict()),
    )
    _start_driver_services(with_fabric)


def _host_files(gpu_count: int) -> None:
    """Units, drop-ins and apt/needrestart settings the driver stack needs, and the replicas' preflight."""
    dropin_dir = str(Path(PERSISTENCED_DROPIN).parent)
    paths = [
        f"/etc/systemd/system/{DEVICES_UNIT}",
        dropin_dir,
        PERSISTENCED_DROPIN,
        UNATTENDED_UPGRADES_CONF,
        "/etc/needrestart/conf.d",
        NEEDRESTART_CONF,
        LIB_DIR,
        GPU_PREFLIGHT,
    ]
    now = HostState(host, paths=paths, units=[DEVICES_UNIT])
    unit = managed_file(
        name=f"Install {DEVICES_UNIT} (modules and device nodes before any replica)",
        dest=paths[0],
        content=devices_unit(gpu_count),
        current=now.path(paths[0]),
    )
    managed_directory(
        name="Create the nvidia-persistenced drop-in directory", path=dropin_dir, current=now.path(dropin_dir)
    )
    dropin = managed_file(
        name="Turn persistence mode on (nvidia-persistenced drop-in)",
        dest=PERSISTENCED_DROPIN,
        content=persistenced_dropin(),
        current=now.path(PERSISTENCED_DROPIN),
    )
    systemd.daemon_reload(name="Reload systemd units", _if=lambda: unit.did_change() or dropin.did_change())
    managed_service(name=f"Enable {DEVICES_UNIT}", service=DEVICES_UNIT, current=now.unit(DEVICES_UNIT), running=None)
    managed_file(
        name="Keep unattended-upgrades off the driver stack",
        dest=UNATTENDED_UPGRADES_CONF,
        content=unattended_upgrades_conf(),
        current=now.path(UNATTENDED_UPGRADES_CONF),
    )
    managed_directory(name="Create /etc/needrestart/conf.d", path=paths[4], current=now.path(paths[4]))
    managed_file(
        name="Keep needrestart from restarting the driver daemons and replicas",
        dest=NEEDRESTART_CONF,
        content=needrestart_conf(),
        current=now.path(NEEDRESTART_CONF),
    )
    install_programs("nvidia", now)


def _start_driver_services(with_fabric: bool) -> None:
    services = ["nvidia-persistenced"] + (["nvidia-fabricmanager"] if with_fabric else [])
    # Without a loaded module (a reboot pending but not allowed) the daemons cannot start yet:
    # enable them so the next boot does.
    driver_daemons(services, host.get_fact(NvidiaKernelModule) is not None)
