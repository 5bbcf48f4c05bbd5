"""Another router measured beside HAProxy on the sandbox (`gemmaserve sandbox bench --routing`): vLLM's own
router, vllm-router ([vllm-project/router](https://github.com/vllm-project/router), on PyPI as `vllm-router`),
with its prefix-cache-aware policy (`cache_aware`: a radix tree of the prompts each worker was sent, and a
fallback to the least-loaded worker when the load is uneven) and its `consistent_hash` policy.

It is installed at a pinned version into a venv under /opt/gemmaserve/venvs, which every sandbox host has bound
read-only (built with Debian's python3, the hosts' own), and runs on the host as a transient systemd unit in
front of the same two replicas HAProxy serves, on the host's sandbox address. The measurement sends it plain
HTTP with no key: it stands in for HAProxy's choice of a replica only, not for TLS, keys or limits.
"""

from __future__ import annotations

import shlex
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from gemmaserve.plan import Plan

VERSION = "0.1.17"
VENV = Path(f"/opt/gemmaserve/venvs/vllm-router-{VERSION}")
PROGRAM = VENV / "bin" / "vllm-router"
# Its prefix-aware policy (the one vllm-router starts with by default) and its session-hash one.
POLICIES = ("cache_aware", "consistent_hash")
PORT = 18090
UNIT = "gemmaserve-bench-vllm-router"
STARTUP_S = 120

Log = Callable[[str], None]


def ensure_venv(log: Log = print) -> Path:
    """The venv with vllm-router==VERSION, installed once (pip with the machine's own index settings). A venv's
    scripts name their interpreter by path, so it is built where it lives; a marker says it is complete."""
    complete = VENV / ".gemmaserve-complete"
    if complete.is_file():
        return PROGRAM
    started = time.monotonic()
    log(f"vllm-router {VERSION}: installing into {VENV} (once)")
    subprocess.run(["rm", "-rf", str(VENV)], check=True)
    subprocess.run(["/usr/bin/python3", "-m", "venv", str(VENV)], check=True)
    subprocess.run(
        [str(VENV / "bin" / "pip"), "install", "--quiet", f"vllm-router=={VERSION}"], check=True, timeout=900
    )
    complete.touch()
    log(f"vllm-router {VERSION}: installed in {time.monotonic() - started:.0f} s")
    return PROGRAM


def command(plan: Plan, address: str, policy: str) -> list[str]:
    """The router's command line on a host: every replica of `plan` as a worker, bound on `address`."""
    workers = [f"http://127.0.0.1:{replica.port}" for replica in plan.replicas]
    return [
        str(PROGRAM),
        "--host", address,
        "--port", str(PORT),
        "--policy", policy,
        "--worker-urls", *workers,
        "--log-level", "warning",
        # Its own retries and circuit breaker would hide a failed turn; HAProxy is measured without either.
        "--disable-retries",
        "--disable-circuit-breaker",
    ]  # fmt: skip


def start(target, plan: Plan, address: str, policy: str, log: Log = print) -> str:
    """Start the router on `target` (a testinfra host) and wait until it answers: its base URL."""
    argv = " ".join(shlex.quote(part) for part in command(plan, address, policy))
    result = target.run(f"systemd-run --unit={UNIT} --collect --property=DynamicUser=yes {argv}")
    if result.rc != 0:
        raise RuntimeError(f"vllm-router {policy}: systemd-run failed: {result.stderr.strip()}")
    deadline = time.monotonic() + STARTUP_S
    while target.run(f"curl -fsS -m 2 http://{address}:{PORT}/health").rc != 0:
        if time.monotonic() > deadline or target.run(f"systemctl is-active --quiet {UNIT}").rc != 0:
            journal = target.run(f"journalctl -u {UNIT} -n 20 --no-pager -o cat").stdout
            stop(target)
            raise RuntimeError(f"vllm-router {policy} did not answer on {address}:{PORT}:\n{journal}")
        time.sleep(1)
    log(f"vllm-router {VERSION} ({policy}) answers on {address}:{PORT}")
    return f"http://{address}:{PORT}/v1"


def stop(target) -> None:
    target.run(f"systemctl stop {UNIT}")
