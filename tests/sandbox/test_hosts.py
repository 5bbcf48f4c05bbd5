"""The sandbox host itself: systemd, ssh, network, package settings, isolation, teardown."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from gemmaserve.ops import fleet
from gemmaserve.sandbox import cgroups, lifecycle, machine, network, rootfs, state
from tests.sandbox_fixtures import wait_until

pytestmark = pytest.mark.sandbox

_OUTER_PIP = rootfs.outer_pip_config()
_OUTER_PIP_SETTINGS = sorted(
    (section, key, value) for section, keys in _OUTER_PIP.items() for key, value in keys.items()
)


# --- teardown: runs first (see conftest), on a host of its own -------------------------------


@dataclass
class TornDown:
    host: state.Host
    leader: int | None
    others_up: bool
    ip_forward_before: str | None


@pytest.fixture(scope="module")
def torn_down(fresh_sandbox_host: state.Host) -> TornDown:
    """A host brought up and taken down again through the Python API."""
    host = fresh_sandbox_host
    others = [h for h in state.load_state().hosts if h.name != host.name]
    forward_before = None if others else state.load_state().ip_forward_before
    leader = machine.leader_pid(host)
    assert leader is not None and machine.is_alive(host)
    lifecycle.down([host.name])
    return TornDown(host, leader, bool(state.load_state().hosts), forward_before)


def _pid_exists(pid: int | None) -> bool:
    return pid is not None and Path(f"/proc/{pid}").exists()


@pytest.mark.sandbox_teardown
def test_down_stops_nspawn(torn_down: TornDown) -> None:
    assert not machine.is_alive(torn_down.host)


@pytest.mark.sandbox_teardown
def test_down_stops_the_hosts_pid1(torn_down: TornDown) -> None:
    assert not _pid_exists(torn_down.leader)


@pytest.mark.sandbox_teardown
def test_down_removes_netns(torn_down: TornDown) -> None:
    assert torn_down.host.netns not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@pytest.mark.sandbox_teardown
def test_down_removes_veth(torn_down: TornDown) -> None:
    assert not Path(f"/sys/class/net/{torn_down.host.veth}").exists()


@pytest.mark.sandbox_teardown
@pytest.mark.parametrize("root", cgroups.cgroup_roots(), ids=str)
def test_down_removes_cgroup(torn_down: TornDown, root: Path) -> None:
    assert not (root / "gemmaserve" / torn_down.host.name).exists()


@pytest.mark.sandbox_teardown
def test_down_removes_host_files(torn_down: TornDown) -> None:
    assert not Path(torn_down.host.root).exists()


@pytest.mark.sandbox_teardown
def test_down_of_last_host_removes_nft_table(torn_down: TornDown) -> None:
    if torn_down.others_up:
        pytest.skip("other sandbox hosts are up; the NAT table stays for them")
    assert not network.nft_table_exists()


@pytest.mark.sandbox_teardown
def test_down_of_last_host_removes_the_ca_and_api_key(torn_down: TornDown) -> None:
    from gemmaserve.sandbox import credentials

    if torn_down.others_up:
        pytest.skip("other sandbox hosts are up; their clients still use the sandbox's CA and key")
    assert not credentials.TLS_DIR.exists() and not credentials.API_KEY.exists() and not credentials.KEY_STORE.exists()


@pytest.mark.sandbox_teardown
def test_down_of_last_host_restores_ip_forward(torn_down: TornDown) -> None:
    if torn_down.others_up or torn_down.ip_forward_before is None:
        pytest.skip("other sandbox hosts are up; ip_forward stays on for them")
    assert Path("/proc/sys/net/ipv4/ip_forward").read_text().strip() == torn_down.ip_forward_before


@pytest.mark.sandbox_teardown
def test_down_keeps_nat_while_another_host_is_up(request: pytest.FixtureRequest, sandbox_ready: None) -> None:
    """Its two hosts are taken at the same time by two callers, as make test's two workers take theirs: each gets
    a host of its own (with the free index read outside the sandbox lock, both got the same one, the second
    "already up")."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.sandbox_fixtures import SandboxTeardown

    teardown = SandboxTeardown([])
    request.addfinalizer(teardown)
    with ThreadPoolExecutor(2) as pool:
        taking = [pool.submit(lifecycle.up_new_hosts, 1) for _ in range(2)]
        teardown.names = [h.name for f in taking if not f.exception() for h in f.result()]
    [first], [second] = (f.result() for f in taking)
    assert first.name != second.name, teardown.names
    lifecycle.down([first.name])
    assert network.nft_table_exists()
    lifecycle.down([second.name])
    assert network.nft_table_exists() == bool(state.load_state().hosts)


@pytest.mark.sandbox_teardown
def test_up_removes_a_host_whose_nspawn_died(request: pytest.FixtureRequest, sandbox_ready: None) -> None:
    """A host whose systemd-nspawn is gone (the machine restarted mid-run, or the run was killed) leaves its
    netns, veth, cgroups, files and record; the next `up`, of any host, removes them, so hosts/sandbox.py stops
    listing a host nothing answers on (CI once ran `status` and `verify` on two such hosts and failed)."""
    from tests.sandbox_fixtures import bring_up_new

    dead, alive = bring_up_new(2, request)
    leader = machine.leader_pid(dead)
    assert leader is not None
    os.kill(leader, signal.SIGKILL)  # its PID 1, by the PID recorded for it: the whole host dies at once
    wait_until(lambda: not machine.is_alive(dead), timeout=30, what=f"{dead.name}'s systemd-nspawn to exit")
    assert state.load_state().host(dead.name) is not None
    assert Path(f"/sys/class/net/{dead.veth}").exists() and Path(dead.root).exists()

    lines: list[str] = []
    assert [h.name for h in lifecycle.up_hosts([alive.index], log=lines.append)] == [alive.name]
    print("\n" + "\n".join(lines))
    assert any(line.startswith(f"{dead.name}: found dead") for line in lines), lines
    assert state.load_state().host(dead.name) is None and machine.is_alive(state.load_state().host(alive.name))
    assert dead.netns not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not Path(f"/sys/class/net/{dead.veth}").exists() and not Path(dead.root).exists()
    assert not any((root / "gemmaserve" / dead.name).exists() for root in cgroups.cgroup_roots())
    assert dead.name not in [h.name for h in fleet.load("hosts/sandbox.py")]


# --- a running host ----------------------------------------------------------------------


def test_pid1_is_systemd(sandbox_host) -> None:
    assert sandbox_host.file("/proc/1/comm").content_string.strip() == "systemd"


def test_system_is_running(sandbox_host) -> None:
    assert sandbox_host.run("systemctl is-system-running").stdout.strip() == "running"


def test_console_is_drained_so_pid1_never_blocks_on_it(sandbox_hosts: list[state.Host]) -> None:
    """systemd writes status lines to /dev/console; while a stop job runs it writes one every second. A
    console nobody reads fills its TTY buffer and PID 1 blocks in the write: a shutdown under load then
    never ends (seen in CI as a reboot "still running 240 s" after `systemctl reboot`). Far more than any
    TTY buffer holds must pass through, and arrive in the host's console.log."""
    host = sandbox_hosts[0]
    mark = f"gemmaserve-console-{host.pid}"
    before = host.console_log.stat().st_size
    pad = "x" * 100
    script = f"for i in $(seq 1 4096); do echo '{mark} '$i' {pad}'; done > /dev/console"
    result = machine.in_host(host, "timeout", "30", "sh", "-c", script, timeout=60)
    assert result.returncode == 0, f"writing 400 KiB to /dev/console blocked or failed: {result.stderr}"

    def arrived() -> bool:
        with host.console_log.open("rb") as log:
            log.seek(before)
            return f"{mark} 4096 ".encode() in log.read()

    wait_until(arrived, 30, "the console lines in console.log")


def test_pid1_journal_lines_survive_a_journald_that_falls_behind(sandbox_hosts: list[state.Host]) -> None:
    """PID 1 sends its journal lines as datagrams and drops one it cannot queue quickly. With the kernel's
    10-datagram queue, a shutdown under load on two cores lost systemd's "Stopping …" lines that the reboot
    test reads (a KeyError in CI). Pause journald for a second while PID 1 logs 80 lines: all must arrive."""
    host = sandbox_hosts[0]
    tag = f"gsburst{host.pid}x"
    script = f"""
        pid=$(systemctl show -p MainPID --value systemd-journald)
        kill -STOP $pid
        trap 'kill -CONT $pid' EXIT
        for i in $(seq 1 40); do systemd-run --no-block --quiet --unit={tag}$i true; done
        sleep 1
    """
    result = machine.in_host(host, "timeout", "60", "sh", "-c", script, timeout=90)
    assert result.returncode == 0, result.stderr

    def logged() -> int:
        out = machine.in_host(host, "journalctl", "_PID=1", "-o", "cat", "--no-pager", timeout=60).stdout
        return sum(tag in line for line in out.splitlines())

    # Each transient unit: "Started …" and "… Deactivated successfully.".
    deadline = time.monotonic() + 30
    while (count := logged()) < 80 and time.monotonic() < deadline:
        time.sleep(1)
    assert count >= 80, f"PID 1 logged {count} of 80 lines about 40 transient units: the rest were dropped"


def test_sshd_accepts_the_sandbox_key(sandbox_hosts: list[state.Host]) -> None:
    import paramiko

    client = paramiko.SSHClient()
    client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
    client.connect(
        sandbox_hosts[0].address,
        port=state.SSH_PORT,
        username=state.SSH_USER,
        key_filename=str(state.SSH_KEY),
        look_for_keys=False,
        allow_agent=False,
        timeout=5,
    )
    try:
        _, stdout, _ = client.exec_command("id -un")
        assert stdout.read().decode().strip() == "root"
    finally:
        client.close()


def test_address_is_host_end_of_its_veth(sandbox_host, sandbox_hosts: list[state.Host]) -> None:
    addresses = sandbox_host.interface("host0").addresses
    assert sandbox_hosts[0].address in addresses
    assert re.fullmatch(r"10\.231\.\d+\.2", sandbox_hosts[0].address)


def test_default_route_is_outer_end(sandbox_host, sandbox_hosts: list[state.Host]) -> None:
    assert sandbox_host.run("ip -4 route show default").stdout.split()[2] == sandbox_hosts[0].gateway


def test_host_cannot_reach_the_outer_machine(sandbox_host, sandbox_hosts: list[state.Host]) -> None:
    # Only established traffic comes back from the outer end; a host opens nothing there.
    probe = sandbox_host.run(f"timeout 3 bash -c '</dev/tcp/{sandbox_hosts[0].gateway}/22'")
    assert probe.rc != 0


def test_host_cannot_reach_link_local_metadata(sandbox_host) -> None:
    probe = sandbox_host.run("curl -s -m 2 -o /dev/null http://169.254.169.254/")
    assert probe.rc != 0


def test_pypi_is_trusted_through_the_outer_ca(sandbox_host) -> None:
    # --isolated: no pip.conf, so only the host's CA store (with the outer's extra CAs) is used.
    probe = sandbox_host.run(
        "python3 -m pip download --isolated --no-deps --no-cache-dir -q -d /tmp/pip-probe "
        "--index-url https://pypi.org/simple six"
    )
    assert probe.rc == 0, probe.stderr


@pytest.mark.parametrize(("section", "key", "value"), _OUTER_PIP_SETTINGS, ids=lambda v: str(v)[:40])
def test_pip_setting_carried_over(sandbox_host, section: str, key: str, value: str) -> None:
    assert f"{section}.{key}='{value}'" in sandbox_host.run("python3 -m pip config list").stdout


@pytest.mark.parametrize("path", rootfs.pip_local_paths(_OUTER_PIP))
def test_pip_local_path_bound_read_only(sandbox_host, path: str) -> None:
    mount = sandbox_host.run(f"findmnt -n -o OPTIONS --target {path}").stdout
    assert sandbox_host.file(path).exists and "ro" in mount.split(",")


@pytest.mark.parametrize("unit", rootfs.MASKED_UNITS)
def test_apt_timer_masked(sandbox_host, unit: str) -> None:
    assert sandbox_host.run(f"systemctl is-enabled {unit}").stdout.strip() == "masked"


def test_machine_id_is_fresh(sandbox_host) -> None:
    inside = sandbox_host.file("/etc/machine-id").content_string.strip()
    outer = Path("/etc/machine-id").read_text().strip() if Path("/etc/machine-id").exists() else ""
    assert re.fullmatch(r"[0-9a-f]{32}", inside) and inside != outer


def test_template_machine_id_is_empty(sandbox_ready: None) -> None:
    # Every host unpacks the same template: an id baked into it would be shared by all of them.
    tarball = rootfs.cached_rootfs(lambda message: None)
    machine_id = subprocess.run(
        ["tar", "-I", "zstd", "-xOf", str(tarball), "./etc/machine-id"], capture_output=True, check=True
    )
    assert machine_id.stdout == b""


@pytest.mark.parametrize("root", cgroups.cgroup_roots(), ids=str)
def test_host_runs_in_its_own_cgroup(sandbox_hosts: list[state.Host], root: Path) -> None:
    host = sandbox_hosts[0]
    assert machine.leader_pid(host) in cgroups.cgroup_pids([str(root / "gemmaserve" / host.name)])


def test_status_json_has_the_documented_fields(sandbox_hosts: list[state.Host]) -> None:
    out = subprocess.run(
        [str(Path(sys.executable).parent / "gemmaserve"), "sandbox", "status", "--json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    records = json.loads(out)["hosts"]
    fields = ("address", "api_key", "ca_cert", "endpoint", "name", "ssh_key", "ssh_port", "ssh_user")
    assert {tuple(sorted(r)) for r in records} == {fields}
    # Made when the host came up: the sandbox's key and its CA, for clients of its endpoint.
    record = next(r for r in records if r["name"] == sandbox_hosts[0].name)
    assert record["api_key"].startswith("gsk-") and Path(record["ca_cert"]).read_text().startswith("-----BEGIN")


def test_inventory_lists_the_host(sandbox_hosts: list[state.Host]) -> None:
    data = {host.name: host.data for host in fleet.load("hosts/sandbox.py")}[sandbox_hosts[0].name]
    assert ipaddress.ip_address(data["ssh_hostname"]) == ipaddress.ip_address(sandbox_hosts[0].address)
