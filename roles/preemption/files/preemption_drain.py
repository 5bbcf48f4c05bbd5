"""Drain this host's replicas in HAProxy when Google Cloud announces a preemption or a terminating maintenance.

Runs on spot / flex-start VMs and TPU VMs as gemmaserve-preemption.service (stdlib and hostlib, installed
beside it):

    python3 preemption_drain.py --grace 25 --haproxy-admin /opt/gemmaserve/lib/haproxy_admin.py

It holds a hanging GET on the metadata server for each notice
(https://cloud.google.com/compute/docs/metadata/querying-metadata#waitforchange):

- instance/preempted turns TRUE when a spot (or preemptible) VM is being reclaimed; the guest then has
  30 s before it is stopped (https://cloud.google.com/compute/docs/instances/spot#preemption-process);
- instance/maintenance-event turns TERMINATE_ON_HOST_MAINTENANCE ahead of a maintenance that stops the
  VM (GPU VMs and TPU VMs cannot live-migrate: https://cloud.google.com/compute/docs/gpus/gpu-host-maintenance,
  https://cloud.google.com/tpu/docs/maintenance-events); MIGRATE_ON_HOST_MAINTENANCE keeps serving.

On a notice every replica of the backend is set to DRAIN through HAProxy's admin socket (with the
router's own haproxy_admin.py): no new request reaches them, the ones in flight finish, and with no
usable server left HAProxy answers /health with 503, so the cloud load balancer takes the host out.
The program waits up to --grace seconds for in-flight requests and logs what was left. When every
notice clears (a maintenance that was cancelled or is over) the replicas are made ready again. At
system shutdown without a notice (a queued resource deleted, a flex-start run over) it drains as well.

GEMMASERVE_METADATA_URL points it at another metadata server (the tests run a local fake).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error

# Installed beside this program by the base role (roles/_lib/files/hostlib.py).
import hostlib

KEYS = ("instance/preempted", "instance/maintenance-event")
HANG_SECONDS = 300


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def is_notice(values: dict[str, str]) -> str | None:
    """The notice in force, as 'key=value', or None."""
    if values.get("instance/preempted", "FALSE").upper() == "TRUE":
        return "instance/preempted=TRUE"
    event = values.get("instance/maintenance-event", "NONE").upper()
    if event.startswith("TERMINATE"):
        return f"instance/maintenance-event={event}"
    return None


def fetch(key: str, etag: str | None, timeout: float = HANG_SECONDS) -> tuple[str, str | None]:
    """One metadata read; with an ETag it hangs until the value changes (or `timeout` s)."""
    path = key
    if etag is not None:
        path += f"?wait_for_change=true&last_etag={etag}&timeout_sec={int(timeout)}"
    with hostlib.metadata_open(path, timeout=timeout + 10) as response:
        return response.read().decode().strip(), response.headers.get("ETag")


def watch_key(key: str, events: queue.Queue, stop: threading.Event) -> None:
    """Feed (key, value) on every change; survive a metadata server that is slow, absent or erroring."""
    etag, failures = None, 0
    while not stop.is_set():
        try:
            value, etag = fetch(key, etag)
            failures = 0
            events.put((key, value))
        except urllib.error.HTTPError as error:
            if error.code == 404:
                log(f"{key}: not served here (HTTP 404); not watching it")
                return
            failures += 1
        except (OSError, ValueError):
            failures += 1
        if failures:
            if failures in (1, 10) or failures % 100 == 0:
                log(f"{key}: metadata server unreachable ({failures} tries); retrying")
            etag = None
            stop.wait(min(5.0, 0.5 * failures))


class Replicas:
    """The backend's servers, through the router's haproxy_admin.py (its command line is its interface)."""

    def __init__(self, admin: str, backend: str, socket_path: str | None):
        self.admin, self.backend, self.socket = admin, backend, socket_path

    def _argv(self, *args: str) -> list[str]:
        argv = [sys.executable, self.admin, *args]
        return argv + (["--socket", self.socket] if self.socket else [])

    def servers(self) -> list[str]:
        out = subprocess.run(self._argv("status", self.backend), capture_output=True, text=True, timeout=30)
        return sorted(json.loads(out.stdout or "{}")) if out.returncode == 0 else []

    def drain(self, grace: float) -> None:
        """DRAIN every server at once, then wait (at most `grace` s) for their requests to finish."""
        started = time.monotonic()
        servers = self.servers()
        runs = {
            s: subprocess.Popen(
                self._argv("drain", f"{self.backend}/{s}", "--timeout", str(grace)),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for s in servers
        }
        busy = []
        for server, run in runs.items():
            try:
                _, err = run.communicate(timeout=max(grace - (time.monotonic() - started), 0) + 10)
            except subprocess.TimeoutExpired:
                run.kill()
                err = "timed out"
            if run.returncode != 0:
                busy.append(f"{server} ({err.strip().splitlines()[-1] if err.strip() else 'failed'})")
        took = time.monotonic() - started
        if busy:
            log(f"notice window of {grace:.0f} s over after {took:.1f} s; still busy: {', '.join(busy)}")
        else:
            log(f"drained {len(servers)} replica(s) ({', '.join(servers) or 'none'}) in {took:.1f} s")

    def ready(self) -> None:
        for server in self.servers():
            subprocess.run(self._argv("ready", f"{self.backend}/{server}", "--timeout", "120"), timeout=150)
        log("notice cleared: replicas ready again")


def system_stopping() -> bool:
    try:
        state = subprocess.run(["systemctl", "is-system-running"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return False
    return state.stdout.strip() == "stopping"


def run(replicas: Replicas, grace: float, state_file: str | None, stop: threading.Event) -> None:
    events: queue.Queue = queue.Queue()
    for key in KEYS:
        threading.Thread(target=watch_key, args=(key, events, stop), daemon=True).start()
    values: dict[str, str] = {}
    draining: str | None = None

    def on_term(signum, frame) -> None:
        # Shutdown without a notice (queued resource deleted, flex-start over): drain before HAProxy goes.
        if draining is None and system_stopping():
            log("system is shutting down: draining")
            replicas.drain(grace)
        stop.set()
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_term)
    log(f"watching {', '.join(KEYS)} at {hostlib.METADATA_URL} (grace {grace:.0f} s)")
    while not stop.is_set():
        try:
            key, value = events.get(timeout=1)
        except queue.Empty:
            continue
        values[key] = value
        notice = is_notice(values)
        if notice and draining is None:
            draining = notice
            log(f"notice: {notice}: draining every replica of {replicas.backend}")
            if state_file:
                with open(state_file, "w") as marker:
                    marker.write(f"{notice} {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n")
            replicas.drain(grace)
        elif notice is None and draining is not None:
            log(f"{draining} cleared")
            draining = None
            replicas.ready()
            # The marker goes last: while it exists, a replica may still be out of rotation.
            if state_file and os.path.exists(state_file):
                os.remove(state_file)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="preemption_drain.py")
    parser.add_argument("--grace", type=float, default=25, help="Seconds in-flight requests get after a notice.")
    parser.add_argument("--haproxy-admin", default="/opt/gemmaserve/lib/haproxy_admin.py")
    parser.add_argument("--backend", default="vllm")
    parser.add_argument("--socket", default=None, help="HAProxy admin socket (haproxy_admin.py's default if unset).")
    parser.add_argument("--state-file", default=None, help="Written while a notice is in force.")
    args = parser.parse_args(argv)
    run(Replicas(args.haproxy_admin, args.backend, args.socket), args.grace, args.state_file, threading.Event())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
