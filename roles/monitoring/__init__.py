"""Monitoring: Prometheus scraping every replica's /metrics and HAProxy's exporter, with the seed 03 alerts."""

from __future__ import annotations

from collections.abc import Mapping
from io import StringIO
from pathlib import Path
from typing import Any

import jinja2
from pyinfra import host
from pyinfra.api import deploy
from pyinfra.operations import apt, files, server, systemd

from gemmaserve.plan import Plan

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


def _render(template: str, **context: Any) -> str:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True)
    return env.get_template(template).render(**context)


def _setting(settings: Mapping[str, Any], key: str) -> Any:
    value = settings.get(key)
    return DEFAULTS[key] if value is None else value


def prometheus_config(serving: Plan, settings: Mapping[str, Any] = DEFAULTS, host_name: str = "localhost",
                      rules_glob: str = f"{RULES_DIR}/*.yml") -> str:
    """prometheus.yml for this host's plan: one vllm target per replica plus HAProxy's exporter."""
    address = serving.spec.serving.bind_address
    return _render(
        "prometheus.yml.j2", replicas=serving.replicas, host_name=host_name, rules_glob=rules_glob,
        address="127.0.0.1" if address == "0.0.0.0" else address,
        scrape_interval=_setting(settings, "monitoring_scrape_interval"),
        listen=_setting(settings, "monitoring_listen"),
        haproxy_stats_port=settings.get("router_stats_port") or HAPROXY_STATS_PORT,
    )


def alert_rules(serving: Plan, settings: Mapping[str, Any] = DEFAULTS) -> str:
    """The alert rules: KV cache > 85%, requests waiting for 30 s, a replica down (seed 03)."""
    return _render(
        "gemmaserve.rules.yml.j2", replicas=serving.replicas,
        kv_cache_threshold=_setting(settings, "monitoring_kv_cache_threshold"),
        queue_for=_setting(settings, "monitoring_queue_for"), down_for=_setting(settings, "monitoring_down_for"),
    )


def prometheus_args(settings: Mapping[str, Any] = DEFAULTS) -> str:
    return (f'ARGS="--config.file={CONFIG} --web.listen-address={_setting(settings, "monitoring_listen")}'
            f' --storage.tsdb.retention.time={_setting(settings, "monitoring_retention")}"\n')


@deploy("Monitor with Prometheus", data_defaults=DEFAULTS)
def monitoring(serving: Plan) -> None:
    settings = host.data.dict()
    # Debian's package brings promtool; recommends (node exporter, web assets) are not needed.
    apt.packages(name="Install Prometheus", packages=["prometheus"], no_recommends=True)
    files.directory(name=f"Create {RULES_DIR}", path=RULES_DIR, mode="0755")
    # Staged next to the live files; `promtool` checks them before they replace the live ones.
    staged_rules = files.put(
        name="Render the alert rules", src=StringIO(alert_rules(serving, settings)),
        dest=f"{RULES}.gemmaserve", mode="0644",
    )
    staged_config = files.put(
        name="Render the Prometheus config", src=StringIO(prometheus_config(serving, settings, host.name)),
        dest=f"{CONFIG}.gemmaserve", mode="0644",
    )
    staged = lambda: staged_rules.did_change() or staged_config.did_change()  # noqa: E731
    server.shell(
        name="Validate the Prometheus config and rules (promtool) and install them",
        commands=[f"promtool check rules {RULES}.gemmaserve && promtool check config {CONFIG}.gemmaserve"
                  f" && cp {RULES}.gemmaserve {RULES} && cp {CONFIG}.gemmaserve {CONFIG}"],
        _if=staged,
    )
    args = files.put(name="Configure Prometheus's flags", src=StringIO(prometheus_args(settings)),
                     dest=ARGS_FILE, mode="0644")
    systemd.service(name="Restart Prometheus for new flags", service="prometheus", running=True, enabled=True,
                    restarted=True, _if=args.did_change)
    systemd.service(name="Reload Prometheus", service="prometheus", running=True, enabled=True, reloaded=True,
                    _if=staged)
    systemd.service(name="Keep Prometheus running", service="prometheus", running=True, enabled=True)
