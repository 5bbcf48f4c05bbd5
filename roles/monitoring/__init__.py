"""Monitoring: Prometheus scraping every replica's /metrics, HAProxy's exporter and the accelerator's
telemetry (DCGM's exporter on NVIDIA, AMD's Device Metrics Exporter on Instinct, libtpu's runtime metrics on
TPU VMs), with alerts on a full KV cache, queued requests, replicas out of rotation, prefix-cache hit rates,
the routing load spread and device health."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field
from pyinfra import host
from pyinfra.api import deploy
from pyinfra.operations import server, systemd

from gemmaserve.plan import Plan
from roles._lib.apt import install_packages
from roles._lib.facts import HostState
from roles._lib.managed import driver_daemons, managed_directory, managed_file, managed_service
from roles._lib.programs import program_source
from roles._lib.render import render
from roles._lib.settings import Listen, PrometheusDuration, Release, RoleSettings
from roles.monitoring.amd import install_amd_exporter
from roles.monitoring.tpu import install_tpu_exporter
from roles.router import Settings as RouterSettings

TEMPLATES = Path(__file__).parent / "templates"
CONFIG = "/etc/prometheus/prometheus.yml"
RULES_DIR = "/etc/prometheus/rules.d"
RULES = f"{RULES_DIR}/gemmaserve.yml"
# Debian's prometheus.service runs `/usr/bin/prometheus $ARGS` with ARGS from here.
ARGS_FILE = "/etc/default/prometheus"
# DCGM 4 and its Prometheus exporter from NVIDIA's CUDA repository (the nvidia role configures it). The
# hostengine for CUDA 13 drivers (DCGM user guide, "Installation": datacenter-gpu-manager-4-cuda<major>);
# the exporter package's name is what an apt-cache listing of NVIDIA's Ubuntu 24.04 repository shows
# (not confirmed for Debian). Its unit, nvidia-dcgm-exporter.service, runs `/usr/bin/dcgm-exporter -f
# /etc/dcgm-exporter/default-counters.csv` (NVIDIA/dcgm-exporter packaging/config-files/systemd); the
# drop-in below points it at gemmaserve's fields and a loopback address (flags -f and -a, pkg/cmd/app.go).
DCGM_PACKAGES = ["datacenter-gpu-manager-4-cuda13", "datacenter-gpu-manager-exporter"]
DCGM_COUNTERS = "/etc/gemmaserve/dcgm-counters.csv"
DCGM_EXPORTER_DROPIN = "/etc/systemd/system/nvidia-dcgm-exporter.service.d/gemmaserve.conf"


class Settings(RoleSettings):
    prefix = "monitoring_"
    # Exporters' and Prometheus's addresses: loopback unless Prometheus scrapes from elsewhere.
    listen: Listen = "127.0.0.1:9090"
    # Fine enough that the 30 s queue alert sees several samples.
    scrape_interval: PrometheusDuration = "5s"
    retention: PrometheusDuration = "15d"
    # vLLM preempts (recomputes) requests when its KV cache runs full; warn before that.
    kv_cache_threshold: float = 0.85
    queue_for: PrometheusDuration = "30s"
    down_for: PrometheusDuration = "1m"
    # How long clocks may be held down by temperature before it is an alert.
    thermal_for: PrometheusDuration = "5m"
    # A replica's prefix-cache hit rate over this window below this share of its rate over the hour before (and
    # for as long) is a collapse.
    hit_rate_window: PrometheusDuration = "10m"
    hit_rate_collapse: Annotated[float, Field(gt=0, lt=1)] = 0.5
    # How long the busiest replica may hold more than the routing load bound allows before it is an alert.
    spread_for: PrometheusDuration = "5m"
    # Where dcgm-exporter listens on NVIDIA hosts (its default is :9400 on every address).
    dcgm_listen: Listen = "127.0.0.1:9400"
    # AMD's Device Metrics Exporter release (its apt repository path) and address on AMD hosts (its
    # default is port 5000 on every address).
    amd_exporter_version: Release = "1.5.1"
    amd_exporter_listen: Listen = "127.0.0.1:5000"
    # tpu-info (PyPI) behind gemmaserve's TPU exporter on TPU VMs (a release whose dependencies are pinned in
    # roles/monitoring/tpu.py TPU_INFO_REQUIREMENTS), and where that exporter listens.
    tpu_info_version: Literal["0.14.2"] = "0.14.2"
    tpu_exporter_listen: Listen = "127.0.0.1:9471"
    # HBM in use past this share of the chip's HBM is an alert (vLLM reserves most of it up front).
    tpu_hbm_threshold: Annotated[float, Field(gt=0, le=1)] = 0.97
    # How long a TPU may sit idle (duty cycle 0) while vLLM reports running requests.
    tpu_stall_for: PrometheusDuration = "5m"


def prometheus_config(
    plan: Plan,
    settings: Settings = Settings(),
    router: RouterSettings = RouterSettings(),
    host_name: str = "localhost",
    rules_glob: str = f"{RULES_DIR}/*.yml",
) -> str:
    """prometheus.yml for this host's plan: one vllm target per replica plus HAProxy's exporter."""
    return render(
        TEMPLATES / "prometheus.yml.j2",
        replicas=plan.replicas,
        host_name=host_name,
        rules_glob=rules_glob,
        scrape_interval=settings.scrape_interval,
        listen=settings.listen,
        haproxy_stats_port=router.stats_port,
        dcgm_exporter=settings.dcgm_listen if plan.accelerator.vendor == "nvidia" else None,
        amd_exporter=settings.amd_exporter_listen if plan.accelerator.vendor == "amd" else None,
        tpu_exporter=settings.tpu_exporter_listen if plan.accelerator.vendor == "google" else None,
    )


def alert_rules(plan: Plan, settings: Settings = Settings()) -> str:
    """The alert rules: KV cache past the threshold, requests waiting, a replica down or out of rotation, its
    prefix-cache hit rate collapsing, the load spread past the routing bound, and the health of this plan's
    accelerator (NVIDIA, AMD or TPU)."""
    return render(
        TEMPLATES / "gemmaserve.rules.yml.j2",
        replicas=plan.replicas,
        kv_cache_threshold=settings.kv_cache_threshold,
        queue_for=settings.queue_for,
        down_for=settings.down_for,
        thermal_for=settings.thermal_for,
        hit_rate_window=settings.hit_rate_window,
        hit_rate_collapse=settings.hit_rate_collapse,
        spread_for=settings.spread_for,
        load_bound=plan.routing.load_bound_percent / 100 if plan.routing.prefix_affinity else None,
        affinity_floor=plan.routing.affinity_floor,
        gpu_rules=plan.accelerator.vendor == "nvidia",
        amd_rules=plan.accelerator.vendor == "amd",
        tpu_rules=plan.accelerator.vendor == "google",
        tpu_hbm_threshold=settings.tpu_hbm_threshold,
        tpu_stall_for=settings.tpu_stall_for,
    )


def dcgm_exporter_dropin(settings: Settings = Settings()) -> str:
    return (
        "# Rendered by gemmaserve (roles/monitoring): gemmaserve's fields, on loopback only.\n"
        "[Service]\nExecStart=\n"
        f"ExecStart=/usr/bin/dcgm-exporter -f {DCGM_COUNTERS} -a {settings.dcgm_listen}\n"
    )


def prometheus_args(settings: Settings = Settings()) -> str:
    return (
        f'ARGS="--config.file={CONFIG} --web.listen-address={settings.listen}'
        f' --storage.tsdb.retention.time={settings.retention}"\n'
    )


@deploy("Monitor with Prometheus", data_defaults=Settings.defaults())
def monitoring(plan: Plan) -> None:
    settings, router = Settings.from_host(host), RouterSettings.from_host(host)
    # Debian's package brings promtool; recommends (node exporter, web assets) are not needed.
    install_packages("Install Prometheus", ["prometheus"])
    staged_rules_path, staged_config_path = f"{RULES}.gemmaserve", f"{CONFIG}.gemmaserve"
    now = HostState(
        host, paths=[RULES_DIR, staged_rules_path, staged_config_path, ARGS_FILE], units=["prometheus.service"]
    )
    managed_directory(name=f"Create {RULES_DIR}", path=RULES_DIR, current=now.path(RULES_DIR))
    # Staged next to the live files; `promtool` checks them before they replace the live ones.
    staged_rules = managed_file(
        name="Render the alert rules",
        dest=staged_rules_path,
        content=alert_rules(plan, settings),
        current=now.path(staged_rules_path),
    )
    staged_config = managed_file(
        name="Render the Prometheus config",
        dest=staged_config_path,
        content=prometheus_config(plan, settings, router, host.name),
        current=now.path(staged_config_path),
    )

    def staged() -> bool:
        return staged_rules.did_change() or staged_config.did_change()

    server.shell(
        name="Validate the Prometheus config and rules (promtool) and install them",
        commands=[
            f"promtool check rules {staged_rules_path} && promtool check config {staged_config_path}"
            f" && cp {staged_rules_path} {RULES} && cp {staged_config_path} {CONFIG}"
        ],
        _if=staged,
    )
    args = managed_file(
        name="Configure Prometheus's flags",
        dest=ARGS_FILE,
        content=prometheus_args(settings),
        current=now.path(ARGS_FILE),
    )
    systemd.service(
        name="Restart Prometheus for new flags",
        service="prometheus",
        running=True,
        enabled=True,
        restarted=True,
        _if=args.did_change,
    )
    systemd.service(
        name="Reload Prometheus", service="prometheus", running=True, enabled=True, reloaded=True, _if=staged
    )
    managed_service(
        name="Keep Prometheus running", service="prometheus.service", current=now.unit("prometheus.service")
    )
    if plan.accelerator.vendor == "nvidia":
        _dcgm(settings)
    elif plan.accelerator.vendor == "amd":
        _amd(settings)
    elif plan.accelerator.vendor == "google":
        install_tpu_exporter(plan.accelerator.name, settings.tpu_exporter_listen, settings.tpu_info_version)


def _amd(settings: Settings) -> None:
    """AMD's Device Metrics Exporter from its pinned apt repository; running once amdgpu is loaded."""
    from pyinfra.facts.server import LinuxDistribution

    from roles.rocm import AmdgpuModule, ubuntu_codename

    install_amd_exporter(
        version=settings.amd_exporter_version,
        codename=ubuntu_codename(host.get_fact(LinuxDistribution)),
        listen=settings.amd_exporter_listen,
        driver_loaded=host.get_fact(AmdgpuModule) is not None,
    )


def _dcgm(settings: Settings) -> None:
    """DCGM's hostengine and exporter with gemmaserve's fields; running once a driver is loaded."""
    from roles.nvidia import NvidiaKernelModule

    install_packages("Install DCGM and its Prometheus exporter", DCGM_PACKAGES)
    dropin_dir = DCGM_EXPORTER_DROPIN.rsplit("/", 1)[0]
    now = HostState(host, paths=["/etc/gemmaserve", DCGM_COUNTERS, dropin_dir, DCGM_EXPORTER_DROPIN])
    managed_directory(name="Create /etc/gemmaserve", path="/etc/gemmaserve", current=now.path("/etc/gemmaserve"))
    counters = managed_file(
        name="Install the DCGM fields gemmaserve alerts on",
        dest=DCGM_COUNTERS,
        content=program_source("monitoring", "dcgm-counters.csv"),
        current=now.path(DCGM_COUNTERS),
    )
    managed_directory(name=f"Create {dropin_dir}", path=dropin_dir, current=now.path(dropin_dir))
    dropin = managed_file(
        name="Point dcgm-exporter at gemmaserve's fields and loopback",
        dest=DCGM_EXPORTER_DROPIN,
        content=dcgm_exporter_dropin(settings),
        current=now.path(DCGM_EXPORTER_DROPIN),
    )
    systemd.daemon_reload(name="Reload systemd units", _if=dropin.did_change)
    loaded = host.get_fact(NvidiaKernelModule) is not None
    driver_daemons(("nvidia-dcgm", "nvidia-dcgm-exporter"), loaded)
    if loaded:
        systemd.service(
            name="Restart dcgm-exporter for its new fields",
            service="nvidia-dcgm-exporter",
            running=True,
            restarted=True,
            _if=lambda: counters.did_change() or dropin.did_change(),
        )
