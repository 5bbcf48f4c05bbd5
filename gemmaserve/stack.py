"""Pulumi stack config (Pulumi.<stack>.yaml) -> the validated spec, plus the infra-only settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from gemmaserve.spec import Spec, SpecError, parse_spec

NAMESPACE = "gemmaserve"
SPEC_KEYS = ("model", "accelerator", "workload", "engine", "serving", "secret")
# Keys only the Pulumi program reads (validated in infra/config.py).
INFRA_KEYS = ("cloud", "hfToken")


def stack_file(stack: str, project_dir: Path = Path(".")) -> Path:
    return project_dir / f"Pulumi.{stack}.yaml"


def read_stack_config(stack: str, project_dir: Path = Path(".")) -> dict[str, Any]:
    """The `gemmaserve:` keys of a stack, without the namespace."""
    path = stack_file(stack, project_dir)
    if not path.is_file():
        existing = sorted(
            p.name.removeprefix("Pulumi.").removesuffix(".yaml") for p in project_dir.glob("Pulumi.*.yaml")
        )
        raise SpecError([f"stack = {stack!r}: no {path}; allowed: {', '.join(existing) or 'none found'}"], "stack")
    document = yaml.safe_load(path.read_text()) or {}
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


def spec_from_config(config: dict[str, Any], source: str = "stack config") -> Spec:
    return parse_spec({k: v for k, v in config.items() if k in SPEC_KEYS}, source)


def load_stack_spec(stack: str, project_dir: Path = Path(".")) -> Spec:
    return spec_from_config(read_stack_config(stack, project_dir), str(stack_file(stack, project_dir)))
