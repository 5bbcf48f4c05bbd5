"""Managed files, directories and units as pyinfra operations that decide from batched facts (facts.py).

Each operation compares the state its role read in one command with what the plan wants: converged,
it calls `host.noop(...)` (shown by `pyinfra --dry -v` and `-v`); otherwise it yields pyinfra's own
operation (`files.put`, `files.directory`, `systemd.service`), which checks again with its own facts.
Every decision is an operation in pyinfra's output; a second run yields nothing.
"""

from __future__ import annotations

import base64
import hashlib
import posixpath
from io import StringIO
from pathlib import Path

from pyinfra import host
from pyinfra.api import QuoteString, StringCommand, operation
from pyinfra.operations import files, systemd

from roles._lib.facts import PathState, UnitState


def _owned(current: PathState, kind: str, user: str, group: str, mode: str) -> bool:
    return (current.kind, current.user, current.group, current.mode) == (kind, user, group, int(mode, 8))


def content_bytes(content: str | bytes | Path) -> bytes:
    data = content.read_bytes() if isinstance(content, Path) else content
    return data.encode() if isinstance(data, str) else data


def same_content(current: PathState, content: str | bytes | Path) -> bool:
    return current.kind == "file" and current.sha1 == hashlib.sha1(content_bytes(content)).hexdigest()


@operation()
def managed_file(
    dest: str,
    content: str | bytes | Path,
    current: PathState,
    user: str = "root",
    group: str = "root",
    mode: str = "0644",
):
    """`dest` holds `content` (text, bytes, or a local file to upload), owned and moded as given."""
    if same_content(current, content) and _owned(current, "file", user, group, mode):
        host.noop(f"{dest} is up to date")
        return
    src = str(content) if isinstance(content, Path) else StringIO(content_bytes(content).decode())
    yield from files.put._inner(src=src, dest=dest, user=user, group=group, mode=mode)


@operation()
def managed_secret(
    dest: str, content: Path, current: PathState, user: str = "root", group: str = "root", mode: str = "0400"
):
    """`dest` holds the local file `content` (a token, a private key), written without a moment readable by others.

    pyinfra's `files.put` uploads to a temporary file named from `dest`'s hash (readable by other users under
    the ssh user's umask) and chmods `dest` after copying. Here the bytes go through the command's stdin,
    base64-encoded (pyinfra's `write_stdin` ends each line with a newline; base64 keeps the bytes exact), to
    `install`, which replaces `dest` with a new file created under umask 077 (owner-only from its first byte),
    then sets owner and mode.
    Neither the secret nor its encoding is in the command line, so pyinfra's output and `ps` never show it.
    """
    if same_content(current, content) and _owned(current, "file", user, group, mode):
        host.noop(f"{dest} is up to date (same SHA1, {user}:{group} {mode})")
        return
    encoded = base64.encodebytes(content_bytes(content)).decode()
    yield StringCommand(
        "mkdir -p",
        QuoteString(posixpath.dirname(dest) or "/"),
        "&& ( umask 077 && base64 -d | install",
        "-m",
        QuoteString(mode),
        "-o",
        QuoteString(user),
        "-g",
        QuoteString(group),
        "/dev/stdin",
        QuoteString(dest),
        ")",
        _stdin=encoded,
    )


@operation()
def managed_directory(path: str, current: PathState, user: str = "root", group: str = "root", mode: str = "0755"):
    if _owned(current, "directory", user, group, mode):
        host.noop(f"{path} exists, {user}:{group} {mode}")
        return
    yield from files.directory._inner(path=path, user=user, group=group, mode=mode)


@operation()
def managed_service(service: str, current: UnitState | None, running: bool | None = True, enabled: bool | None = True):
    """Keep a unit running and/or enabled; a stopped unit is cleared of a failed state before it starts."""
    known = current or UnitState(running=False, enabled=False)
    if (running is None or known.running == running) and (enabled is None or known.enabled == enabled):
        host.noop(
            f"{service} is {'running' if known.running else 'stopped'}, {'enabled' if known.enabled else 'disabled'}"
        )
        return
    if running and not known.running:
        # A unit that crash-looped sits in start-limit-hit until its failed state is cleared.
        yield f"systemctl reset-failed {service} 2>/dev/null || true"
    yield from systemd.service._inner(service=service, running=running, enabled=enabled)


@operation()
def managed_absent(path: str, current: PathState):
    """Nothing at `path` (a file a role installed once and no longer wants)."""
    if current.kind == "absent":
        host.noop(f"{path} is absent")
        return
    yield from files.file._inner(path=path, present=False)


def driver_daemons(services: list[str] | tuple[str, ...], driver_loaded: bool) -> None:
    """Enable a driver's daemons, and run them only once the driver is loaded: before the reboot into a new
    driver (pending, or not allowed) they cannot start, so they are enabled for the next boot."""
    for service in services:
        systemd.service(
            name=f"{'Run' if driver_loaded else 'Enable'} {service}",
            service=service,
            enabled=True,
            running=True if driver_loaded else None,
        )
