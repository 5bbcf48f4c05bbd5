"""Tell loading from failing: run as a replica unit's ExecStartPost, it reports the replica's phase as the
unit's status line ("loading" while vLLM reads weights, "compiling (N new kernels)" while it writes compile
cache files, "ready" once /health answers) and returns only then, so the unit is `activating` until the
replica serves and `active` means ready. A replica that dies is seen by systemd itself (Restart=).

Runs on serving hosts as a standalone script (stdlib only):

    python3 replica_ready.py HEALTH_URL [CACHE_DIR ...]
"""

from __future__ import annotations

import os
import sys
import time
import urllib.error

# Installed beside this program by the base role (roles/_lib/files/hostlib.py).
from hostlib import NO_PROXY, sd_notify

KERNEL_SUFFIXES = (".so", ".cpp", ".cubin", ".ptx", ".py", ".json", ".neff")


def healthy(url: str) -> bool:
    try:
        with NO_PROXY.open(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def new_files(dirs: list[str], since: float) -> int:
    """Compile-cache files written after `since`: kernels being built, not restored ones (those keep their time)."""
    count = 0
    for root in dirs:
        for folder, _, files in os.walk(root):
            for name in files:
                if name.endswith(KERNEL_SUFFIXES):
                    try:
                        count += os.stat(os.path.join(folder, name)).st_mtime > since
                    except OSError:
                        pass
    return count


def phase(compiled: int) -> str:
    return f"compiling ({compiled} new compile-cache files)" if compiled else "loading model"


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: replica_ready.py HEALTH_URL [CACHE_DIR ...]", file=sys.stderr)
        return 2
    url, dirs = argv[0], argv[1:]
    started, last = time.time(), None
    while not healthy(url):
        current = phase(new_files(dirs, started))
        if current != last:
            sd_notify(f"STATUS={current}")
            print(f"gemmaserve: {current}", file=sys.stderr, flush=True)
            last = current
        time.sleep(1)
    sd_notify(f"STATUS=ready ({time.time() - started:.0f} s after start)")
    print(f"gemmaserve: ready after {time.time() - started:.0f} s", file=sys.stderr, flush=True)
    time.sleep(0.2)  # let systemd read the datagram while this process is still in the unit's cgroup
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
