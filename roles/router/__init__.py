"""Router: HAProxy on one port in front of the host's replicas (least outstanding requests), serving TLS
and only the client routes to callers with an API key (the plan's access section; roles/access provides
the key map and the certificate), and the admin program (files/haproxy_admin.py) that drains and
re-enables replicas through HAProxy's socket."""

from __future__ import annotations

import json
from pathlib import Path

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.operations import server, systemd

from gemmaserve.plan import AccessPlan, Plan
from roles._lib.apt import install_packages
from roles._lib.facts import HostState
from roles._lib.managed import managed_directory, managed_file, managed_service
from roles._lib.programs import HAPROXY_ADMIN, LIB_DIR, program_source
from roles._lib.render import render
from roles._lib.settings import RoleSettings

TEMPLATES = Path(__file__).parent / "templates"
CONFIG = "/etc/haproxy/haproxy.cfg"
DROP_IN = "/etc/systemd/system/haproxy.service.d/gemmaserve.conf"
DRAIN_UNIT = "gemmaserve-router-drain.service"


class Settings(RoleSettings):
    prefix = "router_"
    bind: str = "0.0.0.0"
    # HAProxy's stats page and Prometheus exporter, on loopback (the monitoring role scrapes it).
    stats_port: int = 8404
    stream_timeout: str = "1h"


def openai_error(message: str, type_: str, code: str | None) -> str:
    """An error body as OpenAI's API writes them, for HAProxy's `http-request return ... string '...'`."""
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}})
    if "'" in body or "\n" in body:
        raise ValueError(f"cannot quote {body!r} in haproxy.cfg")
    return body


def error_bodies(access: AccessPlan) -> dict[str, str]:
    """The JSON bodies of the balancer's own 401, 404, 405 and 429 answers."""
    routes = ", ".join(f"{method} {path}" for method, path in access.routes)
    auth = "Send your API key as `Authorization: Bearer <key>`."
    return {
        "missing_key": openai_error(
            f"You did not provide an API key. {auth}", "invalid_request_error", "missing_api_key"
        ),
        "invalid_key": openai_error(f"Incorrect API key provided. {auth}", "invalid_request_error", "invalid_api_key"),
        "unknown_route": openai_error(
            f"Unknown route. This endpoint serves {routes}.", "invalid_request_error", "unknown_url"
        ),
        "get_only": openai_error(
            "Method not allowed: this route takes GET.", "invalid_request_error", "method_not_allowed"
        ),
        "post_only": openai_error(
            "Method not allowed: this route takes POST.", "invalid_request_error", "method_not_allowed"
        ),
        "health_method": openai_error(
            "Method not allowed: /health takes GET.", "invalid_request_error", "method_not_allowed"
        ),
        "concurrency": openai_error(
            f"Too many concurrent requests for this API key: at most {access.max_concurrent_requests} in flight "
            "on this host. Retry after 1 s.",
            "requests",
            "rate_limit_exceeded",
        ),
        "rate": openai_error(
            f"Rate limit reached for this API key: {access.requests_per_minute} requests per minute on this host. "
            f"Retry after {access.rate_retry_after} s.",
            "requests",
            "rate_limit_exceeded",
        ),
    }


def haproxy_config(serving: Plan, settings: Settings, access: AccessPlan | None = None) -> str:
    """haproxy.cfg for this host's plan; `access` overrides the plan's key map and certificate paths (tests)."""
    access = access or serving.access
    return render(
        TEMPLATES / "haproxy.cfg.j2",
        bind=settings.bind,
        port=serving.router_port,
        stats_port=settings.stats_port,
        stream_timeout=settings.stream_timeout,
        replicas=serving.replicas,
        access=access,
        errors=error_bodies(access),
        shutdown_timeout=serving.spec.serving.shutdown_timeout,
    )


def stop_units(serving: Plan) -> dict[str, str]:
    """The units that make a stop of HAProxy graceful and put it before the replicas' at shutdown."""
    # HAProxy's soft stop is bounded by hard-stop-after; leave it time to exit.
    stop_timeout = serving.spec.serving.shutdown_timeout + 30
    return {
        DROP_IN: render(TEMPLATES / "haproxy.service.d-gemmaserve.conf.j2", stop_timeout=stop_timeout),
        f"/etc/systemd/system/{DRAIN_UNIT}": render(
            TEMPLATES / "gemmaserve-router-drain.service.j2",
            stop_timeout=stop_timeout + 30,
            replica_units=[replica.unit for replica in serving.replicas],
        ),
    }


@deploy("Route with HAProxy", data_defaults=Settings.defaults())
def router(serving: Plan) -> None:
    settings = Settings.from_host(host)
    install_packages("Install HAProxy", ["haproxy"])
    staged_path = f"{CONFIG}.gemmaserve"
    units = stop_units(serving)
    now = HostState(
        host,
        paths=[LIB_DIR, HAPROXY_ADMIN, staged_path, *units, DROP_IN.rsplit("/", 1)[0]],
        units=["haproxy.service", DRAIN_UNIT],
    )
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
    drop_in_dir = DROP_IN.rsplit("/", 1)[0]
    managed_directory(
        name="Create haproxy.service's drop-in directory", path=drop_in_dir, current=now.path(drop_in_dir)
    )
    changed = [
        managed_file(name=f"Install {path.rsplit('/', 1)[1]}", dest=path, content=content, current=now.path(path))
        for path, content in units.items()
    ]
    # Takes effect at HAProxy's next stop: no restart needed.
    systemd.daemon_reload(
        name="Reload systemd units (graceful HAProxy stops)", _if=lambda: any(c.did_change() for c in changed)
    )
    managed_service(
        name=f"Enable {DRAIN_UNIT} (HAProxy stops before the replicas)",
        service=DRAIN_UNIT,
        current=now.unit(DRAIN_UNIT),
    )
