"""The sandbox as a whole: bring hosts up (rootfs, cgroups, network, nspawn), reboot them, take them down."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from gemmaserve.sandbox import cgroups, credentials, machine, network, rootfs, state
from gemmaserve.sandbox.image import IMAGES_DIR
from gemmaserve.sandbox.state import Host, State
from gemmaserve.sandbox.system import Log, plain_log

# Bound read-only when present: prebuilt vLLM venvs, locally built test models (the catalog's `tiny`
# model is served from /var/lib/gemmaserve/models/tiny-gemma4) and the locally built serving image.
DEFAULT_BINDS = ("/opt/gemmaserve/venvs", "/var/lib/gemmaserve/models", str(IMAGES_DIR))


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

    api_key: str | None = None
    ca_cert: str | None = None

    def public(self) -> dict[str, object]:
        """The record `sandbox status --json` prints: how to reach the host and call its endpoint."""
        keys = ("name", "address", "ssh_port", "ssh_user", "ssh_key", "endpoint", "api_key", "ca_cert")
        return {k: getattr(self, k) for k in keys}


def status() -> list[HostStatus]:
    return [
        HostStatus(
            h.name,
            h.address,
            state.SSH_PORT,
            state.SSH_USER,
            str(state.SSH_KEY),
            machine.endpoint(h),
            machine.is_alive(h),
            h.pid,
            *credentials.existing(h.name),
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


def up(hosts: int = 1, bind_ro: Iterable[str] = (), log: Log = plain_log) -> list[Host]:
    """Bring sandbox-1..sandbox-N up; hosts already running are left alone (idempotent)."""
    return up_hosts(range(1, hosts + 1), bind_ro=bind_ro, log=log)


def up_hosts(indices: Iterable[int], bind_ro: Iterable[str] = (), log: Log = plain_log) -> list[Host]:
    indices = list(indices)
    if any(not 1 <= i <= 254 for i in indices):
        raise ValueError("host indices run from 1 to 254 (10.231.<index>.0/30)")
    return _up(lambda st: indices, bind_ro, log)


def up_new_hosts(count: int, bind_ro: Iterable[str] = (), log: Log = plain_log) -> list[Host]:
    """`count` new hosts at the first free indices from 101, picked and taken under the sandbox lock, so two
    processes bringing hosts up at once (make test's two workers) never pick the same index. All or none: a
    host that fails to come up takes down the ones this call brought up before it."""
    taken: list[int] = []

    def pick(st: State) -> list[int]:
        taken[:] = state.free_indices(count, st=st)
        return taken

    try:
        return _up(pick, bind_ro, log)
    except BaseException:
        recorded = state.load_state()
        if up := [state.host_name(i) for i in taken if recorded.host(state.host_name(i))]:
            down(up, log)
        raise


def _up(pick: Callable[[State], list[int]], bind_ro: Iterable[str], log: Log) -> list[Host]:
    """Bring up the indices `pick` chooses from the state, under the sandbox lock."""
    problems = check_prerequisites()
    if problems:
        raise RuntimeError("; ".join(problems))
    rootfs.ensure_outer_tools(log)
    ready: list[Host] = []
    try:
        with state.locked_state() as st:
            _remove_dead(st, log)
            indices = pick(st)
            wanted = []
            for index in indices:
                existing = st.host(state.host_name(index))
                if existing:
                    log(f"{existing.name}: already up at {existing.address} (pid {existing.pid})")
                    ready.append(existing)
                    continue
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


def _remove_dead(st: State, log: Log) -> None:
    """Remove every recorded host whose systemd-nspawn is gone (the machine rebooted, or a run was killed):
    its netns, veth, cgroups and files, and its record, which would otherwise stay in hosts/sandbox.py as a
    host nothing answers on. Under the sandbox lock no host is between its stop and start (a reboot holds it)."""
    for host in [h for h in st.hosts if not machine.is_alive(h)]:
        log(f"{host.name}: found dead (its systemd-nspawn, pid {host.pid}, is gone); removing what it left")
        _teardown(host, log)
        st.hosts.remove(host)
        state.save_state(st)


def _bring_up_all(wanted: list[Host], st: State, bind_ro: Iterable[str], log: Log) -> None:
    tarball = rootfs.cached_rootfs(log)
    public_key = _ensure_ssh_key()
    pip_config = rootfs.outer_pip_config()
    pip_conf = rootfs.render_pip_conf(pip_config)
    binds = _binds(bind_ro, pip_config)
    network.apply_nat(st)
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


def _bring_up(host: Host, tarball: Path, public_key: str, pip_conf: str, st: State, log: Log) -> None:
    started = time.monotonic()
    machine.remove_files(host)
    rootfs.unpack_rootfs(tarball, host.rootfs)
    rootfs.customize_host(host.rootfs, host.name, public_key, pip_conf)
    rootfs_s = time.monotonic() - started
    log(f"{host.name}: rootfs ready in {rootfs_s:.1f} s")
    # Its certificate (from the sandbox's CA) and the sandbox's API key, which its deploy installs.
    credentials.ensure(host)
    host.cgroups = cgroups.create_cgroups(host.name)
    network.create_network(host)
    state.save_state(st)  # record what exists before starting, so `down` can always clean up
    host.pid = machine.start_nspawn(host, host.bind_ro)
    state.save_state(st)
    log(f"{host.name}: systemd-nspawn started (pid {host.pid}), binds: {', '.join(host.bind_ro) or 'none'}")
    booting = time.monotonic()
    machine.wait_booted(host, log)
    done = time.monotonic()
    host.boot_timings = {"rootfs_s": rootfs_s, "boot_s": done - booting, "up_s": done - started}
    state.save_state(st)
    log(f"{host.name}: up in {done - started:.1f} s; ssh with `gemmaserve sandbox ssh {host.name}`")


def _teardown(host: Host, log: Log) -> None:
    machine.stop_nspawn(host, log)
    cgroups.remove_cgroups(host.cgroups or [str(root / "gemmaserve" / host.name) for root in cgroups.cgroup_roots()])
    network.remove_network(host)
    machine.remove_image_lock(host)
    machine.remove_files(host)


def reboot(
    name: str,
    log: Log = plain_log,
    timeout: float = machine.STOP_TIMEOUT_S,
    boot_timeout: float = machine.BOOT_TIMEOUT_S,
) -> Host:
    """Reboot a host as a machine reboots: systemd inside shuts everything down, nspawn exits (as it
    does on a container reboot, status 133), and the same rootfs boots again with fresh tmpfs mounts
    (/dev/shm, /run), the same address, cgroups and binds. `timeout` bounds the shutdown, `boot_timeout` the
    boot, which ends when every start job has (replicas that load a model included)."""
    with state.locked_state() as st:
        host = st.host(name)
        if host is None or not machine.is_alive(host):
            raise RuntimeError(f"{name} is not running")
        started = time.monotonic()
        machine.in_host(host, "systemctl", "reboot")
        while machine.is_alive(host) and time.monotonic() - started < timeout:
            time.sleep(0.1)
        if machine.is_alive(host):
            raise RuntimeError(
                f"{name}: still running {timeout:.0f} s after `systemctl reboot`; its console:\n"
                f"{machine.console_tail(host)}"
            )
        machine.remove_image_lock(host)
        host.pid = machine.start_nspawn(host, host.bind_ro)
        state.save_state(st)
        machine.wait_booted(host, log, boot_timeout)
        log(f"{name}: rebooted in {time.monotonic() - started:.1f} s")
        return host


def down(names: Iterable[str] | None = None, log: Log = plain_log) -> None:
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
    """What the last host leaves behind: the NAT table, ip_forward, the ssh key, the CA and API key, hosts/."""
    network.remove_nat(st)
    for leftover in (state.SSH_KEY, state.SSH_KEY.with_suffix(".pub")):
        leftover.unlink(missing_ok=True)
    credentials.remove()
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
