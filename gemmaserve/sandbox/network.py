"""Each sandbox host's network namespace and veth pair, and the NAT that lets hosts reach package registries only."""

from __future__ import annotations

import subprocess
from pathlib import Path

from gemmaserve.sandbox import bucket, state
from gemmaserve.sandbox.state import Host, State
from gemmaserve.sandbox.system import run

NFT_TABLE = "gemmaserve_sandbox"
UNIX_DGRAM_QLEN = 512
VETH_PATTERN = "gs-sb*"  # every outer veth end is named gs-sb<index>
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


def create_network(host: Host) -> None:
    """A netns joined to the outer machine by a veth pair: outer .1/30, host .2/30 on host0."""
    peer = f"{host.veth}h"
    if not Path(f"/run/netns/{host.netns}").exists():
        run("ip", "netns", "add", host.netns)
    run("ip", "link", "del", host.veth, check=False)
    run("ip", "link", "add", host.veth, "type", "veth", "peer", "name", peer, "netns", host.netns)
    run("ip", "addr", "add", f"{host.gateway}/30", "dev", host.veth)
    run("ip", "link", "set", host.veth, "up")
    ns = ("ip", "-n", host.netns)
    run(*ns, "link", "set", "lo", "up")
    run(*ns, "link", "set", peer, "name", "host0")
    run(*ns, "addr", "add", f"{host.address}/30", "dev", "host0")
    run(*ns, "link", "set", "host0", "up")
    run(*ns, "route", "add", "default", "via", host.gateway)
    # A new netns queues 10 datagrams per Unix socket (the kernel's default; Debian 12 keeps it, systemd's
    # upstream sysctl.d/50-default.conf raises it to 512). PID 1 sends its journal lines as datagrams and
    # gives up on one after a short wait on a full queue, so on two loaded cores, where journald falls
    # behind, a shutdown under load lost systemd's "Stopping …" lines that the reboot test reads (measured:
    # 11 of 80 lines kept with journald paused for 1 s). Inside nspawn /proc/sys/net is read-only to the
    # host's own systemd-sysctl: set 512 here, before the host's sockets exist.
    run("ip", "netns", "exec", host.netns, "sysctl", "-qw", f"net.unix.max_dgram_qlen={UNIX_DGRAM_QLEN}")


def remove_network(host: Host) -> None:
    run("ip", "link", "del", host.veth, check=False)  # takes host0 with it
    run("ip", "netns", "del", host.netns, check=False)


def _default_route_interface() -> str:
    route = run("ip", "-o", "route", "show", "default").stdout.split()
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
        iifname "{VETH_PATTERN}" ip daddr {bucket.ADDRESS} tcp dport {bucket.PORT} accept
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
    run("nft", "delete", "table", "ip", NFT_TABLE, check=False)
    if st.ip_forward_before is not None:
        Path("/proc/sys/net/ipv4/ip_forward").write_text(st.ip_forward_before)
        st.ip_forward_before = None


def nft_table_exists() -> bool:
    return f"table ip {NFT_TABLE}" in run("nft", "list", "tables", check=False).stdout
