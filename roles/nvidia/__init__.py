"""NVIDIA driver: a pinned branch from NVIDIA's CUDA repository, persistence mode, fabric manager on
NVSwitch systems, the container toolkit in container mode, and a reboot only when the loaded module is stale."""

from __future__ import annotations

import re
from io import StringIO

from pyinfra import host
from pyinfra.api import FactBase, FileUploadCommand, deploy, operation
from pyinfra.facts.files import FileContents
from pyinfra.facts.server import LinuxDistribution
from pyinfra.operations import apt, systemd

from gemmaserve.plan import Plan
from roles._lib.apt import APT_GET, installed_version, upstream_version
from roles._lib.distro import distro_name
from roles._lib.reboot import allow_reboot, reboot_for
from roles._lib.settings import RoleSettings


class Settings(RoleSettings):
    prefix = "nvidia_"
    # The production branch vLLM's CUDA 12.9/13.0 wheels and images need (>= 575); pinned through apt.
    driver_branch: int = 580
    # None: open kernel modules (NVIDIA's default since 560, required on Blackwell). False keeps the
    # proprietary modules on pre-Blackwell GPUs only.
    driver_open: bool | None = None
    # None: follow gemmaserve_allow_reboot (default False). A reboot is the only way to load a new module.
    allow_reboot: bool | None = None


# NVIDIA's CUDA repositories: https://developer.download.nvidia.com/compute/cuda/repos/<distro>/x86_64/
CUDA_REPO = "https://developer.download.nvidia.com/compute/cuda/repos/{distro}/x86_64"
CUDA_KEYRING = "cuda-keyring_1.1-1_all.deb"
CUDA_DISTROS = {("ubuntu", "22.04"): "ubuntu2204", ("ubuntu", "24.04"): "ubuntu2404", ("debian", "12"): "debian12"}
PIN_FILE = "/etc/apt/preferences.d/gemmaserve-nvidia-driver"
# Blackwell GPUs have no proprietary kernel module at all.
OPEN_MODULES_ONLY = {"rtx-pro-6000", "b200"}
FABRIC_MANAGER = "nvidia-fabricmanager"
TOOLKIT = "nvidia-container-toolkit"
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


class NvidiaGpuCount(FactBase[int]):
    """NVIDIA GPUs on the PCI bus (3D and VGA controllers, not NVSwitch bridges), driver or not:

    .. code:: python

        8
    """

    def requires_command(self) -> str:
        return "lspci"

    def command(self) -> str:
        return "lspci -n -d 10de: | awk '$2 ~ /^030[02]:/' | wc -l"

    def process(self, output: list[str]) -> int:
        return int(output[0]) if output else 0

    @staticmethod
    def default() -> int:
        return 0


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


def cuda_distro(distribution: dict) -> str:
    """`server.LinuxDistribution` -> the CUDA repository's distro name (ubuntu2204, ubuntu2404, debian12)."""
    return distro_name(distribution, CUDA_DISTROS, "NVIDIA driver")


def driver_package(open_modules: bool) -> str:
    # NVIDIA's metapackages: nvidia-open (open modules) or cuda-drivers (proprietary), both compute + persistenced.
    return "nvidia-open" if open_modules else "cuda-drivers"


def pin_text(branch: int) -> str:
    """apt preferences holding every NVIDIA driver package on one branch (a downgrade wins at 1001)."""
    return (
        f"# gemmaserve: NVIDIA driver branch {branch} (roles/nvidia)\n"
        "Package: nvidia-* libnvidia-* cuda-drivers* libxnvctrl* xserver-xorg-video-nvidia* libnvsdm* libnvidia-nscq*\n"
        f"Pin: version /^([0-9]+:)?{branch}\\./\n"
        "Pin-Priority: 1001\n"
    )


def _on_branch(version: str | None, branch: int) -> bool:
    return version is not None and upstream_version(version).startswith(f"{branch}.")


@operation()
def driver(branch: int, open_modules: bool):
    """Install NVIDIA's CUDA repository keyring, pin the driver branch, install the driver metapackage."""
    distro = cuda_distro(host.get_fact(LinuxDistribution))
    repo = CUDA_REPO.format(distro=distro)
    refresh = False
    if installed_version("cuda-keyring") is None:
        yield (
            f"curl -fsSL -o /tmp/{CUDA_KEYRING} {repo}/{CUDA_KEYRING} && dpkg -i /tmp/{CUDA_KEYRING}"
            f" && rm -f /tmp/{CUDA_KEYRING}"
        )
        refresh = True
    wanted_pin = pin_text(branch)
    if "\n".join(host.get_fact(FileContents, path=PIN_FILE) or []) + "\n" != wanted_pin:
        yield FileUploadCommand(StringIO(wanted_pin), PIN_FILE)
        refresh = True
    package = driver_package(open_modules)
    if _on_branch(installed_version(package), branch):
        if not refresh:
            host.noop(f"{package} {branch} is installed")
        return
    yield f"{APT_GET} update"
    other = driver_package(not open_modules)
    # --allow-downgrades: a branch change down (e.g. 590 -> 580) is a downgrade apt must be allowed.
    yield (
        f"{APT_GET} --allow-downgrades install linux-headers-$(uname -r) {package}"
        + (f" {other}-" if installed_version(other) else "")
    )


@operation()
def fabric_manager(interconnect: str, gpu_count: int, open_modules: bool):
    """Install NVIDIA fabric manager at exactly the driver's version, on NVSwitch systems only."""
    if interconnect != "nvswitch" or gpu_count < 8:
        # HGX boards (8 SXM GPUs) route NVLink through NVSwitches that fabric manager must train;
        # PCIe cards and partial slices have no switches to manage.
        host.noop(f"{interconnect} x {gpu_count}: no NVSwitch fabric to manage")
        return
    package = driver_package(open_modules)
    wanted = installed_version(package)
    if wanted is not None and installed_version(FABRIC_MANAGER) == wanted:
        host.noop(f"{FABRIC_MANAGER} {wanted} matches the driver")
        return
    # The driver may be installed by this same deploy: read its version when the command runs.
    yield (f"{APT_GET} --allow-downgrades install \"{FABRIC_MANAGER}=$(dpkg-query -W -f='${{Version}}' {package})\"")


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


@deploy("Install the NVIDIA driver", data_defaults=Settings.defaults())
def nvidia(serving: Plan) -> None:
    settings = Settings.from_host(host)
    branch = settings.driver_branch
    open_modules = open_modules_for(serving.accelerator.name, settings.driver_open)
    wanted_gpus = serving.spec.accelerator.count
    found = host.get_fact(NvidiaGpuCount)
    if found < wanted_gpus:
        raise ValueError(f"{host.name}: the plan wants {wanted_gpus} NVIDIA GPUs, lspci shows {found}")
    apt.packages(name="Install DKMS prerequisites", packages=["dkms", "curl", "pciutils"], no_recommends=True)
    driver(
        name=f"Install NVIDIA driver branch {branch} ({'open' if open_modules else 'proprietary'} modules)",
        branch=branch,
        open_modules=open_modules,
    )
    fabric_manager(
        name="Install NVIDIA fabric manager (NVSwitch systems)",
        interconnect=serving.accelerator.interconnect,
        gpu_count=wanted_gpus,
        open_modules=open_modules,
    )
    container_toolkit(
        name="Install the NVIDIA container toolkit and its CDI spec (podman's GPU names)",
        engine=serving.engine.kind,
        gpu_count=wanted_gpus,
        driver_loaded=host.get_fact(NvidiaKernelModule) is not None,
    )
    reboot_for_driver(
        name="Reboot into the new NVIDIA driver",
        branch=branch,
        open_modules=open_modules,
        allow_reboot=allow_reboot(settings.allow_reboot, host.data.dict()),
    )
    # Persistence mode keeps the driver initialised between replica restarts (no multi-second re-init).
    _start_driver_services(serving)


def _start_driver_services(serving: Plan) -> None:
    services = ["nvidia-persistenced"]
    if serving.accelerator.interconnect == "nvswitch" and serving.spec.accelerator.count >= 8:
        services.append("nvidia-fabricmanager")
    # Without a loaded module (a reboot pending but not allowed) the daemons cannot start yet:
    # enable them so the next boot does.
    loaded = host.get_fact(NvidiaKernelModule) is not None
    for service in services:
        systemd.service(
            name=f"{'Run' if loaded else 'Enable'} {service}",
            service=service,
            enabled=True,
            running=True if loaded else None,
        )
