"""Batched facts: one ssh command reads the state of many paths or packages (pyinfra asks once per fact).

pyinfra's `files.put` asks three questions per file (the file, its directory, its SHA1) and
`systemd.service` two per unit, each a separate ssh round trip. A role reads all its paths once here
and hands each managed-file operation (roles/_lib/managed.py) the state of its own path, so a
converged host costs one round trip per role, not one per file; pyinfra's own facts are asked only
when something must change.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from pyinfra.api import FactBase
from pyinfra.facts.systemd import SystemdEnabled, SystemdStatus


@dataclass(frozen=True)
class PathState:
    """What is at a path: kind is "file", "directory", "absent", or "unknown" when it could not be read."""

    kind: str
    user: str = ""
    group: str = ""
    mode: int = 0
    sha1: str = ""


UNKNOWN = PathState("unknown")


class PathStates(FactBase[dict[str, PathState]]):
    """Kind, owner, group, mode and (for files) SHA1 of each path, in one command:

    .. code:: python

        {"/etc/haproxy/haproxy.cfg": PathState("file", "root", "root", 0o644, "9f8e..."),
         "/var/lib/gemmaserve": PathState("directory", "gemmaserve", "gemmaserve", 0o750),
         "/etc/gemmaserve/replica-3.env": PathState("absent")}
    """

    def command(self, paths: tuple[str, ...]) -> str:
        quoted = " ".join(shlex.quote(p) for p in paths)
        return (
            f"for p in {quoted}; do "
            'if [ -f "$p" ]; then echo "file $(stat -c \'%U %G %a\' "$p") $(sha1sum < "$p" | cut -d\' \' -f1)"; '
            'elif [ -d "$p" ]; then echo "directory $(stat -c \'%U %G %a\' "$p") -"; '
            "else echo absent; fi; done"
        )

    def process(self, output: list[str]) -> list[PathState]:
        states = []
        for line in output:
            kind, *rest = line.split()
            if kind == "absent":
                states.append(PathState("absent"))
            else:
                user, group, mode, sha1 = rest
                states.append(PathState(kind, user, group, int(mode, 8), "" if sha1 == "-" else sha1))
        return states


class InstalledPackages(FactBase[set[str]]):
    """Which of a list of Debian packages are installed, in one command:

    .. code:: python

        {"haproxy", "curl"}
    """

    def command(self, packages: tuple[str, ...]) -> str:
        quoted = " ".join(shlex.quote(p) for p in packages)
        return f"dpkg-query -W -f='${{db:Status-Abbrev}} ${{Package}}\\n' {quoted} 2>/dev/null || true"

    def process(self, output: list[str]) -> set[str]:
        return {line.split()[-1].split(":")[0] for line in output if line.startswith("ii ")}

    @staticmethod
    def default() -> set[str]:
        return set()


def path_states(host, paths: list[str]) -> dict[str, PathState]:
    """The state of every path, read in one command; UNKNOWN for all when the answer cannot be read."""
    paths = list(dict.fromkeys(paths))
    if not paths:
        return {}
    states = host.get_fact(PathStates, paths=tuple(paths)) or []
    if len(states) != len(paths):
        states = [UNKNOWN] * len(paths)
    return dict(zip(paths, states, strict=True))


@dataclass(frozen=True)
class UnitState:
    running: bool
    enabled: bool


def unit_states(host, units: list[str]) -> dict[str, UnitState]:
    """Whether each unit is running and enabled, from pyinfra's own SystemdStatus/SystemdEnabled (which take lists)."""
    units = list(dict.fromkeys(units))
    if not units:
        return {}
    running = host.get_fact(SystemdStatus, services=units) or {}
    enabled = host.get_fact(SystemdEnabled, services=units) or {}
    return {u: UnitState(running.get(u, False), enabled.get(u, False)) for u in units}


class HostState:
    """What one role manages on this host, read once: its paths (one command) and its units (two)."""

    def __init__(self, host, paths: list[str] = (), units: list[str] = ()):
        self.paths = path_states(host, list(paths))
        self.units = unit_states(host, list(units))

    def path(self, path: str) -> PathState:
        return self.paths.get(path, UNKNOWN)

    def unit(self, unit: str) -> UnitState | None:
        return self.units.get(unit)
