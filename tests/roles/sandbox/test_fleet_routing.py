"""Two sandbox hosts deployed together as one fleet (host data gemmaserve_fleet): whichever host's endpoint a
conversation enters by, its turns reach one host's vLLM replica, whose prefix cache serves the later turns. The
hosts are the session's two bucket hosts (tests/sandbox_fixtures.py): joining a fleet changes only their routers
(a reload, no replica restarts), and afterwards each is deployed back on its own for the modules after this one;
two hosts of its own cost this module about 200 s more."""

from __future__ import annotations

import contextlib
import re
import subprocess
import time

import pytest

from gemmaserve.ops import fleet as pyinfra_fleet
from gemmaserve.ops.status import metric_sums
from gemmaserve.plan import fleet_peer_port
from gemmaserve.sandbox import state
from gemmaserve.sandbox.network import NFT_TABLE
from gemmaserve.sandbox.profile import OVERRIDE_ENV
from tests.sandbox_fixtures import BucketHosts, deploy, poll, sandbox_endpoint, wait_until

pytestmark = pytest.mark.sandbox

FLEET = "fleet-routing-test"
# The hosts of this test only, with the fleet's host data (the sandbox's inventory, hosts/sandbox.py, gives every
# host the same override data: a fleet needs each host's own address).
INVENTORY = """
from hosts.sandbox import sandbox as _every

fleet = [
    (name, {{**data, **{extra!r}, "gemmaserve_fleet": {fleet!r}, "gemmaserve_private_address": data["ssh_hostname"]}})
    for name, data in _every
    if name in {names!r}
]
"""
# A system prompt of a few hundred tokens (more than one of the CPU backend's 128-token KV blocks), under the
# sandbox profile's max_model_len of 1,024 with four turns.
SYSTEM = " ".join(f"Rule {n}: answer the fleet routing test briefly and never mention rule {n + 1}." for n in range(10))


@contextlib.contextmanager
def peer_port_open_between(hosts: list[state.Host], port: int):
    """The sandbox keeps its hosts apart (gemmaserve/sandbox/network.py drops whatever is forwarded into a host's
    veth). For this test only, let these hosts reach each other on `port`, and the answers back; removed after."""
    veths = ", ".join(f'"{host.veth}"' for host in hosts)
    rules = [
        f"iifname {{ {veths} }} oifname {{ {veths} }} ct state established,related accept",
        f"iifname {{ {veths} }} oifname {{ {veths} }} tcp dport {port} accept",
    ]
    handles = []
    try:
        for rule in rules:
            added = subprocess.run(
                ["nft", "--echo", "--handle", "insert", "rule", "ip", NFT_TABLE, "forward", rule],
                capture_output=True,
                text=True,
                check=True,
            )
            handles.append(re.search(r"# handle (\d+)", added.stdout).group(1))
        yield
    finally:
        for handle in handles:
            subprocess.run(["nft", "delete", "rule", "ip", NFT_TABLE, "forward", "handle", handle], check=False)


def ring_up(remote) -> bool:
    """Both hosts UP in this host's backend fleet (read with the router's own haproxy_admin)."""
    script = "import sys; sys.path.insert(0, '/opt/gemmaserve/lib'); import haproxy_admin; print(haproxy_admin.backend_status('fleet'))"
    states = remote.check_output(f'python3 -c "{script}"')
    return states.count("'UP") == 2


def wait_for_ring(hosts: list[state.Host], remotes: list, plan) -> None:
    """Both hosts UP in each host's ring. A replica that a loaded machine took down (its check timed out, or it
    restarted) is back once vLLM answers: on this 2-core machine a CPU replica's restart, beside another module's
    load test, has taken over 120 s. Fails after 300 s with what each host's HAProxy checks, its peer's /health
    and its replica unit say."""
    unit, peer_port = plan.replicas[0].unit, fleet_peer_port(plan.router_port)
    for host, remote in zip(hosts, remotes, strict=True):
        if poll(lambda remote=remote: ring_up(remote), 300):
            continue
        script = (
            "import sys; sys.path.insert(0, '/opt/gemmaserve/lib'); import haproxy_admin; "
            "print([(r['pxname'], r['svname'], r['status'], r['check_status'], r['last_chk']) "
            "for r in haproxy_admin.stat_rows() if r['pxname'] in ('fleet', 'vllm')])"
        )
        report = []
        for each, each_remote, other in zip(hosts, remotes, reversed(hosts), strict=True):
            rows = each_remote.run(f'python3 -c "{script}"').stdout.strip()
            health = each_remote.run(
                f"curl -sS -m 3 -o /dev/null -w '%{{http_code}}' http://{other.address}:{peer_port}/health"
            ).stdout
            shown = each_remote.run(f"systemctl show {unit} -p ActiveState -p SubState -p NRestarts").stdout
            journal = each_remote.run(f"journalctl -u {unit} -n 20 --no-pager").stdout
            report.append(f"{each.name}: {rows}\n-> {other.name}'s /health: {health}\n{shown}{journal}")
        raise AssertionError(
            f"timed out after 300 s waiting for {host.name}'s ring of both hosts UP\n" + "\n".join(report)
        )


def balancer(remote) -> tuple[int, int]:
    """This host's HAProxy, over its fleet and vllm backends: how many times a check took a server DOWN
    (`chkdown`), and the requests it still holds (`scur`)."""
    script = (
        "import sys; sys.path.insert(0, '/opt/gemmaserve/lib'); import haproxy_admin; "
        "rows = [r for r in haproxy_admin.stat_rows() if r['pxname'] in ('fleet', 'vllm')]; "
        "print(sum(int(r['chkdown'] or 0) for r in rows if r['svname'] not in ('FRONTEND', 'BACKEND')), "
        "sum(int(r['scur'] or 0) for r in rows if r['svname'] == 'BACKEND'))"
    )
    down, held = remote.check_output(f'python3 -c "{script}"').split()
    return int(down), int(held)


def counters(remote, port: int) -> dict[str, float]:
    sums = metric_sums(remote.check_output(f"curl -fsS -m 10 http://127.0.0.1:{port}/metrics"))
    return {
        "requests": sums.get("vllm:request_success_total", 0.0),
        "hits": sums.get("vllm:prefix_cache_hits_total", 0.0),
    }


def served_since(remotes: list, port: int, before: list[dict[str, float]], count: int) -> list[dict]:
    """The hosts' counters (`remotes`: their testinfra hosts) once they show `count` more finished requests than
    `before` (vLLM counts a request in its metrics as it finishes, which may come just after the answer)."""
    deadline = time.monotonic() + 20
    while True:
        after = [counters(remote, port) for remote in remotes]
        done = sum(a["requests"] - b["requests"] for a, b in zip(after, before, strict=True))
        if done >= count or time.monotonic() > deadline:
            return after
        time.sleep(0.2)


@pytest.fixture(scope="module")
def fleet_hosts(bucket_hosts: BucketHosts, tmp_path_factory):
    up, remotes, plan = bucket_hosts.hosts, bucket_hosts.remotes, bucket_hosts.plan
    inventory = tmp_path_factory.mktemp("fleet") / "fleet_inventory.py"
    inventory.write_text(INVENTORY.format(fleet=FLEET, names=[host.name for host in up], extra=bucket_hosts.data))
    with peer_port_open_between(up, fleet_peer_port(plan.router_port)):
        started = [
            remote.check_output(f"systemctl show -p ActiveEnterTimestampMonotonic --value {plan.replicas[0].unit}")
            for remote in remotes
        ]
        result = pyinfra_fleet.run_pyinfra(
            inventory, limit=[host.name for host in up], env={OVERRIDE_ENV: None}, timeout=1200
        )
        assert result.returncode == 0, result.output[-4000:]
        # Joining the fleet is a router change: no replica restarted.
        assert started == [
            remote.check_output(f"systemctl show -p ActiveEnterTimestampMonotonic --value {plan.replicas[0].unit}")
            for remote in remotes
        ]
        wait_for_ring(up, remotes, plan)
        yield bucket_hosts
    # Each host on its own again, as the bucket tests and serving_peer read them.
    for host in up:
        alone = deploy(host.name, bucket_hosts.data, tmp_path_factory.mktemp("alone"))
        assert alone.returncode == 0, alone.output[-4000:]


def converse(endpoints: list, remotes: list, plan, port: int, n: int) -> tuple[list[int], float]:
    """Conversation `n`'s four turns, entering by the two hosts in turn: the host whose replica served each turn,
    and the prefix-cache hits of turns 2-4."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Conversation {n}: hello."}]
    landed, hits = [], 0.0
    for turn in range(4):
        # The previous turn let go of by both balancers first: a request they still hold counts towards the load
        # bound, which at a load this low sends the next one on.
        wait_until(lambda: all(balancer(remote)[1] == 0 for remote in remotes), 20, "the previous turn to finish")
        before = [counters(remote, port) for remote in remotes]
        status, text = endpoints[turn % 2].request(
            "/v1/chat/completions", {"model": plan.model.hf_id, "messages": messages, "max_tokens": 4}
        )
        assert status == 200, text
        after = served_since(remotes, port, before, 1)
        served = [i for i in range(2) if after[i]["requests"] > before[i]["requests"]]
        assert len(served) == 1, (before, after)
        landed.append(served[0])
        if turn:
            hits += after[served[0]]["hits"] - before[served[0]]["hits"]
        messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": f"Turn {turn + 1}."}]
    return landed, hits


def test_each_conversation_reaches_one_hosts_replica_through_either_host(fleet_hosts: BucketHosts):
    remotes, plan = fleet_hosts.remotes, fleet_hosts.plan
    port = plan.replicas[0].port
    endpoints = [sandbox_endpoint(host) for host in fleet_hosts.hosts]
    owners = []
    hits_after_first_turn = 0.0
    for n in range(12):
        # A health check that fails on a loaded machine takes a host out of the other's ring for a while, and its
        # conversations are then served where they enter (as they should be): such a conversation is run again,
        # with the ring whole, at most twice.
        for _attempt in range(3):
            wait_for_ring(fleet_hosts.hosts, remotes, plan)
            failed_before = [balancer(remote)[0] for remote in remotes]
            landed, hits = converse(endpoints, remotes, plan, port, n)
            failed_after = [balancer(remote)[0] for remote in remotes]
            if failed_after == failed_before:
                break
            print(f"conversation {n}: health checks failed during it ({failed_before} -> {failed_after}), again")
        assert failed_after == failed_before, (n, "a server went DOWN during every attempt", landed)
        hits_after_first_turn += hits
        assert len(set(landed)) == 1, (n, landed)
        owners.append(landed[0])
    print(
        f"fleet routing: conversations per host {[owners.count(i) for i in range(2)]}, "
        f"prefix-cache hits on later turns {hits_after_first_turn:.0f} tokens"
    )
    # Both hosts own conversations (12 hashed over 2 hosts: all on one host once in 2,048 runs).
    assert set(owners) == {0, 1}, owners
    # Turns 2-4 entered by the other host half the time, and still found their prefix cached.
    assert hits_after_first_turn > 0


def test_a_host_without_replicas_hands_its_conversations_to_the_other(fleet_hosts: BucketHosts):
    remotes, plan = fleet_hosts.remotes, fleet_hosts.plan
    port = plan.replicas[0].port
    unit = plan.replicas[0].unit
    endpoint = sandbox_endpoint(fleet_hosts.hosts[0])
    # Host 1's only replica stops (drained in its HAProxy first): host 1 answers 503 until host 0's checks see it.
    remotes[1].check_output(f"systemctl stop {unit}")
    before = [counters(remotes[0], port)]
    try:
        deadline = time.monotonic() + 60
        failed = 0
        sent = 0
        while time.monotonic() < deadline and sent < 12:
            status, _ = endpoint.request(
                "/v1/chat/completions",
                {"model": plan.model.hf_id, "messages": [{"role": "user", "content": f"q {sent}"}], "max_tokens": 2},
            )
            sent += 1
            failed += status != 200
        assert (sent, failed) == (12, 0)
        after = served_since(remotes[:1], port, before, 12)
        assert after[0]["requests"] - before[0]["requests"] == 12, (before, after)
    finally:
        remotes[1].check_output(f"systemctl start {unit}")
