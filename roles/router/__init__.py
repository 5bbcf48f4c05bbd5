"""Router: HAProxy on one port in front of the host's replicas (cache-affine with bounded load, or least
outstanding requests: the plan's routing section), serving TLS and only the client routes to callers with an
API key (the plan's access section; roles/access provides the key map and the certificate), and the admin
program (files/haproxy_admin.py) that drains and re-enables replicas through HAProxy's socket."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.operations import server, systemd

from gemmaserve.plan import ROUTE_KEY_HEADER, AccessPlan, FleetPlan, Plan, RoutingPlan
from roles._lib.apt import install_packages
from roles._lib.facts import HostState
from roles._lib.managed import install_programs, managed_directory, managed_file, managed_service
from roles._lib.programs import HAPROXY_ADMIN, LIB_DIR
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
    # The conversation tables' local peer, on loopback: on a reload the old HAProxy hands them to the new one.
    peers_port: int = 8405
    # HAProxy's timeout client/server came from router_stream_timeout; they now come from the spec's
    # serving.stream_timeout, the one setting the load balancer in front of HAProxy takes too.
    renamed = {
        "stream_timeout": "set serving.stream_timeout in the spec, in seconds (HAProxy and the load balancer in "
        "front of it both take it)"
    }


# The routing key's leading content (templates/haproxy-routing.cfg.j2). A completions prompt has no messages to
# cut at, so its first PROMPT_BYTES decide: prompts that share them share a cached prefix (~64 tokens), and a
# conversation's first prompt already holds them. Where nothing could be read, the raw first RAW_BYTES from
# where the content starts decide: enough to reach past a JPEG's shared header bytes in a base64 image.
PROMPT_BYTES = 256
RAW_BYTES = 1024
# A chat message's content is a string or a list of parts (OpenAI's chat API): text, or an image by URL.
_MESSAGE_PARTS = (
    "content",
    "content[0].text",
    "content[0].image_url.url",
    "content[1].text",
    "content[1].image_url.url",
)


@dataclass(frozen=True)
class ContentPart:
    """One string of a request's leading content, read with json_query into txn.<var>."""

    var: str
    path: str
    converter: str = ""
    # Read only when the first message is a system (or developer) message: then the first user message follows.
    after_system: bool = False


def content_parts() -> list[ContentPart]:
    """What the routing key holds when the client sent no hint: chat's first message (and the first user message
    after a system one), a completions prompt's leading bytes, the Responses API's instructions and first input."""
    parts = [
        ContentPart(f"route_m{index}_{n}", f"$.messages[{index}].{part}", after_system=index == 1)
        for index in (0, 1)
        for n, part in enumerate(_MESSAGE_PARTS)
    ]
    parts.append(ContentPart("route_prompt", "$.prompt", f",bytes(0,{PROMPT_BYTES})"))
    for n, path in enumerate(("instructions", "input", "input[0].content", "input[0].content[0].text")):
        parts.append(ContentPart(f"route_r{n}", f"$.{path}"))
    return parts


# Where each route's content starts, for the raw fallback when no part could be read.
RAW_FALLBACKS = (("/v1/chat/completions", "messages"), ("/v1/completions", "prompt"), ("/v1/responses", "input"))


def openai_error(message: str, type_: str, code: str | None) -> str:
    """An error body as OpenAI's API writes them, for HAProxy's `http-request return ... string '...'`."""
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}})
    if "'" in body or "\n" in body:
        raise ValueError(f"cannot quote {body!r} in haproxy.cfg")
    return body


def error_bodies(access: AccessPlan, routing: RoutingPlan) -> dict[str, str]:
    """The JSON bodies of the balancer's own 401, 404, 405, 429 and 503 answers."""
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
        "health_rate": openai_error(
            f"Too many health checks from this address: at most {access.source_health_checks_per_10s} per 10 s. "
            "Retry after 10 s.",
            "requests",
            "rate_limit_exceeded",
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
        "overloaded": openai_error(
            f"The server is overloaded: no replica could take this request within {routing.queue_seconds} s (each "
            f"runs at most {routing.replica_max_requests} at once), or none is in service. "
            f"Retry after {routing.queue_seconds} s.",
            "server_error",
            "server_overloaded",
        ),
    }


def haproxy_config(
    plan: Plan, settings: Settings, access: AccessPlan | None = None, fleet: FleetPlan | None = None
) -> str:
    """haproxy.cfg for this host's plan; `access` overrides the plan's key map and certificate paths (tests);
    `fleet` (gemmaserve.plan.plan_fleet) adds the peer listener and the ring of hosts."""
    access = access or plan.access
    return render(
        TEMPLATES / "haproxy.cfg.j2",
        bind=settings.bind,
        port=plan.router_port,
        stats_port=settings.stats_port,
        peers_port=settings.peers_port,
        stream_timeout=f"{plan.spec.serving.stream_timeout}s",
        replicas=plan.replicas,
        access=access,
        routing=plan.routing,
        content_parts=content_parts(),
        adapter_names=[adapter.name for adapter in plan.spec.serving.lora_adapters],
        raw_fallbacks=RAW_FALLBACKS,
        prompt_bytes=PROMPT_BYTES,
        raw_bytes=RAW_BYTES,
        errors=error_bodies(access, plan.routing),
        shutdown_timeout=plan.spec.serving.shutdown_timeout,
        fleet=fleet,
        route_key_header=ROUTE_KEY_HEADER,
    )


def stop_units(plan: Plan) -> dict[str, str]:
    """The units that make a stop of HAProxy graceful and put it before the replicas' at shutdown."""
    # HAProxy's soft stop is bounded by hard-stop-after; leave it time to exit.
    stop_timeout = plan.spec.serving.shutdown_timeout + 30
    return {
        DROP_IN: render(TEMPLATES / "haproxy.service.d-gemmaserve.conf.j2", stop_timeout=stop_timeout),
        f"/etc/systemd/system/{DRAIN_UNIT}": render(
            TEMPLATES / "gemmaserve-router-drain.service.j2",
            stop_timeout=stop_timeout + 30,
            replica_units=[replica.unit for replica in plan.replicas],
        ),
    }


@deploy("Route with HAProxy", data_defaults=Settings.defaults())
def router(plan: Plan, fleet: FleetPlan | None = None) -> None:
    settings = Settings.from_host(host)
    install_packages("Install HAProxy", ["haproxy"])
    staged_path = f"{CONFIG}.gemmaserve"
    units = stop_units(plan)
    now = HostState(
        host,
        paths=[LIB_DIR, HAPROXY_ADMIN, staged_path, *units, DROP_IN.rsplit("/", 1)[0]],
        units=["haproxy.service", DRAIN_UNIT],
    )
    install_programs("router", now)
    staged = managed_file(
        name="Render the HAProxy config",
        dest=staged_path,
        content=haproxy_config(plan, settings, fleet=fleet),
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
