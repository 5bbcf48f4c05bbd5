"""pyinfra host data (`gemmaserve_*` keys) -> the validated spec the planner reads."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gemmaserve.spec import Spec, SpecError, parse_spec
from gemmaserve.stack import SPEC_KEYS

PREFIX = "gemmaserve_"
# Host-data keys that are not part of the spec but are read by gemmaserve's roles or inventories.
OTHER_KEYS = ("gemmaserve_sandbox", "gemmaserve_sandbox_index", "gemmaserve_allow_reboot", "gemmaserve_gpu_facts")


def spec_from_host_data(data: Mapping[str, Any], host_name: str = "host") -> Spec:
    """Validate a host's data; SpecError names host, field, value and what is allowed."""
    ours = {key: value for key, value in data.items() if key.startswith(PREFIX)}
    unknown = sorted(k for k in ours if k.removeprefix(PREFIX) not in SPEC_KEYS and k not in OTHER_KEYS)
    problems = [
        f"{k}: unknown host data key; allowed: {', '.join(PREFIX + s for s in SPEC_KEYS)}, {', '.join(OTHER_KEYS)}"
        for k in unknown
    ]
    if problems:
        raise SpecError(problems, f"host data of {host_name}")
    spec_data = {k.removeprefix(PREFIX): v for k, v in ours.items() if k.removeprefix(PREFIX) in SPEC_KEYS}
    return parse_spec(spec_data, f"host data of {host_name}")
