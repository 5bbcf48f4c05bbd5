"""Role settings: one pydantic model per role, read from host data keys that share the role's prefix.

A role's defaults live on its model (and become pyinfra `data_defaults`); deploy.py validates every
role's settings before the first operation, so a typo or a bad value stops the run with the host, the
key, the value and what is allowed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Self

from pydantic import ConfigDict, ValidationError

from gemmaserve.spec import SpecError, Strict


class RoleSettings(Strict):
    model_config = ConfigDict(extra="forbid", frozen=True)
    # Host-data keys of this role start with this, e.g. "router_" for router_stats_port.
    prefix: ClassVar[str]

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """The settings as pyinfra data_defaults: {"router_stats_port": 8404, ...}."""
        return {f"{cls.prefix}{name}": field.default for name, field in cls.model_fields.items()}

    @classmethod
    def from_data(cls, data: Mapping[str, Any], host_name: str = "host") -> Self:
        """Validate this role's keys of a host's data (unset or None keeps the default)."""
        source = f"host data of {host_name}"
        ours = {k.removeprefix(cls.prefix): v for k, v in data.items() if k.startswith(cls.prefix) and v is not None}
        try:
            return cls.model_validate(ours)
        except ValidationError as error:
            problems = []
            for e in error.errors():
                key = cls.prefix + ".".join(str(p) for p in e["loc"])
                if e["type"] == "extra_forbidden":
                    allowed = ", ".join(cls.prefix + name for name in cls.model_fields)
                    problems.append(f"{key}: unknown setting of the {cls.prefix.rstrip('_')} role; allowed: {allowed}")
                else:
                    problems.append(f"{key} = {e['input']!r}: {e['msg'].removeprefix('Value error, ')}")
            raise SpecError(problems, source) from None

    @classmethod
    def from_host(cls, host) -> Self:
        return cls.from_data(host.data.dict(), host.name)
