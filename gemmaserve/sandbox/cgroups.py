"""One cgroup per sandbox host in every mounted hierarchy (cgroup v1 controllers and/or v2)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

from gemmaserve.sandbox.system import reap


def cgroup_roots() -> list[Path]:
    """Mount points of every cgroup hierarchy: the v1 controllers and name=systemd, and/or v2."""
    roots: list[Path] = []
    seen: set[str] = set()
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, mountpoint, fstype, options, *_ = line.split()
        if fstype not in ("cgroup", "cgroup2"):
            continue
        # Co-mounted controllers (cpu,cpuacct) appear once per mount; key on the option set.
        key = (
            fstype
            if fstype == "cgroup2"
            else ",".join(
                sorted(o for o in options.split(",") if o not in ("rw", "ro", "relatime", "nosuid", "nodev", "noexec"))
            )
        )
        if key not in seen:
            seen.add(key)
            roots.append(Path(mountpoint))
    return roots


def create_cgroups(name: str) -> list[str]:
    """One cgroup per host in each hierarchy, gemmaserve/<name>, ready to take the nspawn process."""
    paths = []
    for root in cgroup_roots():
        parent = root
        for part in ("gemmaserve", name):
            child = parent / part
            child.mkdir(exist_ok=True)
            # A v1 cpuset cgroup takes no task until it has cpus and mems of its own.
            for knob in ("cpuset.cpus", "cpuset.mems"):
                if (child / knob).exists() and not (child / knob).read_text().strip():
                    (child / knob).write_text((parent / knob).read_text())
            parent = child
        paths.append(str(parent))
    return paths


def _cgroup_tree(path: Path) -> list[Path]:
    """Every cgroup under path, children before parents. The host's systemd may remove cgroups while this
    walks them (a host still shutting down): os.walk skips what vanished where Path.rglob raises."""
    return [Path(top) for top, _, _ in os.walk(path, topdown=False)]


def cgroup_pids(paths: Iterable[str]) -> set[int]:
    pids: set[int] = set()
    for path in paths:
        for group in _cgroup_tree(Path(path)):
            try:
                pids.update(int(p) for p in (group / "cgroup.procs").read_text().split())
            except FileNotFoundError:
                pass
    return pids


def remove_cgroups(paths: Iterable[str]) -> None:
    """Kill whatever is left in the host's cgroups (all of it ours), then remove them."""
    paths = list(paths)
    deadline = time.monotonic() + 10
    while (pids := cgroup_pids(paths)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            reap(pid)
        time.sleep(0.1)
    for path in paths:
        for group in _cgroup_tree(Path(path)):
            try:
                group.rmdir()
            except FileNotFoundError:
                pass
        parent = Path(path).parent
        if parent.name == "gemmaserve":
            try:
                parent.rmdir()  # only succeeds once the last host is gone
            except OSError:
                pass
