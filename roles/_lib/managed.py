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

from roles._lib.facts import HostState, PathState, UnitState
from roles._lib.programs import INSTALLS, LIB_DIR, SHARED, imports_shared, installed_path, source_of


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


def managed_unit(
    unit: str,
    content: str,
    now: HostState,
    restart_with: tuple = (),
    running: bool | None = True,
    enabled: bool | None = True,
):
    """The "install a program's unit, restart it if anything changed" shape of the roles, in one place:
    /etc/systemd/system/`unit` holds `content` (its path and the unit read in `now`); a running unit restarts,
    systemd reloaded, when its file or anything in `restart_with` changed (checks such as `op.did_change` of the
    program it runs); otherwise systemd reloads when the file changed. Then managed_service keeps it `running` /
    `enabled`. Returns the unit file's operation."""
    path = f"/etc/systemd/system/{unit}"
    installed = managed_file(name=f"Install {unit}", dest=path, content=content, current=now.path(path))
    checks = (installed.did_change, *restart_with)
    if running:
        systemd.service(
            name=f"Restart {unit} with its new unit or program",
            service=unit,
            running=True,
            restarted=True,
            enabled=enabled,
            daemon_reload=True,
            _if=lambda: any(check() for check in checks),
        )
    else:
        systemd.daemon_reload(name=f"Reload systemd units for {unit}", _if=installed.did_change)
    state = "running" if running else "enabled" if enabled else "in place"
    managed_service(name=f"Keep {unit} {state}", service=unit, current=now.unit(unit), running=running, enabled=enabled)
    return installed


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


class MissingBaseRole(Exception):
    pass


# The base role's install operations of the shared programs, per host of this pyinfra run (a deploy file calls
# the roles once per host, in order): what require_base checks and base_programs_changed reads.
_BASE_INSTALLS: dict[tuple[int, str], list] = {}


def _this_host() -> tuple[int, str]:
    return id(host.state), host.name


def program_paths(role: str) -> list[str]:
    """Where `role`'s programs land (INSTALLS), for the role's HostState to read with its other paths."""
    return [installed_path(name) for name in INSTALLS[role]]


def install_programs(role: str, now: HostState) -> dict[str, object]:
    """Install the programs `role` owns (roles._lib.programs.INSTALLS) into LIB_DIR, each a managed_file read
    from `now` (which holds program_paths(role)); their operations by file name, for restart decisions.

    The base role creates LIB_DIR. A role whose programs import a shared one needs base to have run first on
    this host (require_base); one whose programs stand alone creates LIB_DIR itself, so it can run alone (the
    nvidia role on a driver-only deploy)."""
    missing = [path for path in [*program_paths(role), LIB_DIR] if path not in now.paths]
    if missing:
        raise ValueError(f"the {role} role's HostState does not read {', '.join(missing)}")
    if role != "base" and imports_shared(role):
        require_base(role, "its programs import")
    else:
        managed_directory(name="Create the gemmaserve library directory", path=LIB_DIR, current=now.path(LIB_DIR))
    installs = {
        name: managed_file(
            name=f"Install {name}",
            dest=installed_path(name),
            content=source_of(role, name),
            current=now.path(installed_path(name)),
        )
        for name in INSTALLS[role]
    }
    if role == "base":
        _BASE_INSTALLS[_this_host()] = list(installs.values())
    return installs


def require_base(role: str, why: str = "its units run") -> None:
    """Stop before any operation when the base role did not run first on this host in this run: `role` needs
    what base installs in LIB_DIR (SHARED)."""
    if _this_host() not in _BASE_INSTALLS:
        raise MissingBaseRole(
            f"{host.name}: the {role} role needs {', '.join(SHARED)} in {LIB_DIR} ({why} them), which the base "
            f"role installs: call base() before {role}() in the deploy file (deploy.py does)"
        )


def base_programs_changed():
    """A check for `_if=`: whether this run changed a shared program on this host (a daemon that imports one
    restarts with it)."""
    installs = _BASE_INSTALLS.get(_this_host(), [])
    return lambda: any(op.did_change() for op in installs)
