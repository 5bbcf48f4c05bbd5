"""Drain and re-enable a replica in HAProxy through its admin socket, for rolling restarts.

Runs on serving hosts as a standalone script (stdlib only), from the replicas role:

    python3 haproxy_admin.py drain vllm/replica0 [--timeout S]   # no new requests; wait until idle
    python3 haproxy_admin.py ready vllm/replica0 [--timeout S]   # take requests again; wait until UP
    python3 haproxy_admin.py ready vllm/replica0 --no-wait       # take requests again once checks pass
    python3 haproxy_admin.py status vllm                         # {"replica0": "UP", ...} as JSON

With no HAProxy answering on its socket (the router is not installed yet, on a first deploy, or HAProxy
is stopping at shutdown) there is nothing to drain and both commands succeed. vllm@.service runs
`drain` before every stop and `ready --no-wait` after every start.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import sys
import time

# Installed beside this program by the base role (roles/_lib/files/hostlib.py).
from hostlib import HAPROXY_SOCKET as SOCKET
from hostlib import haproxy_command as command


def stat_rows(path: str = SOCKET) -> list[dict[str, str]]:
    """`show stat` as one dict per proxy/server row (its CSV header starts with "# ")."""
    return list(csv.DictReader(io.StringIO(command("show stat", path).lstrip("# "))))


def server_stats(backend: str, server: str, path: str = SOCKET) -> dict[str, str] | None:
    return next((row for row in stat_rows(path) if row["pxname"] == backend and row["svname"] == server), None)


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")


def drain(name: str, timeout: float, path: str = SOCKET) -> None:
    backend, server = name.split("/", 1)
    if server_stats(backend, server, path) is None:
        # A replica this deploy adds: HAProxy learns about it when the router role renders its config.
        print(f"{name}: not in HAProxy's config yet, nothing to drain", file=sys.stderr)
        return
    # Weight 0 as well as the drain state: HAProxy still sends a draining server the requests that persist to it,
    # and the router's conversation table (templates/haproxy.cfg.j2) tells a draining replica by its weight.
    command(f"set server {name} weight 0", path)
    command(f"set server {name} state drain", path)

    # Requests already running on it finish; only then may the replica restart.
    def idle() -> bool:
        stats = server_stats(backend, server, path)
        return int(stats["scur"] or 0) == 0 and int(stats["qcur"] or 0) == 0

    _wait(idle, timeout, f"{name} to go idle")
    print(f"{name}: drained", file=sys.stderr)


def ready(name: str, timeout: float, path: str = SOCKET, wait: bool = True) -> None:
    backend, server = name.split("/", 1)
    if server_stats(backend, server, path) is None:
        print(f"{name}: not in HAProxy's config yet; the router role adds it", file=sys.stderr)
        return
    command(f"set server {name} state ready", path)
    command(f"set server {name} weight 100%", path)  # its configured weight again (`drain` set 0)
    if not wait:
        # HAProxy's health check keeps it out of rotation until /health answers.
        print(f"{name}: ready; in rotation once its health check passes", file=sys.stderr)
        return
    _wait(lambda: server_stats(backend, server, path)["status"].startswith("UP"), timeout, f"{name} to be UP")
    print(f"{name}: ready and UP", file=sys.stderr)


def backend_status(backend: str, path: str = SOCKET) -> dict[str, str]:
    return {
        row["svname"]: row["status"]
        for row in stat_rows(path)
        if row["pxname"] == backend and row["svname"] not in ("FRONTEND", "BACKEND")
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="haproxy_admin.py")
    parser.add_argument("action", choices=["drain", "ready", "status"])
    parser.add_argument("server", help="BACKEND/SERVER, e.g. vllm/replica0 (for status: BACKEND)")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--no-wait", action="store_true", help="ready: do not wait for the server to be UP")
    parser.add_argument("--socket", default=SOCKET)
    args = parser.parse_args(argv)
    if not os.path.exists(args.socket):
        print(f"{args.socket} absent: HAProxy not running here yet, nothing to {args.action}", file=sys.stderr)
        return 0
    try:
        if args.action == "status":
            print(json.dumps(backend_status(args.server, args.socket)))
        elif args.action == "drain":
            drain(args.server, args.timeout, args.socket)
        else:
            ready(args.server, args.timeout, args.socket, wait=not args.no_wait)
    except ConnectionRefusedError:
        # The socket file outlives a stopped HAProxy (and a stopping one no longer listens on it).
        print(f"{args.socket}: HAProxy does not answer, nothing to {args.action}", file=sys.stderr)
        if args.action == "status":
            print(json.dumps({}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
