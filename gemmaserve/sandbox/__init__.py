"""Local sandbox hosts (Debian bookworm under systemd-nspawn) for demos and role tests."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gemmaserve.sandbox.lifecycle import HostStatus, down, status, up, up_hosts

__all__ = ["HostStatus", "down", "status", "up", "up_hosts"]


def __getattr__(name: str) -> Any:
    # Lazy, so importing gemmaserve.sandbox.cli for `--help` pulls in nothing heavy.
    if name in __all__:
        from gemmaserve.sandbox import lifecycle

        return getattr(lifecycle, name)
    raise AttributeError(name)
