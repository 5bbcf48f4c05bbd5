"""Router: HAProxy on one port in front of the host's replicas (least outstanding requests), and the
admin program (files/haproxy_admin.py) that drains and re-enables replicas through HAProxy's socket."""

from __future__ import annotations

from pathlib import Path

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.operations import server, systemd

from gemmaserve.plan import Plan
from roles._lib.apt import install_packages
from roles._lib.facts import HostState
from roles._lib.managed import managed_directory, managed_file, managed_service
from roles._lib.programs import HAPROXY_ADMIN, LIB_DIR, program_source
from roles._lib.render import render
from roles._lib.settings import RoleSettings

TEMPLATES = Path(__file__).parent / "templates"
CONFIG = "/etc/haproxy/haproxy.cfg"


class Settings(RoleSettings):
    prefix = "router_"
    bind: str = "0.0.0.0"
    # HAProxy's stats page and Prometheus exporter, on loopback (the monitoring role scrapes it).
    stats_port: int = 8404
    stream_timeout: str = "1h"


def haproxy_config(serving: Plan, settings: Settings) -> str:
    return render(
        TEMPLATES / "haproxy.cfg.j2",
        bind=settings.bind,
        port=serving.router_port,
        stats_port=settings.stats_port,
        stream_timeout=settings.stream_timeout,
        replicas=serving.replicas,
    )


@deploy("Route with HAProxy", data_defaults=Settings.defaults())
def router(serving: Plan) -> None:
    settings = Settings.from_host(host)
    install_packages("Install HAProxy", ["haproxy"])
    staged_path = f"{CONFIG}.gemmaserve"
    now = HostState(host, paths=[LIB_DIR, HAPROXY_ADMIN, staged_path], units=["haproxy.service"])
    managed_directory(name="Create the gemmaserve library directory", path=LIB_DIR, current=now.path(LIB_DIR))
    managed_file(
        name="Install haproxy_admin.py",
        dest=HAPROXY_ADMIN,
        content=program_source("router", "haproxy_admin.py"),
        current=now.path(HAPROXY_ADMIN),
    )
    staged = managed_file(
        name="Render the HAProxy config",
        dest=staged_path,
        content=haproxy_config(serving, settings),
        current=now.path(staged_path),
    )
    server.shell(
        name="Validate the HAProxy config (haproxy -c) and install it",
        commands=[f"haproxy -c -q -f {staged_path} && cp {staged_path} {CONFIG}"],
        _if=staged.did_change,
    )
    systemd.service(
        name="Reload HAProxy", service="haproxy", running=True, enabled=True, reloaded=True, _if=staged.did_change
    )
    managed_service(name="Keep HAProxy running", service="haproxy.service", current=now.unit("haproxy.service"))
