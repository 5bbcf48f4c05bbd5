"""Reboots: only when a loaded kernel module is stale, and only where host data allows it."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from pyinfra import host, logger
from pyinfra.operations import server


def allow_reboot(own: bool | None, data: Mapping[str, Any]) -> bool:
    """A role's own `<role>_allow_reboot` setting when set, else the host's `gemmaserve_allow_reboot` (default False)."""
    return bool(data.get("gemmaserve_allow_reboot", False)) if own is None else own


def reboot_for(reason: str | None, allowed: bool, setting: str, converged: str) -> Iterator:
    """Inside an operation: reboot for `reason` if allowed, say why not otherwise; `converged` when None."""
    if reason is None:
        host.noop(converged)
        return
    if not allowed:
        logger.warning(f"{host.name}: reboot needed ({reason}); set {setting} or gemmaserve_allow_reboot")
        host.noop(f"reboot needed but not allowed: {reason}")
        return
    yield from server.reboot._inner(delay=30, interval=5, reboot_timeout=900)
