"""Where a spec comes from: a Pulumi stack file (`gemmaserve:` keys) or pyinfra host data (`gemmaserve_*` keys)."""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from gemmaserve.spec import Spec, SpecError, parse_spec, validate_model

NAMESPACE = "gemmaserve"
# The spec's own top-level fields, as the model declares them.
SPEC_KEYS = tuple(Spec.model_fields)
# Stack keys only the Pulumi program reads (validated in infra/config.py).
INFRA_KEYS = ("cloud", "hfToken")

HOST_PREFIX = "gemmaserve_"
# Host-data keys that are not part of the spec but are read by gemmaserve's roles or inventories.
HOST_OTHER_KEYS = (
    "gemmaserve_sandbox",
    "gemmaserve_sandbox_index",
    "gemmaserve_allow_reboot",
    "gemmaserve_gpu_facts",
    "gemmaserve_storage_emulator_host",
    "gemmaserve_capacity",
    # The key file and CA a client of the host uses (validated by gemmaserve.ops.fleet, which reads them).
    "gemmaserve_client_credentials",
    # Hosts of one run with the same gemmaserve_fleet route as one, each reached by its peers at its private address
    # (fleet_membership, gemmaserve.plan.plan_fleet).
    "gemmaserve_fleet",
    "gemmaserve_private_address",
)
# Cloud resource names of a stack start with this; 20 characters leave room for suffixes everywhere
# (service account ids allow 30, "-hosts" is appended).
PREFIX_LENGTH = 20


def stack_prefix(stack: str) -> str:
    """'tpu-v6e4' -> 'gs-tpu-v6e4': lowercase, starts with a letter, at most 20 characters. A longer stack
    name keeps a hash of the whole, so two long names that share a beginning never share a prefix."""
    full = ("gs-" + re.sub(r"[^a-z0-9-]", "-", stack.lower())).rstrip("-")
    if len(full) <= PREFIX_LENGTH:
        return full
    digest = hashlib.sha256(stack.encode()).hexdigest()[:4]
    return f"{full[: PREFIX_LENGTH - 5].rstrip('-')}-{digest}"


def stack_secret_name(stack: str, secret: str) -> str:
    """The Secret Manager secret `secret.secret_manager` means in a stack: a bare NAME is created by the stack
    as PREFIX-NAME (one per stack: two stacks in a project never fight over one secret); a full
    projects/P/secrets/NAME path is somebody else's and is used as given."""
    if secret.startswith("projects/"):
        return secret
    name, sep, version = secret.partition("/versions/")
    return f"{stack_prefix(stack)}-{name}{sep}{version}"


def stack_file(stack: str, project_dir: Path = Path(".")) -> Path:
    return project_dir / f"Pulumi.{stack}.yaml"


STACK_FILE_ALLOWED = "a Pulumi stack file: a YAML mapping whose `config:` is a mapping of `namespace:key` settings"


def read_stack_document(stack: str, project_dir: Path = Path(".")) -> dict[str, Any]:
    """A stack file as a mapping, or a SpecError naming the file (a symlink is followed, as Pulumi does, and
    must lead to a stack file too)."""
    path = stack_file(stack, project_dir)
    where = f"{path} (a symlink to {os.readlink(path)})" if path.is_symlink() else str(path)
    if not path.is_file():
        existing = sorted(
            p.name.removeprefix("Pulumi.").removesuffix(".yaml")
            for p in project_dir.glob("Pulumi.*.yaml")
            if p.is_file()
        )
        raise SpecError([f"stack = {stack!r}: no {where}; allowed: {', '.join(existing) or 'none found'}"], "stack")
    try:
        document = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        why = " ".join(str(error).split())
        raise SpecError([f"{where}: cannot be read as YAML ({why}); allowed: {STACK_FILE_ALLOWED}"], "stack") from None
    document = {} if document is None else document
    if not isinstance(document, dict) or not isinstance(document.get("config") or {}, dict):
        shown = document if not isinstance(document, dict) else document.get("config")
        raise SpecError([f"{where} = {str(shown)[:80]!r}: not a stack file; allowed: {STACK_FILE_ALLOWED}"], "stack")
    return document


def read_stack_config(stack: str, project_dir: Path = Path(".")) -> dict[str, Any]:
    """The `gemmaserve:` keys of a stack, without the namespace."""
    path = stack_file(stack, project_dir)
    document = read_stack_document(stack, project_dir)
    config = document.get("config") or {}
    ours: dict[str, Any] = {}
    for key, value in config.items():
        namespace, _, name = key.partition(":")
        if namespace == NAMESPACE:
            ours[name] = value
    unknown = [k for k in ours if k not in SPEC_KEYS + INFRA_KEYS]
    if unknown:
        raise SpecError(
            [f"{NAMESPACE}:{k}: unknown config key; allowed: {', '.join(SPEC_KEYS + INFRA_KEYS)}" for k in unknown],
            str(path),
        )
    return ours


def spec_keys_of(config: Mapping[str, Any]) -> dict[str, Any]:
    """The spec part of a stack's `gemmaserve:` keys."""
    return {k: v for k, v in config.items() if k in SPEC_KEYS}


def spec_from_config(config: Mapping[str, Any], source: str = "stack config") -> Spec:
    return parse_spec(spec_keys_of(config), source)


def load_stack_spec(stack: str, project_dir: Path = Path(".")) -> Spec:
    """A stack's spec as the stack deploys it: its secrets named as the stack creates them."""
    config = stack_scoped_secrets(stack, spec_keys_of(read_stack_config(stack, project_dir)))
    return spec_from_config(config, str(stack_file(stack, project_dir)))


# Where a spec names a Secret Manager secret: ("secret",) is the HF token, the others the API keys and the
# endpoint's TLS certificate (issue 17). A stack creates each bare NAME as PREFIX-NAME (stack_secret_name).
SECRET_FIELDS = (("secret",), ("serving", "api_keys"), ("serving", "tls"))


def stack_scoped_secrets(stack: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    """The spec keys with every `secret_manager` named as the stack created it (the rest untouched)."""

    def rename(node: Any, path: tuple[str, ...]) -> Any:
        if not isinstance(node, Mapping):
            return node
        if not path:
            value = node.get("secret_manager")
            return {**node, "secret_manager": stack_secret_name(stack, value)} if isinstance(value, str) else node
        return {**node, path[0]: rename(node[path[0]], path[1:])} if path[0] in node else node

    out: Any = dict(spec)
    for path in SECRET_FIELDS:
        out = rename(out, path)
    return out


def stack_host_data(stack: str, project_dir: Path = Path(".")) -> dict[str, Any]:
    """A stack's spec as pyinfra host data (`gemmaserve_model`, ...), for inventories of its hosts; every
    secret is named as the stack created it (stack_scoped_secrets)."""
    spec = stack_scoped_secrets(stack, spec_keys_of(read_stack_config(stack, project_dir)))
    return {f"{HOST_PREFIX}{k}": v for k, v in spec.items()}


def capacity_from_host_data(data: Mapping[str, Any], host_name: str = "host"):
    """`gemmaserve_capacity` (how the host was bought: kind, provisioning) -> HostCapacity; unset: a static host."""
    from gemmaserve.records import HostCapacity

    value = data.get(f"{HOST_PREFIX}capacity")
    if value is None:
        return HostCapacity()
    return validate_model(HostCapacity, value, f"host data of {host_name}", prefix=("gemmaserve_capacity",))


def spec_from_host_data(data: Mapping[str, Any], host_name: str = "host") -> Spec:
    """Validate a host's data; SpecError names host, field, value and what is allowed."""
    ours = {key: value for key, value in data.items() if key.startswith(HOST_PREFIX)}
    unknown = sorted(k for k in ours if k.removeprefix(HOST_PREFIX) not in SPEC_KEYS and k not in HOST_OTHER_KEYS)
    problems = [
        f"{k}: unknown host data key; allowed: {', '.join(HOST_PREFIX + s for s in SPEC_KEYS)}, "
        f"{', '.join(HOST_OTHER_KEYS)}"
        for k in unknown
    ]
    if problems:
        raise SpecError(problems, f"host data of {host_name}")
    spec_data = {k.removeprefix(HOST_PREFIX): v for k, v in ours.items() if k.removeprefix(HOST_PREFIX) in SPEC_KEYS}
    return parse_spec(spec_data, f"host data of {host_name}")


def fleet_membership(data: Mapping[str, Any], host_name: str = "host") -> tuple[str | None, str | None]:
    """`gemmaserve_fleet` (None: the host routes alone) and the address its fleet's peers reach it at:
    `gemmaserve_private_address`, else its ssh_hostname (else its name) when that is an IP address."""
    fleet = data.get(f"{HOST_PREFIX}fleet")
    if fleet is not None and (not isinstance(fleet, str) or not fleet):
        raise SpecError(
            [
                f"gemmaserve_fleet = {fleet!r}: not a fleet name; allowed: a non-empty string shared by the hosts that route as one"
            ],
            f"host data of {host_name}",
        )
    address = data.get(f"{HOST_PREFIX}private_address")
    if address is None:
        candidate = str(data.get("ssh_hostname") or host_name)
        try:
            ipaddress.ip_address(candidate)
        except ValueError:
            return fleet, None
        return fleet, candidate
    if not isinstance(address, str):
        raise SpecError(
            [f"gemmaserve_private_address = {address!r}: not a string; allowed: the host's private IPv4 address"],
            f"host data of {host_name}",
        )
    return fleet, address


def fleet_from_host_data(host_name: str, hosts: list[tuple[str, Mapping[str, Any]]]):
    """The fleet `host_name` routes in (gemmaserve.plan.FleetPlan) from every host of the run as (name, host data):
    the hosts with its `gemmaserve_fleet`; None when it names none, is alone in it, or routes least-outstanding."""
    from gemmaserve.plan import plan_fleet

    by_name = dict(hosts)
    fleet, _ = fleet_membership(by_name[host_name], host_name)
    if fleet is None:
        return None
    members = []
    for name, data in hosts:
        their_fleet, address = fleet_membership(data, name)
        if their_fleet == fleet:
            members.append((name, address, spec_from_host_data(data, name)))
    return plan_fleet(host_name, members)
