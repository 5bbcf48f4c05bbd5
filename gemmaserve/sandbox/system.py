"""Running commands on the outer machine and collecting the child processes the sandbox starts."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable

Log = Callable[[str], None]


def plain_log(message: str) -> None:
    print(f"sandbox: {message}", flush=True)


def run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc


def reap(pid: int) -> None:
    # When the nspawn process is our own child (pytest), collect it so it does not linger as a zombie.
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
