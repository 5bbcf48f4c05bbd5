"""Router: HAProxy on one port in front of the host's replicas (least outstanding requests)."""

from __future__ import annotations

from pathlib import Path

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.operations import apt, files, server, systemd

from roles import jinja_options

from gemmaserve.plan import Plan

TEMPLATES = Path(__file__).parent / "templates"
CONFIG = "/etc/haproxy/haproxy.cfg"

DEFAULTS = {
    "router_bind": "0.0.0.0",
    "router_stats_port": 8404,
    "router_stream_timeout": "1h",
}


@deploy("Route with HAProxy", data_defaults=DEFAULTS)
def router(serving: Plan) -> None:
    apt.packages(name="Install HAProxy", packages=["haproxy"], no_recommends=True)
    address = serving.spec.serving.bind_address
    staged = files.template(
        jinja_env_kwargs=jinja_options(),
        name="Render the HAProxy config",
        src=str(TEMPLATES / "haproxy.cfg.j2"), dest=f"{CONFIG}.gemmaserve", mode="0644",
        bind=host.data.router_bind, port=serving.router_port, stats_port=host.data.router_stats_port,
        stream_timeout=host.data.router_stream_timeout, replicas=serving.replicas,
        address="127.0.0.1" if address == "0.0.0.0" else address,
    )
    server.shell(
        name="Validate the HAProxy config (haproxy -c) and install it",
        commands=[f"haproxy -c -q -f {CONFIG}.gemmaserve && cp {CONFIG}.gemmaserve {CONFIG}"],
        _if=staged.did_change,
    )
    systemd.service(name="Reload HAProxy", service="haproxy", running=True, enabled=True, reloaded=True,
                    _if=staged.did_change)
    systemd.service(name="Keep HAProxy running", service="haproxy", enabled=True, running=True)
