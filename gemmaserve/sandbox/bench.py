"""Figures for the sandbox: rootfs build, cached unpack, host up, boot, idle RSS, down; and with a deploy:
pyinfra deploy, no-op redeploy, time to first token after a cold and a warm replica restart."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from gemmaserve.sandbox import lifecycle, machine, rootfs, state

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
    machine.remove_tree(scratch)

    [index] = state.free_indices(1)
    [host] = lifecycle.up_hosts([index], log=log)
    try:
        timings = host.boot_timings
        figures["host_rootfs_ready_s"] = timings["rootfs_s"]
        figures["host_boot_to_ssh_s"] = timings["boot_s"]
        figures["host_up_s"] = timings["up_s"]
        time.sleep(5)  # let boot-time jobs finish before reading the idle footprint
        figures["host_idle_rss_mb"] = machine.host_rss_bytes(host) / 2**20
    finally:
        started = time.monotonic()
        lifecycle.down([host.name], log=log)
        figures["host_down_s"] = time.monotonic() - started
    return figures


def _first_token_after(host: state.Host, restart: str, log: Log, timeout: float = 600) -> float:
    """Seconds from running `restart` on the host until a streamed chat completion yields a token."""
    import json
    import urllib.request

    from gemmaserve.ops.endpoint import EndpointError, get_json
    from gemmaserve.sandbox import credentials

    endpoint = credentials.endpoint(host)
    base = endpoint.base_url
    model = get_json(f"{base}/models", credentials=endpoint.credentials)["data"][0]["id"]
    started = time.monotonic()
    machine.in_host(host, "/bin/sh", "-c", restart, timeout=120)
    opener = endpoint.credentials.opener()
    payload = json.dumps(
        {"model": model, "stream": True, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    ).encode()
    headers = {"Content-Type": "application/json", **endpoint.credentials.headers()}
    while time.monotonic() - started < timeout:
        try:
            status, _ = endpoint.request("/health", timeout=2)
            if status == 200:
                req = urllib.request.Request(f"{base}/chat/completions", data=payload, headers=headers)
                with opener.open(req, timeout=60) as response:
                    first = None
                    for line in response:
                        if first is None and b'"content"' in line:
                            first = time.monotonic() - started
                    # Read to the end: a stream left open when the next restart stops vLLM holds
                    # its HTTP server (and the restart) until systemd's stop timeout.
                    if first is not None:
                        return first
        except (EndpointError, OSError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"no token from {base} within {timeout:.0f} s of `{restart}`")


def _busy_cpu_s() -> float:
    """Machine-wide busy CPU seconds so far (user, nice, system, irq, softirq) from /proc/stat."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    return sum(int(fields[i]) for i in (0, 1, 2, 5, 6)) / os.sysconf("SC_CLK_TCK")


def _pyinfra(names: list[str], data: Path | None = None) -> tuple[float, float]:
    """Deploy deploy.py to the named sandbox hosts in one pyinfra run: (wall seconds, busy CPU seconds)."""
    from gemmaserve.ops import fleet
    from gemmaserve.sandbox.profile import OVERRIDE_ENV

    cpu = _busy_cpu_s()
    run = fleet.run_pyinfra(limit=names, env={OVERRIDE_ENV: str(data) if data else None})
    if not run.ok:
        raise RuntimeError(f"deploy to {names} failed:\n" + run.output[-3000:])
    return run.seconds, _busy_cpu_s() - cpu


COLD = "systemctl stop vllm@0 && rm -rf /dev/shm/gemmaserve/* && systemctl start vllm@0"
WARM = "systemctl restart vllm@0"


def measure_deploy(log: Log = print) -> dict[str, float]:
    """Deploy the demo profile to a throwaway host with the real pyinfra CLI and time serving.

    Restarts are timed twice: on the demo profile (eager: nothing compiled, so the caches hold little)
    and after redeploying with torch.compile on, where the compile cache on /dev/shm is what a warm
    restart reuses and a cold one (caches wiped, as after a reboot with nothing restored) rebuilds.
    """
    from gemmaserve.sandbox.demo import ensure_engine_and_model
    from gemmaserve.sandbox.profile import DEFAULT_DATA

    ensure_engine_and_model()
    figures: dict[str, float] = {}
    [index] = state.free_indices(1)
    started = time.monotonic()
    [host] = lifecycle.up_hosts([index], log=log)
    figures["host_up_s"] = time.monotonic() - started
    compiled = rootfs.CACHE_DIR / "bench-compiled.yaml"
    compiled.write_text(
        yaml.safe_dump({"gemmaserve_workload": {**DEFAULT_DATA["gemmaserve_workload"], "enforce_eager": False}})
    )
    try:
        for figure in ("deploy_s", "noop_redeploy_s"):
            figures[figure], _ = _pyinfra([host.name])
            log(f"{figure}: {figures[figure]:.1f} s")
        for mode in ("eager", "compiled"):
            if mode == "compiled":
                figures["redeploy_to_compiled_s"], _ = _pyinfra([host.name], compiled)
                log(f"redeploy_to_compiled_s: {figures['redeploy_to_compiled_s']:.1f} s (g++ and a first compile)")
            cold = _first_token_after(host, COLD, log)
            warm = _first_token_after(host, WARM, log)
            figures[f"{mode}_first_token_after_cold_restart_s"] = cold
            figures[f"{mode}_first_token_after_warm_restart_s"] = warm
            figures[f"{mode}_warm_over_cold"] = warm / cold
            log(f"{mode}: first token {cold:.1f} s after a cold restart, {warm:.1f} s after a warm one")
    finally:
        compiled.unlink(missing_ok=True)
        lifecycle.down([host.name], log=log)
    return figures


def measure_fleet(size: int = 4, log: Log = print) -> dict[str, float]:
    """Deploy one fresh host, then `size` fresh hosts in one pyinfra run: how deploys scale with hosts.

    Sandbox hosts share this machine's cores, so the figures include the CPU floor: the busy CPU
    seconds the run used divided by the cores; no orchestration can finish below it here.
    """
    from gemmaserve.sandbox.demo import ensure_engine_and_model

    ensure_engine_and_model()
    indices = state.free_indices(size + 1)
    lifecycle.up_hosts(indices, log=log)
    names = [state.host_name(i) for i in indices]
    cores = os.cpu_count() or 1
    figures: dict[str, float] = {"cores": cores}
    try:
        for label, group in (("1_host", names[:1]), (f"{size}_hosts", names[1:])):
            wall, cpu = _pyinfra(group)
            figures[f"deploy_{label}_s"], figures[f"deploy_{label}_cpu_s"] = wall, cpu
            figures[f"deploy_{label}_cpu_floor_s"] = cpu / cores
            log(f"deploy {label}: {wall:.1f} s, {cpu:.0f} CPU s (floor on {cores} cores: {cpu / cores:.1f} s)")
        figures[f"{size}_hosts_over_1"] = figures[f"deploy_{size}_hosts_s"] / figures["deploy_1_host_s"]
        # Above 1.0 only by what orchestration adds on top of the work the hosts' CPUs must do.
        figures[f"{size}_hosts_over_max_1_host_and_cpu_floor"] = figures[f"deploy_{size}_hosts_s"] / max(
            figures["deploy_1_host_s"], figures[f"deploy_{size}_hosts_cpu_floor_s"]
        )
    finally:
        lifecycle.down(names, log=log)
    return figures


def print_figures(figures: dict[str, float]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table("figure", "value", title="sandbox figures")
    for name, value in figures.items():
        table.add_row(name, f"{value:.2f}" if value < 10 else f"{value:.1f}")
    Console().print(table)
