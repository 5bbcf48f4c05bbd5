"""Where the sandbox keeps its hosts: the state file, its lock and the paths it names."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

# One sandbox per machine: addresses (10.231.<index>.0/30), netns and veth names are global,
# so every caller (CLI, tests, the pyinfra inventory) shares this directory.
STATE_DIR = Path(os.environ.get("GEMMASERVE_SANDBOX_STATE", "/var/lib/gemmaserve/sandbox"))
STATE_FILE = STATE_DIR / "state.json"
SSH_KEY = STATE_DIR / "id_ed25519"
SSH_USER = "root"
SSH_PORT = 22
SUBNET = "10.231.0.0/16"
LB_PORT = 8080


@dataclass
class Host:
    """One sandbox host as recorded in state.json."""

    name: str
    index: int
    address: str  # the host end of the veth pair (10.231.<index>.2)
    gateway: str  # the outer end (10.231.<index>.1)
    netns: str
    veth: str  # the outer end's interface name; the host end is host0 inside netns
    root: str  # the host's directory: rootfs/, console.log
    pid: int | None = None  # systemd-nspawn, started by us
    cgroups: list[str] = field(default_factory=list)
    bind_ro: list[str] = field(default_factory=list)
    # Seconds each phase of this host's last `up` took: rootfs_s, boot_s, up_s (for the benchmark).
    boot_timings: dict[str, float] = field(default_factory=dict)
    # Host-data keys this host is served with on top of the profile (the demo's engine choice), so
    # later deploys, `verify` and `status` through hosts/sandbox.py plan what it runs.
    host_data: dict = field(default_factory=dict)

    @property
    def rootfs(self) -> Path:
        return Path(self.root) / "rootfs"

    @property
    def console_log(self) -> Path:
        return Path(self.root) / "console.log"

    def ssh_data(self) -> dict:
        """How pyinfra reaches this host: the inventory's ssh_* host data."""
        return {
            "ssh_hostname": self.address,
            "ssh_port": SSH_PORT,
            "ssh_user": SSH_USER,
            "ssh_key": str(SSH_KEY),
            # Host keys are regenerated on every `sandbox up`: remembering them only breaks reconnects.
            "ssh_known_hosts_file": "/dev/null",
            "ssh_strict_host_key_checking": "off",
        }


@dataclass
class State:
    hosts: list[Host] = field(default_factory=list)
    # ip_forward as found before the first host came up, restored after the last goes down.
    ip_forward_before: str | None = None

    def host(self, name: str) -> Host | None:
        return next((h for h in self.hosts if h.name == name), None)


def host_name(index: int) -> str:
    return f"sandbox-{index}"


def set_host_data(name: str, data: dict) -> None:
    """Record the host-data keys `name` is served with (see Host.host_data)."""
    with locked_state() as st:
        host = st.host(name)
        if host is None:
            raise RuntimeError(f"no sandbox host named {name}")
        host.host_data = dict(data)


def free_indices(count: int, start: int = 101, st: State | None = None) -> list[int]:
    """The first `count` host indices from `start` that no host recorded in `st` (else in state.json) uses
    (throwaway hosts for benches and tests start at 101, clear of sandbox-1..N). Read without the lock, two
    processes may get the same ones: `lifecycle.up_new_hosts` picks and takes them under it."""
    taken = {h.name for h in (st or load_state()).hosts}
    free = [i for i in range(start, 255) if host_name(i) not in taken][:count]
    if len(free) < count:
        raise RuntimeError(f"no {count} free sandbox host indices from {start} (at most 254)")
    return free


def new_host(index: int) -> Host:
    name = host_name(index)
    return Host(
        name=name,
        index=index,
        address=f"10.231.{index}.2",
        gateway=f"10.231.{index}.1",
        netns=f"gemmaserve-{name}",
        veth=f"gs-sb{index}",
        root=str(STATE_DIR / "hosts" / name),
    )


def load_state() -> State:
    """Read state.json; a missing file is an empty sandbox. Needs no lock and no root."""
    try:
        raw = json.loads(STATE_FILE.read_text())
    except (FileNotFoundError, PermissionError):
        return State()
    return State(
        hosts=[Host(**h) for h in raw.get("hosts", [])],
        ip_forward_before=raw.get("ip_forward_before"),
    )


def save_state(state: State) -> None:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    state.hosts.sort(key=lambda h: h.index)
    tmp = STATE_FILE.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(state), indent=2) + "\n")
    tmp.replace(STATE_FILE)


@contextlib.contextmanager
def locked_state() -> Iterator[State]:
    """Hold the sandbox lock while reading, changing and saving the state."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(STATE_DIR / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        state = load_state()
        try:
            yield state
        finally:
            save_state(state)
