"""Router: HAProxy on one port in front of the host's replicas (least outstanding requests)."""

from __future__ import annotations

from pathlib import Path

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.operations import server, systemd

from gemmaserve.plan import Plan
from roles.batch import Snapshot, packages, render

TEMPLATES = Path(__file__).parent / "templates"
CONFIG = "/etc/haproxy/haproxy.cfg"

DEFAULTS = {
    "router_bind": "0.0.0.0",
    "router_stats_port": 8404,
    "router_stream_timeout": "1h",
}


@deploy("Route with HAProxy", data_defaults=DEFAULTS)
def router(serving: Plan) -> None:
    packages(name="Install HAProxy", packages=["haproxy"])
    address = serving.spec.serving.bind_address
    now = Snapshot(paths=[f"{CONFIG}.gemmaserve"], units=["haproxy.service"])
    staged = now.put(
        name="Render the HAProxy config",
        dest=f"{CONFIG}.gemmaserve",
        content=render(
            TEMPLATES / "haproxy.cfg.j2",
            bind=host.data.router_bind,
            port=serving.router_port,
            stats_port=host.data.router_stats_port,
            stream_timeout=host.data.router_stream_timeout,
            replicas=serving.replicas,
            address="127.0.0.1" if address == "0.0.0.0" else address,
        ),
    )
    server.shell(
        name="Validate the HAProxy config (haproxy -c) and install it",
        commands=[f"haproxy -c -q -f {CONFIG}.gemmaserve && cp {CONFIG}.gemmaserve {CONFIG}"],
        _if=staged.did_change,
    )
    systemd.service(
        name="Reload HAProxy", service="haproxy", running=True, enabled=True, reloaded=True, _if=staged.did_change
    )
    now.service(name="Keep HAProxy running", service="haproxy.service", enabled=True, running=True)
