"""The gemmaserve CrossGuard rules: plain functions over (type, props) plus the Policy objects wrapping them.

Importable without the Pulumi CLI (policy/__main__.py starts the analyzer server; this module does not),
so tests call the check_* functions and the policies' validate callbacks directly.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from pulumi_policy import (
    EnforcementLevel,
    PolicyConfigSchema,
    ReportViolation,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    StackValidationArgs,
    StackValidationPolicy,
)

from gemmaserve.spec import INTERNET_SHARE, internet_share

INSTANCE = "gcp:compute/instance:Instance"
FIREWALL = "gcp:compute/firewall:Firewall"
DYNAMIC = "pulumi-python:dynamic:Resource"
STACK = "pulumi:pulumi:Stack"
SERVICE = "gcp:projects/service:Service"
# `pulumi up` holds the stack lock while a create waits: a TPU queue is watched by `gemmaserve capacity`
# instead, and create returns within this.
MAX_CREATE_WAIT_SECONDS = 3600
# GCP resources gemmaserve labels (cost attribution, cleanup); TPU queued resources carry node labels.
LABELED_TYPES = (
    INSTANCE,
    "gcp:compute/disk:Disk",
    "gcp:secretmanager/secret:Secret",
    "gcp:artifactregistry/repository:Repository",
    "gcp:compute/forwardingRule:ForwardingRule",
    "gcp:storage/bucket:Bucket",
)
DEFAULT_REQUIRED_LABELS = ("app", "managed-by", "stack")
# A Hugging Face user access token, and output keys that must never carry a plaintext secret.
HF_TOKEN = re.compile(r"\bhf_[A-Za-z0-9]{30,}\b")
SECRET_KEYS = re.compile(r"(token|secret_data|secretdata|password|api_key|apikey)$", re.IGNORECASE)


def is_queued_resource(resource_type: str, props: Mapping[str, Any]) -> bool:
    return resource_type == DYNAMIC and "queued_resource_id" in props


def check_external_ip(resource_type: str, props: Mapping[str, Any], allow: bool = False) -> list[str]:
    """Serving machines get no public IP (Private Google Access + Cloud NAT) unless explicitly allowed."""
    if allow:
        return []
    if resource_type == INSTANCE:
        for nic in props.get("networkInterfaces") or []:
            if nic.get("accessConfigs"):
                return ["has an external IP (networkInterfaces[].accessConfigs); serving hosts stay private"]
    if is_queued_resource(resource_type, props) and props.get("enable_external_ips"):
        return ["TPU queued resource requests external IPs (enable_external_ips); serving hosts stay private"]
    return []


# Protocol names and their IANA numbers as the Compute API takes them (tcp or "6", ...): the same rule.
PROTOCOL_NUMBERS = {"tcp": "6", "udp": "17", "icmp": "1", "esp": "50", "ah": "51", "sctp": "132", "ipip": "94"}


def _ports(allow: Mapping[str, Any]) -> list[tuple[int, int]] | None:
    """Port ranges a firewall allow entry opens; None means every port (no ports, or a protocol without them)."""
    ports = allow.get("ports") or []
    if not ports:
        return None
    spans = []
    for port in ports:
        low, _, high = str(port).partition("-")
        spans.append((int(low), int(high or low)))
    return spans


def _protocol(allow: Mapping[str, Any]) -> str:
    name = str(allow.get("protocol") or "").lower()
    return {number: name for name, number in PROTOCOL_NUMBERS.items()}.get(name, name)


def ingress_sources(props: Mapping[str, Any]) -> list[str]:
    """The ranges an ingress rule admits: with no source at all, the API applies it to 0.0.0.0/0
    (https://cloud.google.com/firewall/docs/firewalls#sources_for_rules)."""
    ranges = list(props.get("sourceRanges") or [])
    if not ranges and not props.get("sourceTags") and not props.get("sourceServiceAccounts"):
        return ["0.0.0.0/0"]
    return ranges


def check_world_serving_port(
    resource_type: str, props: Mapping[str, Any], public_ports: Iterable[int] = ()
) -> list[str]:
    """No ingress rule opens a port to the internet, judged by the address space its sources add up to
    (0.0.0.0/1 + 128.0.0.0/1 is the internet), for every protocol, spelled by name or number; only ports
    named in publicPorts may be."""
    if resource_type != FIREWALL or props.get("direction", "INGRESS") != "INGRESS":
        return []
    sources = ingress_sources(props)
    share = internet_share(sources)
    if share <= INTERNET_SHARE:
        return []
    world = f"{', '.join(sources)} ({share:.0%} of the internet's addresses)"
    allowed = set(public_ports)
    problems = []
    for allow in props.get("allows") or []:
        protocol, spans = _protocol(allow), _ports(allow)
        if spans is None:
            problems.append(f"allows every {protocol} port from {world}")
            continue
        opened = [
            f"{low}" if low == high else f"{low}-{high}" for low, high in spans if not (low == high and low in allowed)
        ]
        if opened:
            problems.append(
                f"opens {protocol} port {', '.join(opened)} to {world}; allowed: publicPorts in the policy config"
            )
    return problems


def check_world_port_across_rules(
    firewalls: Iterable[tuple[str, Mapping[str, Any]]], public_ports: Iterable[int] = ()
) -> list[str]:
    """The same judgement over every ingress rule of a network that reaches the same instances (same target tags and
    service accounts) for the same protocol: the internet split over several rules, each below the bound, is still
    the internet on every port they all open. `firewalls` is (name, props) of each firewall resource."""
    allowed = set(public_ports)
    groups: dict[tuple, list[tuple[str, list[str], list[tuple[int, int]] | None]]] = {}
    for name, props in firewalls:
        if props.get("direction", "INGRESS") != "INGRESS":
            continue
        reach = (
            props.get("network"),
            tuple(sorted(props.get("targetTags") or [])),
            tuple(sorted(props.get("targetServiceAccounts") or [])),
        )
        for allow in props.get("allows") or []:
            groups.setdefault((*reach, _protocol(allow)), []).append((name, ingress_sources(props), _ports(allow)))
    problems = []
    for (*_, protocol), entries in groups.items():
        if len(entries) < 2 or all(internet_share(sources) > INTERNET_SHARE for _, sources, _ in entries):
            continue  # one rule alone is judged by no-world-serving-port
        # A port's sources: every rule whose ports cover it. Checking each range's first port finds every union.
        starts = sorted({low for *_, spans in entries if spans for low, _ in spans}) or [None]
        if any(spans is None for *_, spans in entries):
            starts = [None, *starts]
        for port in starts:
            covering = [
                (name, sources)
                for name, sources, spans in entries
                if spans is None or (port is not None and any(low <= port <= high for low, high in spans))
            ]
            if port in allowed or len(covering) < 2:
                continue
            if any(internet_share(each) > INTERNET_SHARE for _, each in covering):
                continue  # already a violation of no-world-serving-port on its own
            sources = sorted({s for _, each in covering for s in each})
            if (share := internet_share(sources)) > INTERNET_SHARE:
                what = "every port" if port is None else f"port {port}"
                problems.append(
                    f"rules {', '.join(n for n, _ in covering)} together open {protocol} {what} to "
                    f"{', '.join(sources)} ({share:.0%} of the internet's addresses); allowed: publicPorts in the "
                    "policy config"
                )
    return problems


def check_flex_start_duration(resource_type: str, props: Mapping[str, Any]) -> list[str]:
    """Flex-start capacity must say when it ends (max run duration, at most 7 days)."""
    if resource_type == INSTANCE:
        scheduling = props.get("scheduling") or {}
        if scheduling.get("provisioningModel") == "FLEX_START":
            seconds = (scheduling.get("maxRunDuration") or {}).get("seconds")
            if not seconds:
                return ["FLEX_START instance without scheduling.maxRunDuration"]
            if int(seconds) > 7 * 86400:
                return [f"FLEX_START maxRunDuration {seconds} s exceeds 7 days"]
    chain = [props.get("provisioning"), *(props.get("fallback_provisioning") or [])]
    if is_queued_resource(resource_type, props) and "flex-start" in chain:
        seconds = props.get("max_run_seconds")
        if not seconds:
            return ["flex-start TPU queued resource without max_run_seconds"]
        if int(seconds) > 7 * 86400:
            return [f"flex-start max_run_seconds {seconds} exceeds 7 days"]
    return []


def check_queued_resource_protected(resource_type: str, props: Mapping[str, Any], protect: bool) -> list[str]:
    """Never destroy an active queued resource by accident: a replacement can take hours to provision."""
    if is_queued_resource(resource_type, props) and not protect:
        return ["TPU queued resource is not protected (ResourceOptions(protect=True))"]
    return []


def check_bounded_create_wait(resource_type: str, props: Mapping[str, Any]) -> list[str]:
    """A TPU queued resource's create returns within an hour: the queue is watched outside `pulumi up`."""
    if not is_queued_resource(resource_type, props):
        return []
    wait = props.get("create_wait_seconds")
    if wait is None or float(wait) > MAX_CREATE_WAIT_SECONDS:
        return [
            f"create_wait_seconds = {wait!r}: `pulumi up` would hold the stack lock while the queue waits;"
            f" allowed: at most {MAX_CREATE_WAIT_SECONDS} (gemmaserve capacity wait follows the queue)"
        ]
    return []


def check_api_kept_on_destroy(resource_type: str, props: Mapping[str, Any]) -> list[str]:
    """Enabled APIs stay on when a stack is destroyed: other stacks in the project use them too."""
    if resource_type == SERVICE and props.get("disableOnDestroy") is not False:
        return [f"{props.get('service')}: disableOnDestroy must be false; destroying this stack would break others"]
    return []


def check_labels(
    resource_type: str, props: Mapping[str, Any], required: Iterable[str] = DEFAULT_REQUIRED_LABELS
) -> list[str]:
    if resource_type not in LABELED_TYPES and not is_queued_resource(resource_type, props):
        return []
    labels = props.get("labels") or {}
    missing = [key for key in required if not labels.get(key)]
    return [f"missing labels: {', '.join(missing)}"] if missing else []


# Proxies that would serve the API in clear text; gemmaserve's load balancer is HTTPS only.
PLAINTEXT_PROXIES = (
    "gcp:compute/targetHttpProxy:TargetHttpProxy",
    "gcp:compute/regionTargetHttpProxy:RegionTargetHttpProxy",
)
PRIVATE_KEY = re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----")


def check_plaintext_proxy(resource_type: str, props: Mapping[str, Any]) -> list[str]:
    """The endpoint is served over TLS only: no HTTP target proxy (API keys would cross the network in clear)."""
    if resource_type in PLAINTEXT_PROXIES:
        return ["an HTTP target proxy serves the endpoint in clear text; use an HTTPS proxy with a certificate"]
    return []


def check_plaintext_secrets(outputs: Mapping[str, Any], path: str = "") -> list[str]:
    """Stack outputs carry no secret: no hf_... value, no PEM private key, no secret-named key with a plain string."""
    problems = []
    items = outputs.items() if isinstance(outputs, Mapping) else enumerate(outputs)
    for key, value in items:
        where = f"{path}.{key}" if path else str(key)
        if isinstance(value, (Mapping, list, tuple)):
            problems += check_plaintext_secrets(value, where)
        elif isinstance(value, str):
            if HF_TOKEN.search(value):
                problems.append(f"output {where} contains a Hugging Face token")
            elif PRIVATE_KEY.search(value):
                problems.append(f"output {where} contains a private key")
            elif SECRET_KEYS.search(str(key)) and value:
                problems.append(f"output {where} looks like a plaintext secret")
    return problems


def _report(problems: list[str], report: ReportViolation, urn: str | None = None) -> None:
    for problem in problems:
        if urn:
            report(problem, urn)
        else:
            report(problem)


# The validate callbacks: (args, report) as pulumi-policy calls them; tests call them the same way.


def validate_external_ip(args: ResourceValidationArgs, report: ReportViolation) -> None:
    allow = bool(args.get_config().get("allowExternalIp", False))
    _report(check_external_ip(args.resource_type, args.props, allow), report)


def validate_world_serving_port(args: ResourceValidationArgs, report: ReportViolation) -> None:
    ports = args.get_config().get("publicPorts", [])
    _report(check_world_serving_port(args.resource_type, args.props, ports), report)


def validate_flex_start_duration(args: ResourceValidationArgs, report: ReportViolation) -> None:
    _report(check_flex_start_duration(args.resource_type, args.props), report)


def validate_queued_resource_protected(args: ResourceValidationArgs, report: ReportViolation) -> None:
    _report(check_queued_resource_protected(args.resource_type, args.props, bool(args.opts.protect)), report)


def validate_plaintext_proxy(args: ResourceValidationArgs, report: ReportViolation) -> None:
    _report(check_plaintext_proxy(args.resource_type, args.props), report)


def validate_bounded_create_wait(args: ResourceValidationArgs, report: ReportViolation) -> None:
    _report(check_bounded_create_wait(args.resource_type, args.props), report)


def validate_api_kept_on_destroy(args: ResourceValidationArgs, report: ReportViolation) -> None:
    _report(check_api_kept_on_destroy(args.resource_type, args.props), report)


def validate_labels(args: ResourceValidationArgs, report: ReportViolation) -> None:
    required = args.get_config().get("requiredLabels", list(DEFAULT_REQUIRED_LABELS))
    _report(check_labels(args.resource_type, args.props, required), report)


def validate_world_port_across_rules(args: StackValidationArgs, report: ReportViolation) -> None:
    firewalls = [(r.name, r.props) for r in args.resources if r.resource_type == FIREWALL]
    public = (args.get_config() or {}).get("publicPorts", [])
    _report(check_world_port_across_rules(firewalls, public), report)


def validate_stack_outputs(args: StackValidationArgs, report: ReportViolation) -> None:
    # Validation sees secrets unwrapped, so this flags a token even in a secret output: hosts read the
    # token from Secret Manager, and no output needs it in any form.
    for resource in args.resources:
        if resource.resource_type == STACK:
            _report(check_plaintext_secrets(resource.props), report, resource.urn)


def _mandatory(name: str, description: str, validate, schema: PolicyConfigSchema | None = None):
    return ResourceValidationPolicy(
        name=name,
        description=description,
        validate=validate,
        enforcement_level=EnforcementLevel.MANDATORY,
        config_schema=schema,
    )


POLICIES = [
    _mandatory(
        "no-external-ip",
        "Serving machines have no external IP unless allowExternalIp is set.",
        validate_external_ip,
        PolicyConfigSchema(properties={"allowExternalIp": {"type": "boolean", "default": False}}),
    ),
    _mandatory(
        "no-world-serving-port",
        "No ingress rule opens a port to the internet (judged by the address space its sources cover) "
        "unless the port is listed in publicPorts.",
        validate_world_serving_port,
        PolicyConfigSchema(properties={"publicPorts": {"type": "array", "items": {"type": "integer"}, "default": []}}),
    ),
    _mandatory(
        "flex-start-max-run-duration",
        "Flex-start capacity declares a max run duration of at most 7 days.",
        validate_flex_start_duration,
    ),
    _mandatory(
        "tpu-queued-resource-protected",
        "TPU queued resources are protected from accidental deletion.",
        validate_queued_resource_protected,
    ),
    _mandatory(
        "tpu-create-wait-bounded",
        "A TPU queued resource's create returns within an hour instead of holding `pulumi up`.",
        validate_bounded_create_wait,
    ),
    _mandatory(
        "apis-kept-on-destroy",
        "Project APIs the stack enables are never disabled when it is destroyed.",
        validate_api_kept_on_destroy,
    ),
    _mandatory(
        "labels-present",
        "Labelable resources carry the gemmaserve labels.",
        validate_labels,
        PolicyConfigSchema(
            properties={
                "requiredLabels": {
                    "type": "array",
                    "items": {"type": "string"},
                    "default": list(DEFAULT_REQUIRED_LABELS),
                }
            }
        ),
    ),
    _mandatory(
        "no-plaintext-endpoint",
        "The endpoint is served over HTTPS only (no HTTP target proxy).",
        validate_plaintext_proxy,
    ),
    StackValidationPolicy(
        name="no-world-port-across-rules",
        description="Ingress rules reaching the same instances do not add up to a port open to the internet unless "
        "the port is listed in publicPorts.",
        validate=validate_world_port_across_rules,
        enforcement_level=EnforcementLevel.MANDATORY,
        config_schema=PolicyConfigSchema(
            properties={"publicPorts": {"type": "array", "items": {"type": "integer"}, "default": []}}
        ),
    ),
    StackValidationPolicy(
        name="no-plaintext-secret-outputs",
        description="Stack outputs never carry a token or a private key.",
        validate=validate_stack_outputs,
        enforcement_level=EnforcementLevel.MANDATORY,
    ),
]
