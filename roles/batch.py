"""One round trip for many facts.

pyinfra's `files.put` asks three questions per file (the file, its directory, its SHA1) and
`systemd.service` two per unit, each a separate ssh command (~50 ms). A converged host would spend
most of a redeploy on those questions. Here a role asks once for all its files, directories, units
and packages, and emits pyinfra's own operation only for what differs; what already matches gets
no operation at all (`UNCHANGED`).
"""

from __future__ import annotations

import hashlib
import shlex
from dataclasses import dataclass
from io import StringIO
from pathlib import Path
from typing import Any

import jinja2
from pyinfra import host
from pyinfra.api import FactBase
from pyinfra.operations import apt, files, systemd


class _Unchanged:
    """Stands in for an operation that was not needed: `did_change()` is False, as pyinfra's would be."""

    @staticmethod
    def did_change() -> bool:
        return False


UNCHANGED = _Unchanged()


@dataclass(frozen=True)
class PathState:
    kind: str  # "file", "directory", "absent", or "unknown" when the answer could not be read
    user: str = ""
    group: str = ""
    mode: int = 0
    sha1: str = ""


class PathStates(FactBase):
    """Kind, owner, group, mode and (for files) SHA1 of each path, in one command."""

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


class UnitStates(FactBase):
    """`systemctl is-active` and `is-enabled` of each unit, in one command."""

    def command(self, units: tuple[str, ...]) -> str:
        quoted = " ".join(shlex.quote(u) for u in units)
        return (
            f'for u in {quoted}; do echo "$u $(systemctl is-active -- "$u" 2>/dev/null || true) '
            '$(systemctl is-enabled -- "$u" 2>/dev/null || true)"; done'
        )

    def process(self, output: list[str]) -> dict[str, tuple[str, str]]:
        states = {}
        for line in output:
            unit, *rest = line.split()
            states[unit] = (rest[0] if rest else "unknown", rest[1] if len(rest) > 1 else "")
        return states


class InstalledPackages(FactBase):
    """Which of a list of Debian packages are installed."""

    def command(self, packages: tuple[str, ...]) -> str:
        quoted = " ".join(shlex.quote(p) for p in packages)
        return f"dpkg-query -W -f='${{db:Status-Abbrev}} ${{Package}}\\n' {quoted} 2>/dev/null || true"

    def process(self, output: list[str]) -> set[str]:
        return {line.split()[-1].split(":")[0] for line in output if line.startswith("ii ")}


def missing_packages(packages: list[str]) -> list[str]:
    installed = host.get_fact(InstalledPackages, packages=tuple(packages)) or set()
    return [p for p in packages if p not in installed]


class Snapshot:
    """What a role manages on this host, read in one command per kind."""

    def __init__(self, paths: list[str] = (), units: list[str] = ()):
        paths, units = tuple(dict.fromkeys(paths)), tuple(dict.fromkeys(units))
        path_states = host.get_fact(PathStates, paths=paths) if paths else []
        if len(path_states) != len(paths):  # an unreadable answer: fall back to pyinfra's own checks
            path_states = [PathState("unknown")] * len(paths)
        self.paths = dict(zip(paths, path_states, strict=True))
        self.units = host.get_fact(UnitStates, units=units) if units else {}

    def _matches(self, path: str, kind: str, user: str, group: str, mode: str) -> PathState | None:
        state = self.paths.get(path)
        if not state or (state.kind, state.user, state.group, state.mode) != (kind, user, group, int(mode, 8)):
            return None
        return state

    def put(
        self,
        *,
        name: str,
        dest: str,
        content: str | bytes | Path,
        user: str = "root",
        group: str = "root",
        mode: str = "0644",
    ) -> Any:
        """`files.put`, emitted only when `dest` differs from `content` (or its owner or mode does)."""
        data = content.read_bytes() if isinstance(content, Path) else content
        data = data.encode() if isinstance(data, str) else data
        state = self._matches(dest, "file", user, group, mode)
        if state and state.sha1 == hashlib.sha1(data).hexdigest():
            return UNCHANGED
        src = str(content) if isinstance(content, Path) else StringIO(data.decode())
        return files.put(name=name, src=src, dest=dest, user=user, group=group, mode=mode)

    def directory(self, *, name: str, path: str, user: str = "root", group: str = "root", mode: str = "0755") -> Any:
        if self._matches(path, "directory", user, group, mode):
            return UNCHANGED
        return files.directory(name=name, path=path, user=user, group=group, mode=mode)

    def is_failed(self, unit: str) -> bool:
        return self.units.get(unit, ("", ""))[0] == "failed"

    def service(
        self, *, name: str, service: str, running: bool | None = True, enabled: bool | None = True, **extra: Any
    ) -> Any:
        """`systemd.service` keeping a unit running and/or enabled, emitted only when it is not."""
        active, enablement = self.units.get(service, ("unknown", ""))
        running_ok = running is None or (active == "active") == running
        enabled_ok = enabled is None or (enablement in ("enabled", "static", "alias")) == enabled
        if running_ok and enabled_ok:
            return UNCHANGED
        return systemd.service(name=name, service=service, running=running, enabled=enabled, **extra)


def packages(*, name: str, packages: list[str]) -> Any:
    """`apt.packages`, emitted only when one of `packages` is not installed; then the package lists are
    refreshed first unless apt updated them in the last hour (a role never relies on another's update)."""
    if not missing_packages(packages):
        return UNCHANGED
    return apt.packages(name=name, packages=packages, no_recommends=True, update=True, cache_time=3600)


def render(template: Path, **context: Any) -> str:
    """A role template rendered as pyinfra's `files.template` renders it (strict, trailing newline kept)."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(template.parent),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    return env.get_template(template.name).render(**context)
