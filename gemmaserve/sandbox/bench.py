"""Figures for the sandbox: rootfs build, cached unpack, host up, boot, idle RSS, down; and with a deploy:
pyinfra deploy, no-op redeploy, time to first token after a cold and a warm replica restart."""

from __future__ import annotations

import subprocess
import sys
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


def _first_token_after(host: state.Host, restart: str, log: Log, timeout: float = 600) -> float:
    """Seconds from running `restart` on the host until a streamed chat completion yields a token."""
    import json
    import urllib.request

    from gemmaserve.endpoint import EndpointError, get_json, request

    base = f"http://{host.address}:8080/v1"
    model = get_json(f"{base}/models")["data"][0]["id"]
    started = time.monotonic()
    hosts.in_host(host, "/bin/sh", "-c", restart, timeout=120)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    payload = json.dumps({"model": model, "stream": True, "max_tokens": 4,
                          "messages": [{"role": "user", "content": "Hi"}]}).encode()
    while time.monotonic() - started < timeout:
        try:
            status, _ = request(f"http://{host.address}:8080/health", timeout=2)
            if status == 200:
                req = urllib.request.Request(f"{base}/chat/completions", data=payload,
                                             headers={"Content-Type": "application/json"})
                with opener.open(req, timeout=60) as response:
                    for line in response:
                        if b'"content"' in line:
                            return time.monotonic() - started
        except (EndpointError, OSError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"no token from {base} within {timeout:.0f} s of `{restart}`")


def measure_deploy(log: Log = print) -> dict[str, float]:
    """Deploy the demo profile to a throwaway host with the real pyinfra CLI and time serving."""
    from gemmaserve.demo import REPO, ensure_engine_and_model

    ensure_engine_and_model()
    figures: dict[str, float] = {}
    taken = {h.name for h in state.load_state().hosts}
    index = next(i for i in range(101, 255) if state.host_name(i) not in taken)
    started = time.monotonic()
    [host] = hosts.up_hosts([index], log=log)
    figures["host_up_s"] = time.monotonic() - started
    try:
        pyinfra = [sys.executable, "-m", "pyinfra", "-y", "--limit", host.name, "hosts/sandbox.py", "deploy.py"]
        for figure in ("deploy_s", "noop_redeploy_s"):
            started = time.monotonic()
            result = subprocess.run(pyinfra, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if result.returncode:
                raise RuntimeError("deploy failed:\n" + result.stdout[-3000:])
            figures[figure] = time.monotonic() - started
            log(f"{figure}: {figures[figure]:.1f} s")
        # Cold: compile caches wiped, as after a reboot with nothing restored.
        figures["first_token_after_cold_restart_s"] = _first_token_after(
            host, "systemctl stop vllm@0 && rm -rf /dev/shm/gemmaserve/* && systemctl start vllm@0", log)
        figures["first_token_after_warm_restart_s"] = _first_token_after(host, "systemctl restart vllm@0", log)
        figures["warm_over_cold"] = figures["first_token_after_warm_restart_s"] / figures["first_token_after_cold_restart_s"]
    finally:
        hosts.down([host.name], log=log)
    return figures


def measure_fleet(size: int = 4, log: Log = print) -> dict[str, float]:
    """Deploy one fresh host, then `size` fresh hosts in one pyinfra run: how deploys scale with hosts."""
    from gemmaserve.demo import REPO, ensure_engine_and_model

    ensure_engine_and_model()
    taken = {h.name for h in state.load_state().hosts}
    indices = [i for i in range(101, 255) if state.host_name(i) not in taken][: size + 1]
    hosts.up_hosts(indices, log=log)
    names = [state.host_name(i) for i in indices]
    figures: dict[str, float] = {}
    try:
        for label, group in (("deploy_1_host_s", names[:1]), (f"deploy_{size}_hosts_s", names[1:])):
            limits = [arg for name in group for arg in ("--limit", name)]
            started = time.monotonic()
            result = subprocess.run([sys.executable, "-m", "pyinfra", "-y", *limits, "hosts/sandbox.py", "deploy.py"],
                                    cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if result.returncode:
                raise RuntimeError(f"deploy to {group} failed:\n" + result.stdout[-3000:])
            figures[label] = time.monotonic() - started
            log(f"{label}: {figures[label]:.1f} s")
        figures[f"{size}_hosts_over_1"] = figures[f"deploy_{size}_hosts_s"] / figures["deploy_1_host_s"]
    finally:
        hosts.down(names, log=log)
    return figures


def print_figures(figures: dict[str, float]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table("figure", "value", title="sandbox figures")
    for name, value in figures.items():
        table.add_row(name, f"{value:.2f}" if value < 10 else f"{value:.1f}")
    Console().print(table)
