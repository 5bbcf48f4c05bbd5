"""Sandbox host lifecycle: cgroups, netns + veth, NAT, systemd-nspawn boot and teardown."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from gemmaserve.sandbox import rootfs, state
from gemmaserve.sandbox.state import Host, State

Log = Callable[[str], None]

NFT_TABLE = "gemmaserve_sandbox"
VETH_PATTERN = "gs-sb*"  # every outer veth end is named gs-sb<index>
# Bound read-only when present: prebuilt vLLM venvs, and locally built test models (the catalog's
# `tiny` model is served from /var/lib/gemmaserve/models/tiny-gemma4).
DEFAULT_BINDS = ("/opt/gemmaserve/venvs", "/var/lib/gemmaserve/models")
BOOT_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
# Private and special ranges a host must not reach through the outer machine; the outer
# machine's nameservers are let through so DNS works.
_BLOCKED_RANGES = (
    "0.0.0.0/8",
    "10.0.0.0/8",
    "100.64.0.0/10",
    "127.0.0.0/8",
    "169.254.0.0/16",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "224.0.0.0/3",
)


def _plain_log(message: str) -> None:
    print(f"sandbox: {message}", flush=True)


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc


# --- cgroups ---------------------------------------------------------------------------


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
    if not path.is_dir():
        return []
    return sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True) + [path]


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
            _reap(pid)
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


# --- network ---------------------------------------------------------------------------


def create_network(host: Host) -> None:
    """A netns joined to the outer machine by a veth pair: outer .1/30, host .2/30 on host0."""
    peer = f"{host.veth}h"
    if not Path(f"/run/netns/{host.netns}").exists():
        _run("ip", "netns", "add", host.netns)
    _run("ip", "link", "del", host.veth, check=False)
    _run("ip", "link", "add", host.veth, "type", "veth", "peer", "name", peer, "netns", host.netns)
    _run("ip", "addr", "add", f"{host.gateway}/30", "dev", host.veth)
    _run("ip", "link", "set", host.veth, "up")
    ns = ("ip", "-n", host.netns)
    _run(*ns, "link", "set", "lo", "up")
    _run(*ns, "link", "set", peer, "name", "host0")
    _run(*ns, "addr", "add", f"{host.address}/30", "dev", "host0")
    _run(*ns, "link", "set", "host0", "up")
    _run(*ns, "route", "add", "default", "via", host.gateway)


def remove_network(host: Host) -> None:
    _run("ip", "link", "del", host.veth, check=False)  # takes host0 with it
    _run("ip", "netns", "del", host.netns, check=False)


def _default_route_interface() -> str:
    route = _run("ip", "-o", "route", "show", "default").stdout.split()
    if "dev" not in route:
        raise RuntimeError("no default route on the outer machine: hosts could not reach the package registries")
    return route[route.index("dev") + 1]


def _nameservers() -> list[str]:
    try:
        lines = Path("/etc/resolv.conf").read_text().splitlines()
    except FileNotFoundError:
        return []
    return [line.split()[1] for line in lines if line.startswith("nameserver") and "." in line.split()[1]]


def nat_ruleset(wan: str, nameservers: list[str]) -> str:
    """Masquerade the sandbox subnet out of the default-route interface, and nothing more."""
    dns = ""
    servers = ", ".join(nameservers)
    for proto in ("udp", "tcp") if nameservers else ():
        dns += f'        iifname "{VETH_PATTERN}" oifname "{wan}" ip daddr {{ {servers} }} {proto} dport 53 accept\n'
    return f"""add table ip {NFT_TABLE}
delete table ip {NFT_TABLE}
table ip {NFT_TABLE} {{
    set blocked {{
        type ipv4_addr; flags interval
        elements = {{ {", ".join(_BLOCKED_RANGES)} }}
    }}
    chain forward {{
        type filter hook forward priority filter; policy accept;
        iifname "{wan}" oifname "{VETH_PATTERN}" ct state established,related accept
        oifname "{VETH_PATTERN}" drop
{dns}        iifname "{VETH_PATTERN}" oifname "{wan}" ip daddr @blocked drop
        iifname "{VETH_PATTERN}" oifname "{wan}" ip saddr {state.SUBNET} accept
        iifname "{VETH_PATTERN}" drop
    }}
    chain input {{
        type filter hook input priority filter; policy accept;
        iifname "{VETH_PATTERN}" ct state established,related accept
        iifname "{VETH_PATTERN}" icmp type echo-request accept
        iifname "{VETH_PATTERN}" drop
    }}
    chain postrouting {{
        type nat hook postrouting priority srcnat; policy accept;
        oifname "{wan}" ip saddr {state.SUBNET} masquerade
    }}
}}
"""


def apply_nat(st: State) -> None:
    forward = Path("/proc/sys/net/ipv4/ip_forward")
    if st.ip_forward_before is None:
        st.ip_forward_before = forward.read_text().strip()
    subprocess.run(
        ["nft", "-f", "-"], input=nat_ruleset(_default_route_interface(), _nameservers()), text=True, check=True
    )
    forward.write_text("1")


def remove_nat(st: State) -> None:
    _run("nft", "delete", "table", "ip", NFT_TABLE, check=False)
    if st.ip_forward_before is not None:
        Path("/proc/sys/net/ipv4/ip_forward").write_text(st.ip_forward_before)
        st.ip_forward_before = None


def nft_table_exists() -> bool:
    return f"table ip {NFT_TABLE}" in _run("nft", "list", "tables", check=False).stdout


# --- processes -------------------------------------------------------------------------


def _reap(pid: int) -> None:
    # When the nspawn process is our own child (pytest), collect it so it does not linger as a zombie.
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def is_alive(host: Host) -> bool:
    """True when the recorded PID is still this host's systemd-nspawn (not a reused PID)."""
    if not host.pid:
        return False
    _reap(host.pid)
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
        "--console=passive",
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
            raise RuntimeError(f"{host.name}: systemd-nspawn exited during boot:\n{_tail(host.console_log)}")
        try:
            system = in_host(host, "systemctl", "is-system-running", timeout=5).stdout.strip() or "offline"
        except (RuntimeError, subprocess.TimeoutExpired):
            system = "offline"
        if system in ("running", "degraded") and _ssh_answers(host.address):
            break
        time.sleep(0.2)
    else:
        raise RuntimeError(
            f"{host.name}: not booted after {timeout:.0f} s (system {system}):\n{_tail(host.console_log)}"
        )
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


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no console log)"


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
        _run("umount", "-l", mount, check=False)
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


# --- the sandbox as a whole ------------------------------------------------------------


@dataclass
class HostStatus:
    name: str
    address: str
    ssh_port: int
    ssh_user: str
    ssh_key: str
    endpoint: str | None
    running: bool
    pid: int | None

    def public(self) -> dict[str, object]:
        """The record `sandbox status --json` prints."""
        return {k: getattr(self, k) for k in ("name", "address", "ssh_port", "ssh_user", "ssh_key", "endpoint")}


def endpoint(host: Host) -> str | None:
    """The load balancer's OpenAI base URL once it answers GET /health, else None.

    Probing (0.5 s at most) rather than trusting a flag a deploy wrote keeps the answer true
    when the load balancer is gone or was never deployed. Only running hosts are probed: a
    dead host's address has no veth route, and the probe must never leave the machine.
    """
    if not is_alive(host) or not Path(f"/sys/class/net/{host.veth}").exists():
        return None
    base = f"http://{host.address}:{state.LB_PORT}"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"{base}/health", timeout=0.5) as response:
            return f"{base}/v1" if response.status == 200 else None
    except OSError:
        return None


def status() -> list[HostStatus]:
    return [
        HostStatus(
            h.name, h.address, state.SSH_PORT, state.SSH_USER, str(state.SSH_KEY), endpoint(h), is_alive(h), h.pid
        )
        for h in state.load_state().hosts
    ]


def _ensure_ssh_key() -> str:
    """One ed25519 key per sandbox, in the state directory; returns the public key line."""
    public = state.SSH_KEY.with_suffix(".pub")
    if state.SSH_KEY.exists() and public.exists():
        return public.read_text()
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    line = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()
    state.SSH_KEY.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(state.SSH_KEY, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(private)
    public.write_text(f"{line} gemmaserve-sandbox\n")
    return public.read_text()


def _binds(extra: Iterable[str], pip_config: dict[str, dict[str, str]]) -> list[str]:
    binds = [b for b in DEFAULT_BINDS if os.path.isdir(b)]
    binds += rootfs.pip_local_paths(pip_config)
    for bind in extra:
        src = bind.partition(":")[0]
        if not os.path.exists(src):
            raise FileNotFoundError(f"--bind-ro {src}: no such file or directory")
        binds.append(bind)
    return list(dict.fromkeys(binds))


def check_prerequisites() -> list[str]:
    """What stops sandbox hosts from running here (empty when nothing does)."""
    problems = []
    if os.geteuid() != 0:
        problems.append("sandbox hosts need root (netns, veth, cgroups, systemd-nspawn)")
    if not Path("/proc/self/mounts").read_text().count("cgroup"):
        problems.append("no cgroup hierarchy is mounted")
    return problems


def up(hosts: int = 1, bind_ro: Iterable[str] = (), log: Log = _plain_log) -> list[Host]:
    """Bring sandbox-1..sandbox-N up; hosts already running are left alone (idempotent)."""
    return up_hosts(range(1, hosts + 1), bind_ro=bind_ro, log=log)


def up_hosts(indices: Iterable[int], bind_ro: Iterable[str] = (), log: Log = _plain_log) -> list[Host]:
    problems = check_prerequisites()
    if problems:
        raise RuntimeError("; ".join(problems))
    indices = list(indices)
    if any(not 1 <= i <= 254 for i in indices):
        raise ValueError("host indices run from 1 to 254 (10.231.<index>.0/30)")
    rootfs.ensure_outer_tools(log)
    ready: list[Host] = []
    try:
        with state.locked_state() as st:
            wanted = []
            for index in indices:
                existing = st.host(state.host_name(index))
                if existing and is_alive(existing):
                    log(f"{existing.name}: already up at {existing.address} (pid {existing.pid})")
                    ready.append(existing)
                    continue
                if existing:
                    log(f"{existing.name}: found dead, cleaning up before starting it again")
                    _teardown(existing, log)
                    st.hosts.remove(existing)
                wanted.append(state.new_host(index))
            try:
                if wanted:
                    _bring_up_all(wanted, st, bind_ro, log)
                    ready += wanted
            finally:
                if not st.hosts:
                    _release_sandbox(st)  # a failed first `up` leaves nothing behind
    finally:
        _remove_empty_state()
    return sorted(ready, key=lambda h: h.index)


def _bring_up_all(wanted: list[Host], st: State, bind_ro: Iterable[str], log: Log) -> None:
    tarball = rootfs.cached_rootfs(log)
    public_key = _ensure_ssh_key()
    pip_config = rootfs.outer_pip_config()
    pip_conf = rootfs.render_pip_conf(pip_config)
    binds = _binds(bind_ro, pip_config)
    apply_nat(st)
    for host in wanted:
        st.hosts.append(host)
        host.bind_ro = binds
        try:
            _bring_up(host, tarball, public_key, pip_conf, st, log)
        except BaseException:
            log(f"{host.name}: failed to come up; tearing it down")
            _teardown(host, log)
            st.hosts.remove(host)
            raise


# Seconds spent per phase by the last `up` of each host in this process (for the benchmark).
UP_TIMINGS: dict[str, dict[str, float]] = {}


def _bring_up(host: Host, tarball: Path, public_key: str, pip_conf: str, st: State, log: Log) -> None:
    started = time.monotonic()
    remove_files(host)
    rootfs.unpack_rootfs(tarball, host.rootfs)
    rootfs.customize_host(host.rootfs, host.name, public_key, pip_conf)
    rootfs_s = time.monotonic() - started
    log(f"{host.name}: rootfs ready in {rootfs_s:.1f} s")
    host.cgroups = create_cgroups(host.name)
    create_network(host)
    state.save_state(st)  # record what exists before starting, so `down` can always clean up
    host.pid = start_nspawn(host, host.bind_ro)
    state.save_state(st)
    log(f"{host.name}: systemd-nspawn started (pid {host.pid}), binds: {', '.join(host.bind_ro) or 'none'}")
    booting = time.monotonic()
    wait_booted(host, log)
    done = time.monotonic()
    UP_TIMINGS[host.name] = {"rootfs_s": rootfs_s, "boot_s": done - booting, "up_s": done - started}
    log(f"{host.name}: up in {done - started:.1f} s; ssh with `gemmaserve sandbox ssh {host.name}`")


def _teardown(host: Host, log: Log) -> None:
    stop_nspawn(host, log)
    remove_cgroups(host.cgroups or [str(root / "gemmaserve" / host.name) for root in cgroup_roots()])
    remove_network(host)
    _remove_image_lock(host)
    remove_files(host)


def _remove_image_lock(host: Host) -> None:
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


def reboot(name: str, log: Log = _plain_log, timeout: float = STOP_TIMEOUT_S) -> Host:
    """Reboot a host as a machine reboots: systemd inside shuts everything down, nspawn exits (as it
    does on a container reboot, status 133), and the same rootfs boots again with fresh tmpfs mounts
    (/dev/shm, /run), the same address, cgroups and binds."""
    with state.locked_state() as st:
        host = st.host(name)
        if host is None or not is_alive(host):
            raise RuntimeError(f"{name} is not running")
        started = time.monotonic()
        in_host(host, "systemctl", "reboot")
        while is_alive(host) and time.monotonic() - started < timeout:
            time.sleep(0.1)
        if is_alive(host):
            raise RuntimeError(f"{name}: still running {timeout:.0f} s after `systemctl reboot`")
        _remove_image_lock(host)
        host.pid = start_nspawn(host, host.bind_ro)
        state.save_state(st)
        wait_booted(host, log)
        log(f"{name}: rebooted in {time.monotonic() - started:.1f} s")
        return host


def down(names: Iterable[str] | None = None, log: Log = _plain_log) -> None:
    """Stop and remove the named hosts (all when None); the last one out removes NAT and state."""
    if not state.STATE_FILE.exists():
        log("no sandbox hosts")
        return
    with state.locked_state() as st:
        names = [h.name for h in st.hosts] if names is None else list(names)
        for name in names:
            host = st.host(name)
            if host is None:
                log(f"{name}: not in the sandbox")
                continue
            _teardown(host, log)
            st.hosts.remove(host)
            log(f"{name}: removed")
        if not st.hosts:
            _release_sandbox(st)
            log("sandbox is empty: NAT table removed, ip_forward restored, state removed")
    _remove_empty_state()


def _release_sandbox(st: State) -> None:
    """What the last host leaves behind: the NAT table, ip_forward, the ssh key, hosts/."""
    remove_nat(st)
    for leftover in (state.SSH_KEY, state.SSH_KEY.with_suffix(".pub")):
        leftover.unlink(missing_ok=True)
    shutil.rmtree(state.STATE_DIR / "hosts", ignore_errors=True)
    # systemd-nspawn's own runtime directories, created on first use; removed only when empty.
    for empty in ("nspawn/propagate", "nspawn/locks", "nspawn"):
        try:
            Path("/run/systemd", empty).rmdir()
        except OSError:
            pass


def _remove_empty_state() -> None:
    if state.load_state().hosts:
        return
    for leftover in (state.STATE_FILE, state.STATE_DIR / "lock"):
        leftover.unlink(missing_ok=True)
    try:
        state.STATE_DIR.rmdir()
    except OSError:
        pass
