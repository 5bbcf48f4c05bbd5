"""Every stack config read in one place, validated into the same spec the pyinfra roles use."""

from __future__ import annotations

import pulumi

from gemmaserve.spec import Spec
from gemmaserve.stack import NAMESPACE, SPEC_KEYS, spec_from_config


def read_spec() -> Spec:
    """The `gemmaserve:` keys of the current stack as a validated Spec (raises SpecError before any resource)."""
    config = pulumi.Config(NAMESPACE)
    raw = {key: config.get_object(key) for key in SPEC_KEYS}
    raw["model"] = config.get("model")
    return spec_from_config({k: v for k, v in raw.items() if v is not None}, f"stack {pulumi.get_stack()}")
