"""Figures for the sandbox itself: rootfs build, cached unpack, host up, boot, idle RSS, down."""

from __future__ import annotations

import time
from collections.abc import Callable

from gemmaserve.sandbox import hosts, rootfs, state

Log = Callable[[str], None]


def measure(cold: bool = False, log: Log = print) -> dict[str, float]:
    """Bring one throwaway host (first free index from 101) up and down, timing each phase.

    cold=True deletes the cached rootfs first, so the debootstrap build is timed too (~70-130 s).
    """
    figures: dict[str, float] = {}
    tarball = rootfs.CACHE_DIR / f"rootfs-{rootfs.SUITE}-{rootfs.cache_key(rootfs.outer_apt_sources())}.tar.zst"
    if cold:
        tarball.unlink(missing_ok=True)
    started = time.monotonic()
    rootfs.cached_rootfs(log)
    if cold:
        figures["rootfs_build_cold_s"] = time.monotonic() - started
    figures["rootfs_cache_mb"] = tarball.stat().st_size / 1e6
    scratch = rootfs.CACHE_DIR / "bench-unpack"
    started = time.monotonic()
    rootfs.unpack_rootfs(tarball, scratch)
    figures["rootfs_unpack_cached_s"] = time.monotonic() - started
    hosts.remove_tree(scratch)

    taken = {h.name for h in state.load_state().hosts}
    index = next(i for i in range(101, 255) if state.host_name(i) not in taken)
    [host] = hosts.up_hosts([index], log=log)
    try:
        timings = hosts.UP_TIMINGS[host.name]
        figures["host_rootfs_ready_s"] = timings["rootfs_s"]
        figures["host_boot_to_ssh_s"] = timings["boot_s"]
        figures["host_up_s"] = timings["up_s"]
        time.sleep(5)  # let boot-time jobs finish before reading the idle footprint
        figures["host_idle_rss_mb"] = hosts.host_rss_bytes(host) / 2**20
    finally:
        started = time.monotonic()
        hosts.down([host.name], log=log)
        figures["host_down_s"] = time.monotonic() - started
    return figures


def print_figures(figures: dict[str, float]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table("figure", "value", title="sandbox figures")
    for name, value in figures.items():
        table.add_row(name, f"{value:.1f}")
    Console().print(table)
