"""Two replicas behind HAProxy on a sandbox host: secret hygiene, a SIGKILLed replica under load,
rolling restarts and a host reboot. Every load loop is bounded in requests and time."""

from __future__ import annotations

import hashlib
import json
import math
import re
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from gemmaserve.ops.verify.processes import server_pid
from gemmaserve.plan import plan
from gemmaserve.sandbox import lifecycle
from gemmaserve.sandbox.profile import sandbox_host_data
from gemmaserve.sources import spec_from_host_data
from tests.sandbox_fixtures import Load, deploy, sandbox_endpoint, wait_until

pytestmark = pytest.mark.sandbox

TOKEN = "hf_gemmaserveTESTtoken_" + hashlib.sha256(b"never-a-real-token").hexdigest()[:20]
TOKEN_FILE = "/etc/gemmaserve/hf-token"
# The drain bound these hosts are deployed with. It must exceed the longest request sent, here as in
# production: with four replicas of two loaded hosts on two CPU cores a stream gets ~5 tokens/s, so a
# 300-token stream ran past 30 s and then past 60 s (HAProxy's hard-stop-after cut it, ~51 KB of ~55 KB,
# during a reboot). 60 s, and streams half that long (STREAM_TOKENS).
SHUTDOWN_TIMEOUT = 60


def two_replica_data(tmp_path: Path, **workload) -> dict:
    local_token = tmp_path / "hf-token"
    local_token.write_text(TOKEN + "\n")
    local_token.chmod(0o600)
    data = {
        "gemmaserve_accelerator": {"kind": "cpu", "count": 2},
        "gemmaserve_secret": {"file": TOKEN_FILE},
        "hf_token_src": str(local_token),
        # The load generators here are not rate-limited clients: a rolling restart's 2 threads of short requests
        # passed the default 600 requests per minute per key in CI, and the 429s counted as failed requests.
        "gemmaserve_serving": {"shutdown_timeout": SHUTDOWN_TIMEOUT, "api_keys": {"requests_per_minute": 100_000}},
    }
    if workload:
        data["gemmaserve_workload"] = {**sandbox_host_data()["gemmaserve_workload"], **workload}
    return data


@pytest.fixture(scope="module")
def two_replicas(sandbox_hosts, sandbox_host, tmp_path_factory):
    host = sandbox_hosts[0]
    tmp_path = tmp_path_factory.mktemp("resilience")
    data = two_replica_data(tmp_path)
    result = deploy(host.name, data, tmp_path)
    assert result.returncode == 0, result.output[-4000:]
    host_plan = plan(spec_from_host_data({**sandbox_host_data(), **data})).require_ok()
    DEPLOYED[host.name] = data
    return host, host_plan, result.output, tmp_path


# The host data each host of this module was last deployed with (the rolling restart changes it).
DEPLOYED: dict[str, dict] = {}


def unit_started(sandbox_host, index: int) -> str:
    """Which start of vllm@index runs: systemd's InvocationID, new at each start. (ActiveEnterTimestamp was not: a
    replica restarted by the test before, serving behind HAProxy but still in its ExecStartPost readiness step,
    entered "active" during the next test, as if that test's deploy had restarted it.)"""
    return sandbox_host.run(f"systemctl show -p InvocationID --value vllm@{index}").stdout.strip()


def haproxy_status(sandbox_host) -> dict[str, str]:
    return json.loads(sandbox_host.run("python3 /opt/gemmaserve/lib/haproxy_admin.py status vllm").stdout)


def test_both_replicas_serve_behind_haproxy(two_replicas, sandbox_host):
    wait_until(lambda: set(haproxy_status(sandbox_host).values()) == {"UP"}, 60, "both HAProxy backends UP")
    assert sorted(haproxy_status(sandbox_host)) == ["replica0", "replica1"]


# --- routing ------------------------------------------------------------------------------------

# Multi-turn conversations whose history grows by one of the CPU backend's 128-token KV blocks or more a turn
# (a coding agent's tool output, a chat's pasted text), ROUTING_THREADS requests at once. Turns go in rounds:
# every conversation's first turn, in a shuffled order, then every second turn, and so on, so other
# conversations' turns come between two turns of one, as a user's think time or an agent's tool call puts them.
# (Sent back to back by one client instead, least-outstanding is affine by accident: the replica that just
# answered has one request fewer than the others when the same client sends the next turn.)
ROUTING_CONVERSATIONS, ROUTING_TURNS, ROUTING_THREADS = 32, 3, 12
TOPICS = "tides glaciers volcanoes deserts rivers forests reefs canyons prairies tundra caves islands".split()


def facts(name: str, turn: int, count: int) -> str:
    return " ".join(
        f"Fact {turn}.{i} about {name}: it is worth a careful, patient and complete answer." for i in range(count)
    )


def run_conversations(endpoint, model: str, names: list[str]) -> None:
    """Every turn of every conversation, round by round; a turn is sent after its conversation's previous answer."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    history = {
        name: [{"role": "system", "content": f"You are the assistant of conversation {name}. {facts(name, 0, 2)}"}]
        for name in names
    }

    def turn(name: str, number: int) -> None:
        messages = history[name]
        messages.append({"role": "user", "content": f"Turn {number}: {facts(name, number, 3)} Tell me more."})
        payload = {"model": model, "messages": messages, "max_tokens": 8, "temperature": 0}
        status, body = endpoint.request("/v1/chat/completions", payload, 120)
        assert status == 200, body[:300]
        messages.append({"role": "assistant", "content": json.loads(body)["choices"][0]["message"]["content"] or ""})

    order = random.Random(0)
    with ThreadPoolExecutor(ROUTING_THREADS) as pool:
        for number in range(1, ROUTING_TURNS + 1):
            shuffled = order.sample(names, len(names))
            list(pool.map(lambda name, number=number: turn(name, number), shuffled))


def haproxy_admin_call(sandbox_host, call: str) -> str:
    """A call into the host's haproxy_admin module (the program the router role installs)."""
    script = f"import json, sys; sys.path.insert(0, '/opt/gemmaserve/lib'); import haproxy_admin; print({call})"
    result = sandbox_host.run(f"python3 -c {shlex.quote(script)}")
    assert result.rc == 0, result.stderr
    return result.stdout


def replica_counters(sandbox_host, host_plan) -> list[dict[str, float]]:
    """Each replica's prefix-cache counters (tokens) from its own /metrics, and HAProxy's sessions for it."""
    from gemmaserve.ops.status import metric_sums

    rows = json.loads(
        haproxy_admin_call(
            sandbox_host, "json.dumps({r['svname']: r for r in haproxy_admin.stat_rows() if r['pxname'] == 'vllm'})"
        )
    )
    counters = []
    for replica in host_plan.replicas:
        sums = metric_sums(sandbox_host.run(f"curl -fsS -m 10 http://127.0.0.1:{replica.port}/metrics").stdout)
        row = rows[f"replica{replica.index}"]
        counters.append(
            {
                "hits": sums.get("vllm:prefix_cache_hits_total", 0.0),
                "queries": sums.get("vllm:prefix_cache_queries_total", 0.0),
                "requests": float(row["stot"] or 0),
                "peak": float(row["smax"] or 0),
            }
        )
    return counters


@dataclass
class RoutingRun:
    name: str
    hits: float
    queries: float
    requests: list[float]
    peaks: list[float]
    seconds: float

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries


def routing_run(
    host, sandbox_host, tmp_path, name: str, policy: str, out_of_service: tuple[str, ...] = ()
) -> RoutingRun:
    """Deploy `policy` (a balancer change: HAProxy reloads, no replica restarts), take `out_of_service` replicas
    out of HAProxy's rotation, run the conversations (new ones: no cache of an earlier run helps), put them back."""

    data = {**DEPLOYED[host.name]}
    data["gemmaserve_serving"] = {**data["gemmaserve_serving"], "routing": policy}
    result = deploy(host.name, data, tmp_path)
    assert result.returncode == 0, result.output[-3000:]
    host_plan = plan(spec_from_host_data({**sandbox_host_data(), **data})).require_ok()
    assert host_plan.routing.policy == policy
    wait_until(lambda: all_up(sandbox_host), 120, "both replicas UP")
    for server in out_of_service:
        haproxy_admin_call(sandbox_host, f"haproxy_admin.command('disable server vllm/{server}')")
    # HAProxy's peak sessions per server (smax) and its totals start from zero for this run.
    haproxy_admin_call(sandbox_host, "haproxy_admin.command('clear counters all')")
    before = replica_counters(sandbox_host, host_plan)
    endpoint = sandbox_endpoint(host)
    names = [f"{name}-{TOPICS[i % len(TOPICS)]}-{i}" for i in range(ROUTING_CONVERSATIONS)]
    started = time.monotonic()
    try:
        run_conversations(endpoint, host_plan.model.hf_id, names)
    finally:
        for server in out_of_service:
            haproxy_admin_call(sandbox_host, f"haproxy_admin.command('enable server vllm/{server}')")
    seconds = time.monotonic() - started
    after = replica_counters(sandbox_host, host_plan)
    return RoutingRun(
        name,
        hits=sum(a["hits"] - b["hits"] for a, b in zip(after, before, strict=True)),
        queries=sum(a["queries"] - b["queries"] for a, b in zip(after, before, strict=True)),
        requests=[a["requests"] for a in after],
        peaks=[a["peak"] for a in after],
        seconds=seconds,
    )


def test_prefix_affinity_reuses_each_conversations_prefix_within_the_load_bound(two_replicas, sandbox_host):
    """Both policies in one run, on the same two replicas and the same kind of traffic (new conversations each).
    The ideal reuse, every turn reusing its conversation's previous prompt, is what vLLM itself reports when one
    replica serves every turn (the other out of rotation). With both replicas serving, prefix-affinity reaches 90 %
    of it while no replica serves more than 1.3 x the mean, and no replica ever held more requests at once than
    the bound lets it: HAProxy's hash-balance-factor (a replica takes one more only while it holds fewer than
    factor x (in flight + 1) / replicas, rounded up) once it holds the plan's affinity floor, below which a
    conversation keeps its replica. least-outstanding is measured beside it."""
    host, host_plan, _, tmp_path = two_replicas
    runs = [
        routing_run(host, sandbox_host, tmp_path, "one-replica", "prefix-affinity", ("replica1",)),
        routing_run(host, sandbox_host, tmp_path, "least-outstanding", "least-outstanding"),
        # Last: the host is left on the module's deployed policy (the default) for the tests after this one.
        routing_run(host, sandbox_host, tmp_path, "prefix-affinity", "prefix-affinity"),
    ]
    ideal = runs[0]
    for run in runs:
        share = "/".join(f"{r / sum(run.requests):.2f}" for r in run.requests)
        print(
            f"\n[figure] routing {run.name} (2 replicas, {ROUTING_CONVERSATIONS} conversations x {ROUTING_TURNS} "
            f"turns, {ROUTING_THREADS} clients): prefix-cache hit rate {run.hit_rate:.1%} "
            f"({run.hit_rate / ideal.hit_rate:.0%} of one replica's), request share {share}, peak in flight "
            f"{'/'.join(f'{p:.0f}' for p in run.peaks)}, {run.seconds:.1f} s"
        )
    least, affine = runs[1], runs[2]
    # With the bound alone this was 60-89 % over nine runs: at 12 in flight on two replicas it moved a turn to the
    # other replica whenever its own held 7 or 8 (docs/routing.md, "Measured on the sandbox"). Below the affinity
    # floor (16 of the CPU replicas' 128) a conversation now keeps its replica.
    assert ideal.hits > 0 and affine.hit_rate >= 0.9 * ideal.hit_rate, (affine, ideal)
    assert affine.hit_rate >= 1.1 * least.hit_rate, (affine, least)
    assert max(affine.requests) <= 1.3 * sum(affine.requests) / len(affine.requests), affine.requests
    bound = math.ceil(host_plan.routing.load_bound_percent / 100 * (ROUTING_THREADS + 1) / len(host_plan.replicas))
    assert max(affine.peaks) <= max(bound, host_plan.routing.affinity_floor), (affine.peaks, bound)
    assert all(requests > 0 for requests in affine.requests), "one replica took every conversation"


# --- secret hygiene -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def used_api_key(two_replicas) -> str:
    """The sandbox's API key, used for requests just now: HAProxy's and vLLM's logs had their chance to hold it."""
    endpoint = sandbox_endpoint(two_replicas[0])
    with Load(endpoint, two_replicas[1].model.hf_id, limit=2, seconds=120) as load:
        pass
    assert load.ok == 2, load.failures
    return endpoint.credentials.api_key


@pytest.mark.parametrize(
    "where, command",
    [
        ("unit files", "cat /etc/systemd/system/vllm@.service /etc/systemd/system/gemmaserve*.service"),
        ("key store, key map, HAProxy config", "cat /etc/gemmaserve/api-keys* /etc/haproxy/haproxy.cfg"),
        ("env files", "cat /etc/gemmaserve/replica-*.env"),
        ("the journal", "journalctl --no-pager -o cat"),
        ("systemctl show", "systemctl show 'vllm@*' gemmaserve.target haproxy gemmaserve-api-keys"),
        ("process environments", "cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n'"),
        ("process command lines", "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '"),
    ],
)
def test_token_and_api_key_absent(used_api_key, sandbox_host, where, command):
    output = sandbox_host.run(command).stdout
    assert len(output) > 100, f"{where}: nothing read, the check would be vacuous"
    assert TOKEN not in output
    assert used_api_key not in output


def test_token_and_api_key_absent_from_pyinfra_output(two_replicas):
    assert TOKEN not in two_replicas[2]
    assert sandbox_endpoint(two_replicas[0]).credentials.api_key not in two_replicas[2]


def test_token_reaches_vllm_as_a_credential(two_replicas, sandbox_host):
    pid = server_pid(sandbox_host, 0)
    environ = sandbox_host.run(f"tr '\\0' '\\n' < /proc/{pid}/environ").stdout
    path = re.search(r"^HF_TOKEN_PATH=(.+)$", environ, re.M)[1]
    assert path == "/run/credentials/vllm@0.service/hf-token"
    stat = sandbox_host.run(f"stat -c '%a %U' /proc/{pid}/root{path}").stdout.split()
    assert stat == ["400", "gemmaserve"]
    digest = sandbox_host.run(f"sha256sum < /proc/{pid}/root{path}").stdout.split()[0]
    # Byte for byte the file the operator gave (huggingface_hub strips the trailing newline itself).
    assert digest == hashlib.sha256((TOKEN + "\n").encode()).hexdigest()


def test_token_file_on_disk_is_root_only(two_replicas, sandbox_host):
    token_file = sandbox_host.file(TOKEN_FILE)
    assert token_file.mode == 0o400 and token_file.user == "root"


# --- failures under load ------------------------------------------------------------------------


def kill_and_wait_for_refusal(sandbox_host, pid: str, port: int) -> None:
    """SIGKILL `pid` and return once the replica's port refuses connections. kill(2) returns before the process
    is gone, and the listening socket outlives the server process: vLLM binds it before it forks its engine core
    (fork is vLLM's default start method), so the engine core and its worker hold it too until the kernel has
    torn them down (under podman, catatonit's exit kills the container's pid namespace; tearing down a process
    frees its memory before it closes its files). Until then the kernel completes connections on that port that
    nothing will ever answer; HAProxy cannot tell such a request from one vLLM took, so it is not re-sent."""
    script = (
        f"kill -KILL {pid} || exit 1; "
        f"for i in $(seq 1 600); do (exec 3<>/dev/tcp/127.0.0.1/{port}) 2>/dev/null || exit 0; sleep 0.05; done; exit 2"
    )
    result = sandbox_host.run(f"bash -c {shlex.quote(script)}")
    assert result.rc == 0, f"kill {pid}: rc {result.rc} (2: port {port} still accepted 30 s later) {result.stderr}"


def test_sigkilled_replica_fails_no_request_sent_after_the_kill_and_is_restarted(two_replicas, sandbox_host):
    """SIGKILL of replica 0's vLLM under load. A request sent after the kill (once the replica's port refuses
    connections: see kill_and_wait_for_refusal) never fails: the replica refuses it, HAProxy sends the request
    to the other replica (retry-on conn-failure) and takes the dead one out. A request replica 0 held when it
    died fails (HAProxy's 502): HAProxy never replays a request a replica took (a generation done twice, a
    request that kills its replica fed to every replica; docs/security.md), so at most one per client fails,
    and the client retries. systemd restarts the replica, checked even when an assertion before it fails, so
    the module's later tests find both replicas serving."""
    host, host_plan, _, _ = two_replicas
    before = int(sandbox_host.run("systemctl show -p NRestarts --value vllm@0").stdout.strip())
    # The vLLM server itself, whichever engine runs it (under podman: a process of the container).
    pid = server_pid(sandbox_host, 0)
    assert pid
    try:
        with Load(sandbox_endpoint(host), host_plan.model.hf_id, limit=60, seconds=240) as load:
            wait_until(lambda: load.ok >= 5, 60, "the load to start")
            kill_and_wait_for_refusal(sandbox_host, pid, host_plan.replicas[0].port)
            landed = time.monotonic()
            wait_until(lambda: load.ok >= 40, 200, "40 requests after the kill")
        after = load.failures_sent_after(landed)
        print(
            f"\n[figure] SIGKILL under load: {load.ok} ok; {load.failed_sent_before(landed)} failed that the "
            f"killed replica held (never replayed), {len(after)} failed of those sent after the kill"
        )
        if after:  # HAProxy's view of each failed request (termination state, retries) for the report
            print(sandbox_host.run("journalctl -u haproxy -n 120 --no-pager -o cat").stdout)
        assert after == []
        # Each client has one request in flight at a time: at most that many were held by the replica when it died.
        assert len(load.failures) <= load.threads, load.failures
    finally:
        wait_until(
            lambda: int(sandbox_host.run("systemctl show -p NRestarts --value vllm@0").stdout.strip()) > before,
            60,
            "systemd to restart vllm@0",
        )
        wait_until(lambda: set(haproxy_status(sandbox_host).values()) == {"UP"}, 240, "vllm@0 back UP in HAProxy")
        # Serving comes before the unit's readiness step ends: the next tests start from an active unit.
        wait_until(
            lambda: sandbox_host.run("systemctl is-active vllm@0").stdout.strip() == "active", 240, "vllm@0 active"
        )


def test_unchanged_replica_is_never_restarted(two_replicas, sandbox_host):
    host, _, _, tmp_path = two_replicas
    started = [unit_started(sandbox_host, i) for i in (0, 1)]
    # Drift on replica 1 only: the deploy puts its env file back and restarts it, and only it.
    sandbox_host.run("sed -i 's/^DO_NOT_TRACK=1$/DO_NOT_TRACK=0/' /etc/gemmaserve/replica-1.env")
    result = deploy(host.name, two_replica_data(tmp_path), tmp_path)
    assert result.returncode == 0, result.output[-3000:]
    assert unit_started(sandbox_host, 0) == started[0]
    assert unit_started(sandbox_host, 1) != started[1]


def test_rolling_restart_keeps_serving_and_restarts_every_changed_replica(two_replicas, sandbox_host):
    host, host_plan, _, tmp_path = two_replicas
    started = [unit_started(sandbox_host, i) for i in (0, 1)]
    changed = two_replica_data(tmp_path, max_num_seqs=32)
    try:
        with Load(sandbox_endpoint(host), host_plan.model.hf_id, limit=20000, seconds=600, threads=2) as load:
            wait_until(lambda: load.ok >= 3, 60, "the load to start")
            result = deploy(host.name, changed, tmp_path)
        print(f"\n[figure] rolling restart of 2 replicas under load: {load.ok} ok, {len(load.failures)} failed")
        assert result.returncode == 0, result.output[-3000:]
        assert load.failures == []
        assert all(a != b for a, b in zip(started, [unit_started(sandbox_host, i) for i in (0, 1)], strict=True))
        assert "--max-num-seqs 32" in sandbox_host.file("/etc/gemmaserve/replica-1.env").content_string
    except BaseException:
        # Back to the module's config when the rolling restart failed, or every later test starts from a
        # half-applied one. After a passing one the host keeps the changed config (two replicas, serving): the
        # later tests need nothing else, and a second rolling restart back would double this test's cost.
        deploy(host.name, two_replica_data(tmp_path), tmp_path)
        raise
    DEPLOYED[host.name] = changed


# --- graceful stops -----------------------------------------------------------------------------

# Streams of this many tokens take 10-30 s on the loaded sandbox: long enough to be cut by a careless stop,
# short enough to finish inside SHUTDOWN_TIMEOUT.
STREAM_TOKENS = 150
# On the host: wait until HAProxy has requests running on replica 0, then `systemctl stop` it, timed.
STOP_WHEN_BUSY = """
import subprocess, sys, time
sys.path.insert(0, "/opt/gemmaserve/lib")
import haproxy_admin
for _ in range(600):
    busy = int(haproxy_admin.server_stats("vllm", "replica0")["scur"] or 0)
    if busy:
        break
    time.sleep(0.1)
started = time.monotonic()
subprocess.run(["systemctl", "stop", "vllm@0"], check=True)
print(busy, round(time.monotonic() - started, 2))
"""


def all_up(sandbox_host) -> bool:
    return set(haproxy_status(sandbox_host).values()) == {"UP"}


def backend_busy(sandbox_host) -> int:
    """Requests HAProxy has running on the host's replicas now."""
    script = (
        "import sys; sys.path.insert(0, '/opt/gemmaserve/lib'); import haproxy_admin; "
        "print(haproxy_admin.server_stats('vllm', 'BACKEND')['scur'] or 0)"
    )
    return int(sandbox_host.run(f'python3 -c "{script}"').stdout.strip() or 0)


def test_plain_stop_under_load_finishes_every_accepted_request(two_replicas, sandbox_host):
    """`systemctl stop vllm@0`, not the deploy's rolling restart, under streaming and non-streaming load:
    the replica leaves HAProxy, finishes the requests it holds and exits within the drain bound; the
    other replica takes the new ones; no request fails."""
    host, host_plan, _, _ = two_replicas
    wait_until(lambda: all_up(sandbox_host), 240, "both replicas UP")
    load = Load(
        sandbox_endpoint(host),
        host_plan.model.hf_id,
        limit=10000,
        seconds=400,
        threads=4,
        stream_every=2,
        stream_tokens=STREAM_TOKENS,
    )
    with load:
        wait_until(lambda: load.ok >= 4, 120, "the load to start")
        stop = sandbox_host.run(f"python3 - <<'EOF'\n{STOP_WHEN_BUSY}\nEOF")
        assert stop.rc == 0, stop.stderr
        busy, stop_s = stop.stdout.split()
        served = load.ok
        wait_until(lambda: load.ok >= served + 6 or bool(load.failures), 180, "requests served by replica 1 alone")
    engine = host_plan.engine.kind
    print(
        f"\n[figure] systemctl stop of a busy replica ({engine}): {float(stop_s):.1f} s with {busy} requests "
        f"running on it (bound {SHUTDOWN_TIMEOUT} s); load: {load.ok} ok, {len(load.failures)} failed"
    )
    assert load.failures == []
    assert int(busy) >= 1, "replica 0 had nothing in flight: the stop proved nothing"
    assert float(stop_s) <= SHUTDOWN_TIMEOUT + 10
    assert sandbox_host.run("systemctl is-active vllm@0").stdout.strip() == "inactive"
    assert "vllm/replica0: drained" in sandbox_host.run("journalctl -u vllm@0 -n 300 --no-pager -o cat").stdout
    assert sandbox_host.run("systemctl start vllm@0").rc == 0
    wait_until(lambda: all_up(sandbox_host), 240, "vllm@0 back UP in HAProxy")


STOP_LINE = re.compile(r"^\[\s*(?P<t>[0-9.]+)\] \S+ systemd\[1\]: (?P<what>Stopping|Stopped) (?P<unit>\S+\.service)\b")


def stop_times(sandbox_host) -> dict[tuple[str, str], float]:
    """When systemd last began and finished stopping each service in the previous boot (monotonic seconds,
    from the host's persistent journal): the shutdown's stops, after any earlier test's restarts."""
    out = sandbox_host.run("journalctl -b -1 -o short-monotonic --no-pager _PID=1").stdout
    times: dict[tuple[str, str], float] = {}
    for line in out.splitlines():
        if match := STOP_LINE.match(line):
            times[match["what"], match["unit"]] = float(match["t"])
    return times


# --- reboot -------------------------------------------------------------------------------------


@dataclass
class Reboot:
    """What a reboot left to check: the load that ran through it (None without one), how long shutdown and
    boot took, when it began, PID 1's start before it, and the marker file put in the compile cache before it."""

    load: Load | None
    down_s: float
    began: float
    pid1_before: str
    marker: str


def reboot_host(host, host_plan, sandbox_host, load: Load | None = None) -> Reboot:
    """Reboot `host` (with `load` running through it, if given) once both replicas are UP, after putting a
    marker in replica 0's compile cache on /dev/shm; returns when both replicas are UP again."""
    wait_until(lambda: all_up(sandbox_host), 240, "both replicas UP")
    marker = f"/dev/shm/gemmaserve/{host_plan.replicas[0].cache_key}/vllm/gemmaserve-reboot-marker"
    assert sandbox_host.run(f"echo survived > {marker}").rc == 0
    pid1_before = sandbox_host.run("stat -c %Z /proc/1").stdout.strip()
    if load:
        wait_until(lambda: load.ok >= 6, 120, "the load to start")
        wait_until(lambda: backend_busy(sandbox_host) >= 1, 60, "requests running on the rebooting host")
    began = time.monotonic()
    # Later tests hold this same Host record: keep its PID current. A graceful shutdown under load takes
    # HAProxy's soft stop, then each replica's drain in HAProxy and vLLM's own drain (three stages, each at
    # most the shutdown timeout), not the 30 s an idle host needs; booting ends once both replicas, loading
    # one after the other under load, are ready.
    host.pid = lifecycle.reboot(host.name, timeout=3 * SHUTDOWN_TIMEOUT + 60, boot_timeout=480).pid
    down_s = time.monotonic() - began
    # The old ssh session died with the host: drop testinfra's cached paramiko client to reconnect.
    sandbox_host.backend.__dict__.pop("client", None)
    wait_until(lambda: all_up(sandbox_host), 300, "both replicas UP after the reboot")
    if load:
        served = load.ok
        wait_until(lambda: load.ok >= served + 6 or bool(load.failures), 180, "requests after the reboot")
    return Reboot(load, down_s, began, pid1_before, marker)


@pytest.fixture(scope="module")
def rebooted(two_replicas, sandbox_host, serving_peer) -> Reboot:
    """One reboot of the host under load while a second host serves (clients spread over both hosts, as a
    load balancer would, sending what a host refuses to the other); both reboot tests read it. A second,
    idle reboot would only repeat the boot half of this one."""
    host = two_replicas[0]
    # The plan the host runs now (the rolling restart changed it): its compile-cache keys are what the
    # shutdown saves.
    host_plan = plan(spec_from_host_data({**sandbox_host_data(), **DEPLOYED[host.name]})).require_ok()
    load = Load(
        [sandbox_endpoint(h) for h in (host, serving_peer)],
        host_plan.model.hf_id,
        limit=10000,
        seconds=500,
        threads=4,
        stream_every=2,
        stream_tokens=STREAM_TOKENS,
    )
    with load:
        return reboot_host(host, host_plan, sandbox_host, load)


def test_reboot_under_load_with_a_second_host_serving(two_replicas, sandbox_host, rebooted):
    """Every request the rebooting host accepted finishes, streams included: HAProxy stops first and
    gracefully, then the replicas."""
    _, host_plan, _, _ = two_replicas
    load = rebooted.load
    in_flight = load.in_flight_at(rebooted.began, 0)
    stops = stop_times(sandbox_host)
    drain = "gemmaserve-router-drain.service"
    needed = [("Stopping", drain), ("Stopped", drain)]
    needed += [(what, r.unit) for r in host_plan.replicas for what in ("Stopping", "Stopped")]
    missing = [key for key in needed if key not in stops]
    drained = stops.get(("Stopped", drain), float("nan"))
    print(
        f"\n[figure] reboot under load ({host_plan.engine.kind}, a second host serving): shutdown and boot "
        f"{rebooted.down_s:.1f} s, {in_flight} requests in flight at the reboot finished, {load.rerouted} sent to "
        f"the other host, {load.ok} ok, {len(load.failures)} failed; HAProxy's graceful stop "
        f"{drained - stops.get(('Stopping', drain), float('nan')):.1f} s, then the replicas "
        f"{max(stops.get(('Stopped', r.unit), float('nan')) for r in host_plan.replicas) - drained:.1f} s"
    )
    assert load.failures == []
    assert in_flight >= 1, "nothing was in flight on the rebooting host: the test proved nothing"
    # The first reboot after a deploy (the target the replicas belong to was never started) is the one
    # where an order through gemmaserve.target alone did not hold: systemd's own journal says what ran when.
    assert not missing, f"systemd's journal of the previous boot lacks {missing}: {stops}"
    replicas = [stops["Stopping", replica.unit] for replica in host_plan.replicas]
    assert all(stopping >= drained for stopping in replicas), f"replicas stopped beside HAProxy: {stops}"


def test_reboot_brings_units_router_and_compile_cache_back(two_replicas, sandbox_host, rebooted):
    host, host_plan, _, _ = two_replicas
    # A new PID 1 (the kernel's /proc/uptime is shared with the outer machine, so it cannot tell).
    assert int(sandbox_host.run("stat -c %Z /proc/1").stdout.strip()) > int(rebooted.pid1_before)
    for unit in ("vllm@0", "vllm@1", "haproxy", "gemmaserve-cache-restore"):
        assert (
            sandbox_host.service(unit).is_running
            or sandbox_host.run(f"systemctl is-active {unit}").stdout.strip() == "active"
        )
    # /dev/shm is new after a reboot: the marker is there only because it was saved at shutdown and
    # restored before the replicas started.
    assert sandbox_host.file(rebooted.marker).content_string.strip() == "survived"
    with Load(sandbox_endpoint(host), host_plan.model.hf_id, limit=5, seconds=240) as load:
        pass
    assert load.ok >= 1 and load.failures == []


def test_scale_down_stops_and_removes_the_extra_replica(two_replicas, sandbox_host):
    host, _, _, tmp_path = two_replicas
    one = {**DEPLOYED[host.name], "gemmaserve_accelerator": {"kind": "cpu", "count": 1}}
    result = deploy(host.name, one, tmp_path)
    assert result.returncode == 0, result.output[-3000:]
    assert sandbox_host.run("systemctl is-active vllm@1").stdout.strip() != "active"
    assert sandbox_host.run("systemctl is-enabled vllm@1").stdout.strip() != "enabled"
    assert not sandbox_host.file("/etc/gemmaserve/replica-1.env").exists
    assert sorted(haproxy_status(sandbox_host)) == ["replica0"]
