"""Role settings: one pydantic model per role, read from host data keys that share the role's prefix.

A role's defaults live on its model (and become pyinfra `data_defaults`); deploy.py validates every
role's settings before the first operation, so a typo or a bad value stops the run with the host, the
key, the value and what is allowed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Self

from pydantic import ConfigDict, ValidationError, field_validator

from gemmaserve.spec import HostPath as HostPath  # a path on the host: the spec's type for every path field
from gemmaserve.spec import SpecError, Strict, matching

# Typed values for settings. Each lands somewhere a stray character changes the meaning (a root shell
# command, a systemd unit line, an apt source, a config file), so each is pattern-checked whole.

# A file on the machine running pyinfra, uploaded with files.put (never put in a shell): any path without
# control characters.
LocalFile = Annotated[
    str, matching(r"[^\x00-\x1f\x7f]{1,4096}", "a file on this machine (no newlines or other control characters)")
]
# A release number; it lands in apt repository paths, file names and pip requirements.
Release = Annotated[str, matching(r"[0-9]+(\.[0-9]+){1,3}", "a release number such as 1.5.1")]
# An IPv4 address and a port.
Listen = Annotated[
    str,
    matching(r"[0-9]{1,3}(\.[0-9]{1,3}){3}:[0-9]{1,5}", "an IPv4 address and a port such as 127.0.0.1:9090"),
]
# Prometheus's duration syntax (https://prometheus.io/docs/prometheus/latest/configuration/configuration/#duration).
PrometheusDuration = Annotated[
    str, matching(r"([0-9]+(ms|s|m|h|d|w|y))+", "a Prometheus duration such as 30s, 5m, 1h30m or 15d")
]
# systemd's time span syntax, without spaces (systemd.time(7), "PARSING TIME SPANS").
SystemdTimespan = Annotated[
    str,
    matching(
        r"([0-9]+(usec|us|msec|ms|seconds|second|sec|s|minutes|minute|min|m|hours|hour|hr|h|days|day|d|weeks|week|w"
        r"|months|month|M|years|year|y))+",
        "a systemd time span such as 30min, 1h or 1h30min",
    ),
]
# Debian package names (Debian Policy 5.6.1: lowercase letters, digits, '+', '-', '.', starting alphanumeric).
DebianPackage = Annotated[
    str, matching(r"[a-z0-9][a-z0-9+.-]+", "a Debian package name (a-z, 0-9, '+', '-', '.'; Debian Policy 5.6.1)")
]
Sha256 = Annotated[str, matching(r"[0-9a-f]{64}", "64 lowercase hex digits (a SHA-256)")]
# An http(s) URL (optionally with a port) or a file:/// URL, of characters that need no quoting anywhere.
_URL = r"(https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?|file://)(/[A-Za-z0-9._~%+-]+)*"
Url = Annotated[str, matching(_URL, "an http(s):// or file:/// URL of A-Z, a-z, 0-9 and . _ ~ % + - / : characters")]
# gs://BUCKET[/PREFIX] (https://cloud.google.com/storage/docs/buckets#naming, no dotted names).
GcsUri = Annotated[
    str,
    matching(r"gs://[a-z0-9][a-z0-9_-]{1,61}[a-z0-9](/[A-Za-z0-9._-]+)*/?", "gs://BUCKET or gs://BUCKET/PREFIX"),
]
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class RoleSettings(Strict):
    model_config = ConfigDict(extra="forbid", frozen=True)
    # Host-data keys of this role start with this, e.g. "router_" for router_stats_port.
    prefix: ClassVar[str]
    # Settings since renamed: old name (without the prefix) -> what to write now. Host data is user input: an
    # old key is refused naming its replacement, never ignored or read in its old unit.
    renamed: ClassVar[Mapping[str, str]] = {}
    # Keys under a prefix the role had before it was renamed, whole: old key -> what to write now. Refused
    # like `renamed`; nothing else reads them.
    former_keys: ClassVar[Mapping[str, str]] = {}

    @field_validator("*")
    @classmethod
    def _no_control_characters(cls, value: Any) -> Any:
        """Whatever a role's own type allows, no setting holds a newline or another control character: each
        ends up in a line of a unit, a config file or a command."""
        for each in value if isinstance(value, tuple) else (value,):
            if isinstance(each, str) and _CONTROL.search(each):
                raise ValueError("allowed: no newlines or other control characters")
        return value

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """The settings as pyinfra data_defaults: {"router_stats_port": 8404, ...}."""
        return {f"{cls.prefix}{name}": field.default for name, field in cls.model_fields.items()}

    @classmethod
    def from_data(cls, data: Mapping[str, Any], host_name: str = "host") -> Self:
        """Validate this role's keys of a host's data (unset or None keeps the default)."""
        source = f"host data of {host_name}"
        ours = {k.removeprefix(cls.prefix): v for k, v in data.items() if k.startswith(cls.prefix) and v is not None}
        problems = [f"{key}: renamed; {then}" for key, then in cls.former_keys.items() if data.get(key) is not None]
        try:
            settings = cls.model_validate(ours)
        except ValidationError as error:
            for e in error.errors():
                key = cls.prefix + ".".join(str(p) for p in e["loc"])
                if e["type"] == "extra_forbidden" and key.removeprefix(cls.prefix) in cls.renamed:
                    problems.append(f"{key}: renamed; {cls.renamed[key.removeprefix(cls.prefix)]}")
                elif e["type"] == "extra_forbidden":
                    allowed = ", ".join(cls.prefix + name for name in cls.model_fields)
                    problems.append(f"{key}: unknown setting of the {cls.prefix.rstrip('_')} role; allowed: {allowed}")
                else:
                    problems.append(f"{key} = {e['input']!r}: {e['msg'].removeprefix('Value error, ')}")
            raise SpecError(problems, source) from None
        if problems:
            raise SpecError(problems, source)
        return settings

    @classmethod
    def from_host(cls, host) -> Self:
        return cls.from_data(host.data.dict(), host.name)
