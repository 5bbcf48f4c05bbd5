"""AMD Instinct telemetry: AMD's Device Metrics Exporter (github.com/ROCm/device-metrics-exporter), pinned,
on loopback, with the fields gemmaserve's AMD GPU alerts read."""

from __future__ import annotations

import json
import shlex

from pyinfra import host
from pyinfra.api import operation
from pyinfra.facts.files import File, FileContents
from pyinfra.operations import systemd

from roles._lib.apt import APT_GET, install_packages, installed_version
from roles._lib.facts import HostState
from roles._lib.managed import driver_daemons, managed_directory, managed_file

# Every vendor fact below is from github.com/ROCm/device-metrics-exporter at tag v1.5.1 (ad44c717):
# - docs/installation/deb-package.rst: the Debian package `amdgpu-exporter` comes from AMD's own apt
#   repository https://repo.radeon.com/device-metrics-exporter/apt/<release> <jammy|noble> main, signed with
#   ROCm's key (https://repo.radeon.com/rocm/rocm.gpg.key in /etc/apt/keyrings/rocm.gpg). The path names
#   the exporter release, so the repository line is the pin (as rocm.list is for ROCm). Ubuntu 22.04/24.04,
#   ROCm >= 6.2 (docs/releasenotes.md, v1.5.1 "Platform Support"); Debian 12 takes the jammy build, as the
#   rocm role does.
# - debian/usr/lib/systemd/system/amd-metrics-exporter.service: `ExecStart=/usr/local/bin/amd-metrics-exporter`
#   after gpuagent.service (the reader behind /var/run/gpuagent.sock).
# - cmd/exporter/main.go: `-amd-metrics-config` (default /etc/metrics/config.json) and `-bind` (default
#   0.0.0.0); pkg/exporter/globals/constants.go: port 5000 unless the config's ServerPort says otherwise.
# - pkg/exporter/config/config_handler.go readConfig: the config is read with Go's encoding/json, which
#   ignores unknown keys, and re-read when it changes (fsnotify in pkg/exporter/exporter.go).
AMD_EXPORTER_REPO = "https://repo.radeon.com/device-metrics-exporter/apt/{version}"
AMD_EXPORTER_LIST = "/etc/apt/sources.list.d/amd-device-metrics-exporter.list"
ROCM_KEYRING = "/etc/apt/keyrings/rocm.gpg"
ROCM_KEY_URL = "https://repo.radeon.com/rocm/rocm.gpg.key"
AMD_EXPORTER_PACKAGE = "amdgpu-exporter"
AMD_EXPORTER_CONFIG = "/etc/metrics/config.json"
AMD_EXPORTER_DROPIN = "/etc/systemd/system/amd-metrics-exporter.service.d/gemmaserve.conf"
AMD_EXPORTER_BINARY = "/usr/local/bin/amd-metrics-exporter"
AMD_SERVICES = ("gpuagent", "amd-metrics-exporter")

# The fields gemmaserve asks for (names of the GPUMetricField enum, pkg/exporter/proto/exporterconfig.proto).
# A non-empty Fields list exports only these (initFieldConfig, pkg/amdgpu/gpuagent/gpuagent_gpu_metrics.go).
# Metric names are the fields in lower case (gpu_health, gpu_ecc_uncorrect_total, ...; same file).
AMD_FIELDS = (
    # Health: the exporter's own verdict (0 once any uncorrectable ECC count passes its threshold, default
    # 0, or the GPU's latest CPER record is fatal: pkg/amdgpu/gpuagent/gpuagent_health.go).
    "GPU_HEALTH",
    "GPU_ECC_CORRECT_TOTAL",
    "GPU_ECC_UNCORRECT_TOTAL",
    "GPU_ECC_DEFERRED_TOTAL",
    "GPU_ECC_UNCORRECT_UMC",
    # XGMI (Infinity Fabric between the GPUs): its link-level ECC errors and traffic.
    "GPU_ECC_CORRECT_XGMI_WAFL",
    "GPU_ECC_UNCORRECT_XGMI_WAFL",
    "GPU_XGMI_LINK_RX",
    "GPU_XGMI_LINK_TX",
    # Last RAS event's AMD Field Identifier (labels severity, afid_index): what to look up after an alert.
    "GPU_AFID_ERRORS",
    # Throttling: share of time clocks were held down, per cause (MI3xx, docs/configuration/metricslist.md).
    "GPU_VIOLATION_SOCKET_THERMAL_RESIDENCY_PERCENTAGE",
    "GPU_VIOLATION_HBM_THERMAL_RESIDENCY_PERCENTAGE",
    "GPU_VIOLATION_VR_THERMAL_RESIDENCY_PERCENTAGE",
    "GPU_VIOLATION_PROCESSOR_HOT_RESIDENCY_PERCENTAGE",
    "GPU_VIOLATION_PPT_RESIDENCY_PERCENTAGE",
    # Load.
    "GPU_NODES_TOTAL",
    "GPU_JUNCTION_TEMPERATURE",
    "GPU_MEMORY_TEMPERATURE",
    "GPU_PACKAGE_POWER",
    "GPU_POWER_USAGE",
    "GPU_GFX_ACTIVITY",
    "GPU_UMC_ACTIVITY",
    "GPU_USED_VRAM",
    "GPU_TOTAL_VRAM",
    "GPU_CLOCK",
    "PCIE_REPLAY_COUNT",
)
# Labels beyond the mandatory ones (gpu_id, card_model, serial_number, hostname, partition labels:
# gpuMandatoryLables in gpuagent_gpu_metrics.go): the UUID ties a series to `amd-smi` / `rocm-smi` output.
AMD_LABELS = ("GPU_UUID",)


def exporter_config(port: int) -> str:
    """/etc/metrics/config.json: the port, gemmaserve's fields and the health service (polled every 30 s)."""
    config = {
        "ServerPort": port,
        "GPUConfig": {"Fields": list(AMD_FIELDS), "Labels": list(AMD_LABELS)},
        "CommonConfig": {"HealthService": {"Enable": True, "PollingRate": "30s"}},
    }
    return json.dumps(config, indent=2) + "\n"


def exporter_dropin(bind: str) -> str:
    """The package's unit, started with gemmaserve's config and bound to one address (loopback)."""
    return (
        "# Rendered by gemmaserve (roles/monitoring): gemmaserve's fields, on loopback only.\n"
        "[Service]\nExecStart=\n"
        f"ExecStart={AMD_EXPORTER_BINARY} -amd-metrics-config {AMD_EXPORTER_CONFIG} -bind {bind}\n"
    )


def exporter_source(version: str, codename: str) -> str:
    return f"deb [arch=amd64 signed-by={ROCM_KEYRING}] {AMD_EXPORTER_REPO.format(version=version)} {codename} main\n"


@operation()
def rocm_keyring():
    """ROCm's apt key where AMD's instructions put it (amdgpu-install may already have written it)."""
    if host.get_fact(File, path=ROCM_KEYRING):
        host.noop(f"{ROCM_KEYRING} is there")
        return
    yield (
        f"install -d -m 0755 /etc/apt/keyrings && curl -fsSL {ROCM_KEY_URL} | gpg --dearmor > {ROCM_KEYRING}.partial"
        f" && mv {ROCM_KEYRING}.partial {ROCM_KEYRING}"
    )


@operation()
def exporter_package(version: str, codename: str):
    """amdgpu-exporter from the pinned release's repository; upgraded in place when the pin moves."""
    source = exporter_source(version, codename)
    configured = host.get_fact(FileContents, path=AMD_EXPORTER_LIST) or []
    installed = installed_version(AMD_EXPORTER_PACKAGE)
    if configured == source.splitlines() and installed is not None:
        host.noop(f"{AMD_EXPORTER_PACKAGE} {installed} is installed from {source.split()[3]}")
        return
    yield f"printf '%s' {shlex.quote(source)} > {AMD_EXPORTER_LIST}"
    yield f"{APT_GET} update"
    yield f"{APT_GET} install --no-install-recommends {AMD_EXPORTER_PACKAGE}"


def install_amd_exporter(version: str, codename: str, listen: str, driver_loaded: bool) -> None:
    """AMD's Device Metrics Exporter at `version`, serving gemmaserve's fields on `listen`."""
    bind, _, port = listen.rpartition(":")
    install_packages("Install the exporter's prerequisites", ["curl", "ca-certificates", "gnupg"])
    dropin_dir = AMD_EXPORTER_DROPIN.rsplit("/", 1)[0]
    now = HostState(host, paths=["/etc/metrics", AMD_EXPORTER_CONFIG, dropin_dir, AMD_EXPORTER_DROPIN])
    rocm_keyring(name="Install ROCm's apt key")
    exporter_package(name=f"Install AMD's Device Metrics Exporter {version}", version=version, codename=codename)
    managed_directory(name="Create /etc/metrics", path="/etc/metrics", current=now.path("/etc/metrics"))
    # Re-read by the running exporter when it changes (no restart needed).
    managed_file(
        name="Configure the exporter's fields and port",
        dest=AMD_EXPORTER_CONFIG,
        content=exporter_config(int(port)),
        current=now.path(AMD_EXPORTER_CONFIG),
    )
    managed_directory(name=f"Create {dropin_dir}", path=dropin_dir, current=now.path(dropin_dir))
    dropin = managed_file(
        name="Bind the exporter to loopback",
        dest=AMD_EXPORTER_DROPIN,
        content=exporter_dropin(bind),
        current=now.path(AMD_EXPORTER_DROPIN),
    )
    systemd.daemon_reload(name="Reload systemd units", _if=dropin.did_change)
    # gpuagent needs the amdgpu driver; before the reboot into it the services are only enabled.
    driver_daemons(AMD_SERVICES, driver_loaded)
    if driver_loaded:
        systemd.service(
            name="Restart the exporter for its new flags",
            service="amd-metrics-exporter",
            running=True,
            restarted=True,
            _if=dropin.did_change,
        )
