"""The systemd-nspawn process of a sandbox host: start, boot, probes, commands inside, stop, files."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path

from gemmaserve.sandbox import state
from gemmaserve.sandbox.cgroups import cgroup_pids
from gemmaserve.sandbox.state import Host
from gemmaserve.sandbox.system import Log, reap, run

BOOT_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0


def is_alive(host: Host) -> bool:
    """True when the recorded PID is still this host's systemd-nspawn (not a reused PID)."""
    if not host.pid:
        return False
    reap(host.pid)
    try:
        cmdline = Path(f"/proc/{host.pid}/cmdline").read_bytes().split(b"\0")
        status = Path(f"/proc/{host.pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    zombie = status.rsplit(")", 1)[1].split()[0] == "Z"
    return not zombie and b"systemd-nspawn" in cmdline[0] and f"--machine={host.name}".encode() in cmdline


def leader_pid(host: Host) -> int | None:
    """The host's PID 1 (systemd) as seen from the outer machine: nspawn's child."""
    if not host.pid:
        return None
    try:
        children = Path(f"/proc/{host.pid}/task/{host.pid}/children").read_text().split()
    except FileNotFoundError:
        return None
    return int(children[0]) if children else None


def in_host(host: Host, *cmd: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run a command inside a running host through its namespaces (no ssh needed)."""
    leader = leader_pid(host)
    if leader is None:
        raise RuntimeError(f"{host.name} has no running PID 1")
    return subprocess.run(
        ["nsenter", f"--target={leader}", "--mount", "--uts", "--ipc", "--net", "--pid", "--root", "--wd", "--", *cmd],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"},
    )


def nspawn_command(host: Host, binds: list[str]) -> list[str]:
    cmd = [
        "systemd-nspawn",
        f"--machine={host.name}",
        f"--directory={host.rootfs}",
        "--boot",
        # The outer machine has no systemd: no machined to register with, no unit to create.
        "--register=no",
        "--keep-unit",
        # The console is a pseudo-TTY that nspawn drains into console.log. "passive" leaves it unread: once
        # its buffer fills (systemd's "A stop job is running..." lines during a long stop fill it within
        # minutes) PID 1 blocks in the TTY write and the host never finishes shutting down.
        "--console=read-only",
        f"--network-namespace-path=/run/netns/{host.netns}",
        "--resolv-conf=copy-host",
        "--link-journal=no",
        "--settings=no",
    ]
    for bind in binds:
        src, _, dst = bind.partition(":")
        cmd.append(f"--bind-ro={src}:{dst or src}")
    return cmd


def start_nspawn(host: Host, binds: list[str]) -> int:
    cgroups = list(host.cgroups)

    def join_cgroups() -> None:
        # Runs in the child between fork and exec: nspawn starts life in the host's own cgroups.
        for path in cgroups:
            with open(os.path.join(path, "cgroup.procs"), "w") as procs:
                procs.write(str(os.getpid()))

    with open(host.console_log, "ab") as console:
        proc = subprocess.Popen(
            nspawn_command(host, binds),
            stdin=subprocess.DEVNULL,
            stdout=console,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=join_cgroups,
            close_fds=True,
        )
    return proc.pid


def wait_booted(host: Host, log: Log, timeout: float = BOOT_TIMEOUT_S) -> str:
    """Wait for `systemctl is-system-running` to settle and sshd to answer; return the system state."""
    started = time.monotonic()
    deadline = started + timeout
    system = "offline"
    while time.monotonic() < deadline:
        if not is_alive(host):
            raise RuntimeError(f"{host.name}: systemd-nspawn exited during boot:\n{console_tail(host)}")
        try:
            system = in_host(host, "systemctl", "is-system-running", timeout=5).stdout.strip() or "offline"
        except (RuntimeError, subprocess.TimeoutExpired):
            system = "offline"
        if system in ("running", "degraded") and _ssh_answers(host.address):
            break
        time.sleep(0.2)
    else:
        raise RuntimeError(f"{host.name}: not booted after {timeout:.0f} s (system {system}):\n{console_tail(host)}")
    if system == "degraded":
        failed = in_host(host, "systemctl", "--failed", "--plain", "--no-legend").stdout.split("\n")
        units = ", ".join(line.split()[0] for line in failed if line.strip())
        log(f"{host.name}: system is degraded; failed units: {units}")
    elapsed = time.monotonic() - started
    log(f"{host.name}: booted ({system}), sshd answers on {host.address}:{state.SSH_PORT} after {elapsed:.1f} s")
    return system


def _ssh_answers(address: str) -> bool:
    try:
        with socket.create_connection((address, state.SSH_PORT), timeout=1) as sock:
            sock.settimeout(1)
            return sock.recv(64).startswith(b"SSH-")
    except OSError:
        return False


def console_tail(host: Host, lines: int = 30) -> str:
    """The last lines the host's systemd wrote to its console (what a stuck boot or shutdown is waiting for)."""
    try:
        with host.console_log.open("rb") as console:
            console.seek(max(0, console.seek(0, os.SEEK_END) - 65536))
            text = console.read().decode(errors="replace")
    except FileNotFoundError:
        return "(no console log)"
    return "\n".join(text.splitlines()[-lines:])


def stop_nspawn(host: Host, log: Log) -> None:
    """SIGTERM lets systemd power off cleanly; SIGKILL after STOP_TIMEOUT_S."""
    if not is_alive(host):
        return
    started = time.monotonic()
    os.kill(host.pid, signal.SIGTERM)
    while is_alive(host) and time.monotonic() - started < STOP_TIMEOUT_S:
        time.sleep(0.1)
    if is_alive(host):
        log(f"{host.name}: no clean poweroff after {STOP_TIMEOUT_S:.0f} s, sending SIGKILL")
        os.kill(host.pid, signal.SIGKILL)
        while is_alive(host):
            time.sleep(0.1)
    else:
        log(f"{host.name}: powered off in {time.monotonic() - started:.1f} s")


def _mounts_under(path: Path) -> list[str]:
    prefix = str(path.resolve()).rstrip("/") + "/"
    return [
        line.split()[4]
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if (line.split()[4] + "/").startswith(prefix)
    ]


def remove_files(host: Host) -> None:
    remove_tree(Path(host.root))


def remove_tree(root: Path) -> None:
    """rm -r that first detaches any mount below root and refuses if one stays."""
    if not root.exists():
        return
    # Never recurse into a bind mount: that would delete the outer machine's files.
    for mount in sorted(_mounts_under(root), key=len, reverse=True):
        run("umount", "-l", mount, check=False)
    if _mounts_under(root):
        raise RuntimeError(f"{root} still has mounts; not removing it")
    shutil.rmtree(root)


def host_rss_bytes(host: Host) -> int:
    """Resident memory of every process in the host's cgroups (systemd-nspawn included)."""
    total = 0
    for pid in cgroup_pids(host.cgroups):
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except FileNotFoundError:
            pass
    return total


def endpoint(host: Host) -> str | None:
    """The load balancer's OpenAI base URL once it answers GET /health over TLS (verified against the
    sandbox's CA), else None.

    Probing (0.5 s at most) rather than trusting a flag a deploy wrote keeps the answer true
    when the load balancer is gone or was never deployed. Only running hosts are probed: a
    dead host's address has no veth route, and the probe must never leave the machine.
    """
    if not is_alive(host) or not Path(f"/sys/class/net/{host.veth}").exists():
        return None
    from gemmaserve.sandbox import credentials

    _, ca_cert = credentials.existing(host.name)
    if ca_cert is None:
        return None
    base = f"https://{host.address}:{state.LB_PORT}"
    context = ssl.create_default_context(cafile=ca_cert)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context))
    try:
        with opener.open(f"{base}/health", timeout=0.5) as response:
            return f"{base}/v1" if response.status == 200 else None
    except OSError:
        return None


def remove_image_lock(host: Host) -> None:
    # systemd-nspawn locks its --directory by inode and leaves the lock (and its mount
    # propagation directory) behind when it is killed.
    try:
        Path(f"/run/systemd/nspawn/propagate/{host.name}").rmdir()
    except OSError:
        pass
    try:
        image = host.rootfs.stat()
    except FileNotFoundError:
        return
    Path(f"/run/systemd/nspawn/locks/inode-{image.st_dev}:{image.st_ino}").unlink(missing_ok=True)
