"""Monitoring: Prometheus scraping every replica's /metrics and HAProxy's exporter, with the seed 03 alerts."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.operations import server, systemd

from gemmaserve.plan import Plan
from roles.batch import Snapshot, packages, render

TEMPLATES = Path(__file__).parent / "templates"
CONFIG = "/etc/prometheus/prometheus.yml"
RULES_DIR = "/etc/prometheus/rules.d"
RULES = f"{RULES_DIR}/gemmaserve.yml"
# Debian's prometheus.service runs `/usr/bin/prometheus $ARGS` with ARGS from here.
ARGS_FILE = "/etc/default/prometheus"
# roles/router's default; read from its data key when set.
HAPROXY_STATS_PORT = 8404

DEFAULTS = {
    "monitoring_listen": "127.0.0.1:9090",
    # Fine enough that the 30 s queue alert sees several samples.
    "monitoring_scrape_interval": "5s",
    "monitoring_retention": "15d",
    "monitoring_kv_cache_threshold": 0.85,
    "monitoring_queue_for": "30s",
    "monitoring_down_for": "1m",
}


def _setting(settings: Mapping[str, Any], key: str) -> Any:
    value = settings.get(key)
    return DEFAULTS[key] if value is None else value


def prometheus_config(
    serving: Plan,
    settings: Mapping[str, Any] = DEFAULTS,
    host_name: str = "localhost",
    rules_glob: str = f"{RULES_DIR}/*.yml",
) -> str:
    """prometheus.yml for this host's plan: one vllm target per replica plus HAProxy's exporter."""
    address = serving.spec.serving.bind_address
    return render(
        TEMPLATES / "prometheus.yml.j2",
        replicas=serving.replicas,
        host_name=host_name,
        rules_glob=rules_glob,
        address="127.0.0.1" if address == "0.0.0.0" else address,
        scrape_interval=_setting(settings, "monitoring_scrape_interval"),
        listen=_setting(settings, "monitoring_listen"),
        haproxy_stats_port=settings.get("router_stats_port") or HAPROXY_STATS_PORT,
    )


def alert_rules(serving: Plan, settings: Mapping[str, Any] = DEFAULTS) -> str:
    """The alert rules: KV cache > 85%, requests waiting for 30 s, a replica down (seed 03)."""
    return render(
        TEMPLATES / "gemmaserve.rules.yml.j2",
        replicas=serving.replicas,
        kv_cache_threshold=_setting(settings, "monitoring_kv_cache_threshold"),
        queue_for=_setting(settings, "monitoring_queue_for"),
        down_for=_setting(settings, "monitoring_down_for"),
    )


def prometheus_args(settings: Mapping[str, Any] = DEFAULTS) -> str:
    return (
        f'ARGS="--config.file={CONFIG} --web.listen-address={_setting(settings, "monitoring_listen")}'
        f' --storage.tsdb.retention.time={_setting(settings, "monitoring_retention")}"\n'
    )


@deploy("Monitor with Prometheus", data_defaults=DEFAULTS)
def monitoring(serving: Plan) -> None:
    settings = host.data.dict()
    # Debian's package brings promtool; recommends (node exporter, web assets) are not needed.
    packages(name="Install Prometheus", packages=["prometheus"])
    now = Snapshot(
        paths=[RULES_DIR, f"{RULES}.gemmaserve", f"{CONFIG}.gemmaserve", ARGS_FILE], units=["prometheus.service"]
    )
    now.directory(name=f"Create {RULES_DIR}", path=RULES_DIR, mode="0755")
    # Staged next to the live files; `promtool` checks them before they replace the live ones.
    staged_rules = now.put(
        name="Render the alert rules", content=alert_rules(serving, settings), dest=f"{RULES}.gemmaserve"
    )
    staged_config = now.put(
        name="Render the Prometheus config",
        content=prometheus_config(serving, settings, host.name),
        dest=f"{CONFIG}.gemmaserve",
    )
    staged = lambda: staged_rules.did_change() or staged_config.did_change()  # noqa: E731
    server.shell(
        name="Validate the Prometheus config and rules (promtool) and install them",
        commands=[
            f"promtool check rules {RULES}.gemmaserve && promtool check config {CONFIG}.gemmaserve"
            f" && cp {RULES}.gemmaserve {RULES} && cp {CONFIG}.gemmaserve {CONFIG}"
        ],
        _if=staged,
    )
    args = now.put(name="Configure Prometheus's flags", content=prometheus_args(settings), dest=ARGS_FILE)
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
    now.service(name="Keep Prometheus running", service="prometheus.service", running=True, enabled=True)
