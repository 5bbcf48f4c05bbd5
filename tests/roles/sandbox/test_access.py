"""Who may call a deployed sandbox host: API keys checked by HAProxy (added and revoked with `gemmaserve keys`
while a steady load on another key sees no failure and nothing restarts), a per-key concurrency limit, TLS
only, and nothing but the client routes of the real vLLM's route table through the balancer."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from gemmaserve.ops import fleet
from gemmaserve.ops.endpoint import Credentials, EndpointError, request
from gemmaserve.plan import CLIENT_ROUTES, HEALTH_PATH, plan
from gemmaserve.sandbox.profile import sandbox_host_data
from gemmaserve.sources import spec_from_host_data
from roles.router import Settings
from tests import ROOT
from tests.roles.fixtures.test_haproxy_access import conn_cur
from tests.sandbox_fixtures import Load, deploy, poll, sandbox_endpoint, wait_until

pytestmark = pytest.mark.sandbox

# Two requests in flight per key make the limit reachable with the tiny model on two cores.
LIMITED = {"gemmaserve_serving": {"api_keys": {"max_concurrent_requests": 2}}}


@pytest.fixture(scope="module")
def deployed(sandbox_hosts, tmp_path_factory):
    host = sandbox_hosts[0]
    tmp = tmp_path_factory.mktemp("access")
    result = deploy(host.name, LIMITED, tmp)
    assert result.ok, result.output[-4000:]
    host_plan = plan(spec_from_host_data({**sandbox_host_data(), **LIMITED})).require_ok()
    # An inventory of this host alone, with the data it was deployed with, for `gemmaserve keys`.
    data = dict(next(h for h in fleet.load("hosts/sandbox.py") if h.name == host.name).data)
    data.update(LIMITED)
    inventory = tmp / "this_host.py"
    inventory.write_text(f"hosts = [({host.name!r}, {data!r})]\n")
    return host, host_plan, inventory, result.output


def keys(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gemmaserve", "keys", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


# Keys `gemmaserve keys add` printed in this module: the hygiene check at the end looks for each.
MADE: list[str] = []


def add_key(inventory: Path, key_id: str) -> str:
    result = keys("add", key_id, "--inventory", str(inventory))
    assert result.returncode == 0, result.stderr
    key = result.stdout.strip()
    MADE.append(key)
    assert key.startswith("gsk-") and key not in result.stderr
    return key


def chat(endpoint, key: str | None = "", **extra) -> tuple[int, str]:
    payload = {"model": "gemmaserve/tiny-gemma4-test", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    return endpoint.request("/v1/chat/completions", {**payload, **extra}, key=key)


def haproxy_admin(sandbox_host, line: str) -> str:
    """A command on HAProxy's admin socket, through the host program the roles install."""
    program = f'import sys; sys.path.insert(0, "/opt/gemmaserve/lib"); import haproxy_admin; print(haproxy_admin.command({line!r}))'
    return sandbox_host.run(f"python3 -c {shlex.quote(program)}").stdout


def started(sandbox_host) -> dict[str, str]:
    """What a restart or reload would change: HAProxy's master and worker PIDs, the replica's start time."""
    master = sandbox_host.run("systemctl show -p MainPID --value haproxy").stdout.strip()
    info = haproxy_admin(sandbox_host, "show info")
    return {
        "haproxy master": master,
        "haproxy worker": re.search(r"^Pid: (\d+)$", info, re.M)[1],
        "vllm@0": sandbox_host.run("systemctl show -p ActiveEnterTimestampMonotonic --value vllm@0").stdout.strip(),
    }


# --- keys ---------------------------------------------------------------------------------------------


def test_without_a_key_is_401(deployed):
    status, body = sandbox_endpoint(deployed[0]).request("/v1/models", key=None)
    assert status == 401 and json.loads(body)["error"]["code"] == "missing_api_key"


def test_with_a_wrong_key_the_sdk_gets_401(deployed):
    import openai

    endpoint = sandbox_endpoint(deployed[0])
    client = Credentials("gsk-wrong-key-0123456789abcdefghij", endpoint.credentials.ca_cert).openai(
        endpoint.base_url, max_retries=0
    )
    with pytest.raises(openai.AuthenticationError) as caught:
        client.models.list()
    assert caught.value.status_code == 401 and caught.value.body["code"] == "invalid_api_key"


def test_each_valid_key_gets_200(deployed):
    host, _, inventory, _ = deployed
    endpoint = sandbox_endpoint(host)
    second = add_key(inventory, "second")
    assert chat(endpoint)[0] == 200
    assert chat(endpoint, key=second)[0] == 200
    listed = json.loads(keys("list", "--inventory", str(inventory), "--json").stdout)[host.name]
    assert {"sandbox", "second"} <= {entry["id"] for entry in listed}
    assert second not in json.dumps(listed)
    assert keys("revoke", "second", "--inventory", str(inventory)).returncode == 0


def test_many_key_changes_in_a_row_all_apply(deployed, sandbox_host):
    """Each `gemmaserve keys` change starts the sync unit once: a script rotating several keys in a few
    seconds starts it more often than systemd's default limit (5 in 10 s) allows. Every start succeeds."""
    starts = [sandbox_host.run("systemctl start gemmaserve-api-keys.service") for _ in range(8)]
    assert [result.rc for result in starts] == [0] * 8, [result.stderr for result in starts]
    result = keys("add", "quick", "--inventory", str(deployed[2]))
    assert result.returncode == 0, result.stderr
    MADE.append(result.stdout.strip())
    assert keys("revoke", "quick", "--inventory", str(deployed[2])).returncode == 0


def test_rotation_under_load_fails_no_request_and_restarts_nothing(deployed, sandbox_host):
    """A key is added and revoked while another key carries a steady load: the revoked key fails within
    seconds, the load sees no failure, and neither HAProxy nor the replica restarted or reloaded."""
    host, host_plan, inventory, _ = deployed
    endpoint = sandbox_endpoint(host)
    before = started(sandbox_host)
    # One request at a time on the sandbox key: under its limit of two in flight, so the load's only way to
    # fail is the rotation (at exactly the limit, a request sent as the previous one ends can be counted
    # while that one is still closing in HAProxy).
    with Load(endpoint, host_plan.model.hf_id, limit=400, seconds=240, threads=1) as load:
        wait_until(lambda: load.ok >= 3, 60, "the load to start")
        rotated = add_key(inventory, "rotated")
        assert chat(endpoint, key=rotated)[0] == 200
        revoke_started = time.monotonic()
        result = keys("revoke", "rotated", "--inventory", str(inventory))
        assert result.returncode == 0, result.stderr
        wait_until(lambda: chat(endpoint, key=rotated)[0] == 401, 10, "the revoked key to be refused")
        refused_after = time.monotonic() - revoke_started
        ok_at_revoke = load.ok
        wait_until(lambda: load.ok >= ok_at_revoke + 3, 60, "the load to go on after the revocation")
    print(
        f"\n[figure] revoked key refused {refused_after:.2f} s after `gemmaserve keys revoke` started; load {load.ok} ok, {len(load.failures)} failed"
    )
    assert load.failures == []
    assert started(sandbox_host) == before


# Long enough (1,000 tokens: seconds on two cores) that two requests are surely in flight together once
# HAProxy counts them; the client waits for HAProxy's own count rather than for a fixed time, which a
# starved test process on two busy cores overran in CI (its second request left after the first ended).
LONG = {"max_tokens": 1000, "messages": [{"role": "user", "content": "Go"}], "model": "gemmaserve/tiny-gemma4-test"}


def key_in_flight(sandbox_host, key_id: str) -> int:
    """HAProxy's count of the key's requests in flight: conn_cur in the per-key stick table."""
    return conn_cur(haproxy_admin(sandbox_host, "show table gemmaserve"), key_id)


def test_concurrency_limit_is_429_while_another_key_is_served(deployed, sandbox_host):
    """Two streams of a key in flight (its limit), a third request of it is refused with 429 while another key is
    served. Up to three attempts: on a loaded machine the first 1,000-token stream has ended before the second was
    in flight (CI, 2026-11-25); an attempt whose two streams were never in flight together proves nothing."""
    host, _, inventory, _ = deployed
    endpoint = sandbox_endpoint(host)
    busy = add_key(inventory, "busy")
    client = Credentials(busy, endpoint.credentials.ca_cert).openai(endpoint.base_url, max_retries=0, timeout=120)
    attempts: list[tuple[int | None, str]] = []
    try:
        for _ in range(3):
            streams = []
            try:
                for _ in range(2):  # the key's limit: two in flight
                    streams.append(client.chat.completions.create(stream=True, extra_body={"ignore_eos": True}, **LONG))
                if not poll(lambda: key_in_flight(sandbox_host, "busy") >= 2, 30, 0.2):
                    attempts.append((None, "the two streams were never in flight together"))
                    continue
                attempts.append(chat(endpoint, key=busy))
            finally:
                for stream in streams:
                    stream.close()
            if attempts[-1][0] == 429:
                break
        other = chat(endpoint)[0]
    finally:
        revoked = keys("revoke", "busy", "--inventory", str(inventory))
    status, body = attempts[-1]
    assert status == 429, attempts
    error = json.loads(body)["error"]
    assert error["code"] == "rate_limit_exceeded" and "2 in flight" in error["message"]
    assert other == 200
    assert revoked.returncode == 0, revoked.stderr


def test_429_carries_retry_after(deployed, sandbox_host):
    host = deployed[0]
    endpoint = sandbox_endpoint(host)
    import urllib.error
    import urllib.request

    key = add_key(deployed[2], "retry")

    def one(results: list[tuple[int, str | None]]) -> None:
        req = urllib.request.Request(
            endpoint.base_url + "/chat/completions",
            data=json.dumps({**LONG, "ignore_eos": True}).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
        )
        try:
            with endpoint.credentials.opener().open(req, timeout=120) as response:
                results.append((response.status, None))
        except urllib.error.HTTPError as error:
            results.append((error.code, error.headers.get("Retry-After")))

    # A third request while two are in flight. A 1,000-token answer takes ~4 s on an idle host: on a loaded one
    # the first can end before the second is seen in flight (CI saw that once), and then the pair is sent again,
    # up to three times; every attempt's requests are asserted on.
    attempts: list[list[tuple[int, str | None]]] = []
    try:
        for _ in range(3):
            results: list[tuple[int, str | None]] = []
            threads = []
            for count in (1, 2):
                threads.append(threading.Thread(target=one, args=(results,)))
                threads[-1].start()
                paired = poll(lambda count=count: key_in_flight(sandbox_host, "retry") >= count, 30, 0.2)
                if not paired:
                    break
            if paired:
                one(results)
            for thread in threads:
                thread.join()
            attempts.append(results)
            if paired and len(results) == 3 and sorted(status for status, _ in results) == [200, 200, 429]:
                break
    finally:
        revoked = keys("revoke", "retry", "--inventory", str(deployed[2]))
    assert all(status in (200, 429) for results in attempts for status, _ in results), attempts
    results = attempts[-1]
    assert sorted(status for status, _ in results) == [200, 200, 429], attempts
    assert [retry for status, retry in results if status == 429] == ["1"]
    assert revoked.returncode == 0, revoked.stderr


def test_keys_cli_refuses_a_taken_id_before_changing_anything(deployed):
    result = keys("add", "sandbox", "--inventory", str(deployed[2]))
    assert result.returncode == 2 and "key id 'sandbox' exists" in result.stderr
    assert result.stdout == ""


# --- TLS ----------------------------------------------------------------------------------------------


def test_sdk_with_the_sandbox_ca_succeeds(deployed):
    client = sandbox_endpoint(deployed[0]).openai(max_retries=0)
    assert [m.id for m in client.models.list().data] == [deployed[1].model.hf_id]


def test_sdk_without_the_ca_fails_verification(deployed):
    import openai

    endpoint = sandbox_endpoint(deployed[0])
    client = Credentials(endpoint.credentials.api_key, None).openai(endpoint.base_url, max_retries=0)
    with pytest.raises(openai.APIConnectionError) as caught:
        client.models.list()
    chain, error = [], caught.value
    while error is not None:
        chain.append(repr(error))
        error = error.__cause__ or error.__context__
    assert "CERTIFICATE_VERIFY_FAILED" in " ".join(chain)


def test_plain_http_on_the_serving_port_is_refused(deployed):
    endpoint = sandbox_endpoint(deployed[0])
    with pytest.raises(EndpointError):
        request(endpoint.url("/health").replace("https://", "http://", 1), timeout=10)


# A second client address on the outer machine, in the sandbox's own range (10.231.0.0/24 holds no host).
OTHER_SOURCE = "10.231.0.9"
# The reproduction: 8,200 idle connections from one address in about 2 s (HAProxy's maxconn is 8,192).
FLOOD = 8200


@pytest.fixture
def other_source(deployed):
    """OTHER_SOURCE on the outer end of the host's veth while the test runs: the host answers it through its
    default route, which is that veth."""
    veth = deployed[0].veth
    subprocess.run(["ip", "addr", "add", f"{OTHER_SOURCE}/32", "dev", veth], check=True)
    try:
        yield OTHER_SOURCE
    finally:
        subprocess.run(["ip", "addr", "del", f"{OTHER_SOURCE}/32", "dev", veth], check=False)


def chat_from(endpoint, source: str, path: str = "/v1/chat/completions") -> int:
    """The status of one keyed request from `source` on a connection of its own (a chat, or GET `path`)."""
    import http.client
    import ssl

    url = urlsplit(endpoint.base_url)
    context = ssl.create_default_context(cafile=endpoint.credentials.ca_cert)
    connection = http.client.HTTPSConnection(
        url.hostname, url.port, context=context, timeout=60, source_address=(source, 0)
    )
    headers = {"Authorization": f"Bearer {endpoint.credentials.api_key}", "Content-Type": "application/json"}
    try:
        if path == "/v1/chat/completions":
            body = json.dumps(
                {
                    "model": "gemmaserve/tiny-gemma4-test",
                    "max_tokens": 2,
                    "messages": [{"role": "user", "content": "Hi"}],
                }
            )
            connection.request("POST", path, body, headers)
        else:
            connection.request("GET", path, headers=headers)
        return connection.getresponse().status
    finally:
        connection.close()


def test_one_address_flooding_the_port_leaves_it_to_other_clients(deployed, sandbox_host, other_source):
    """8,200 idle TCP connections from the outer machine's address in about 2 s, against the host's real HAProxy
    with the plan's limits: HAProxy holds the address's share (source_max_connections; its connection rate per
    10 s has the same budget) and closes the rest
    unanswered, so a client at another address gets its chats and /health answered, and the stats listener
    (Prometheus's scrape) answers on the host. tests/roles/fixtures/test_router_abuse.py shows, with small limits
    on loopback, that without the per-address rules the flood takes the port."""
    import errno
    import resource
    import socket

    host, host_plan = deployed[0], deployed[1]
    endpoint = sandbox_endpoint(host)
    port = urlsplit(endpoint.base_url).port
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert hard >= FLOOD + 200, f"this machine allows {hard} open files, the flood needs {FLOOD + 200}"
    resource.setrlimit(resource.RLIMIT_NOFILE, (FLOOD + 200, hard))
    flood: list[socket.socket] = []
    try:
        started = time.monotonic()
        for _ in range(FLOOD):  # never sends a byte; the kernel completes each connection or HAProxy closes it
            sock = socket.socket()
            sock.setblocking(False)
            assert sock.connect_ex((host.address, port)) in (0, errno.EINPROGRESS)
            flood.append(sock)
        opened = time.monotonic() - started
        time.sleep(2)  # HAProxy accepts the backlog and closes what is past the address's limit
        statuses = [chat_from(endpoint, other_source) for _ in range(5)]
        health = chat_from(endpoint, other_source, "/health")
        scrape = sandbox_host.run(
            f"curl -fsS -m 10 -o /dev/null -w '%{{http_code}}' http://127.0.0.1:{Settings().stats_port}/metrics"
        )
        table = haproxy_admin(sandbox_host, "show table client_addresses")
        held = conn_cur(table, f"::ffff:{host.gateway}")
        print(
            f"\n[figure] flood on the sandbox: {FLOOD} connections from {host.gateway} opened in {opened:.1f} s; "
            f"HAProxy held {held} (limit {host_plan.access.source_max_connections}); {other_source}: chats {statuses}, "
            f"/health {health}; stats {scrape.stdout}"
        )
        assert statuses == [200] * 5 and health == 200
        assert scrape.rc == 0 and scrape.stdout == "200"
        # At most the address's share; a few below it when this address's earlier requests (other tests) count
        # in its 10 s connection rate, whose budget equals the share.
        limit = host_plan.access.source_max_connections
        assert 0.95 * limit <= held <= limit
    finally:
        for sock in flood:
            sock.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        # Every later test (and module) on this host connects from the flooding address: wait until HAProxy has
        # let go of its connections and its 10 s connection rate has fallen back below the limit.
        wait_until(lambda: flood_gone(sandbox_host, host.gateway, host_plan), 60, "the flooding address let go")


def flood_gone(sandbox_host, address: str, host_plan) -> bool:
    """`address` holds few connections in HAProxy and opens new ones well below its rate limit again."""
    for line in haproxy_admin(sandbox_host, "show table client_addresses").splitlines():
        fields = dict(field.split("=", 1) for field in line.split()[1:] if "=" in field)
        if fields.get("key") == f"::ffff:{address}":
            rate = next((int(v) for k, v in fields.items() if k.startswith("conn_rate(")), 0)
            return int(fields.get("conn_cur", 0)) < 10 and rate < host_plan.access.source_connections_per_10s // 2
    return True


def test_certificate_file_is_root_only(deployed, sandbox_host):
    cert = sandbox_host.file(deployed[1].access.tls_cert)
    assert (cert.user, cert.mode) == ("root", 0o400)


# --- only the API: every route of the installed vLLM, through the balancer -----------------------------


@pytest.fixture(scope="module")
def vllm_routes(deployed, sandbox_host) -> list[dict]:
    """The installed vLLM's route table for the replica's own argv (dev-mode and runtime-LoRA routes
    included), checked against the OpenAPI document of the replica that is running."""
    _, host_plan, _, _ = deployed
    script = (Path(__file__).parent / "vllm_routes.py").read_text()
    sandbox_host.run(f"cat > /tmp/vllm_routes.py <<'EOF'\n{script}\nEOF")
    argv = shlex.join(host_plan.replicas[0].argv[1:])
    result = sandbox_host.run(
        f"VLLM_SERVER_DEV_MODE=1 VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 HF_HUB_OFFLINE=1 "
        f"{host_plan.engine.venv}/bin/python /tmp/vllm_routes.py -- {argv}"
    )
    assert result.rc == 0, result.stderr[-2000:]
    routes = json.loads(result.stdout.strip().splitlines()[-1])
    running = json.loads(sandbox_host.run(f"curl -fsS {host_plan.replicas[0].url}/openapi.json").stdout)["paths"]
    built = {r["path"] for r in routes}
    assert set(running) <= built, f"the running server has routes the listing lacks: {set(running) - built}"
    print(
        f"\n[figure] the pinned vLLM's route table: {len(routes)} routes ({len(running)} in the running server's OpenAPI document)"
    )
    return routes


def test_route_table_has_what_must_be_hidden(vllm_routes):
    paths = {r["path"] for r in vllm_routes}
    assert {"/metrics", "/tokenize", "/v1/load_lora_adapter", "/sleep", "/docs"} <= paths


def test_every_route_but_the_client_routes_is_refused_at_the_balancer(deployed, vllm_routes):
    endpoint = sandbox_endpoint(deployed[0])
    allowed = set(CLIENT_ROUTES) | {("GET", HEALTH_PATH), ("HEAD", HEALTH_PATH)}
    reached = []
    for route in vllm_routes:
        path = re.sub(r"\{[^}]+\}", "x", route["path"])
        for method in route["methods"] or ["GET", "POST"]:
            if (method, route["path"]) in allowed:
                continue
            status, body = endpoint.request(path, {} if method == "POST" else None, 30, method=method)
            # The balancer's own answer (404 unknown route / 405 method), never vLLM's; HEAD has no body.
            code = json.loads(body)["error"]["code"] if body.startswith("{") else None
            refused = status in (404, 405) and (method == "HEAD" or code in ("unknown_url", "method_not_allowed"))
            if not refused:
                reached.append((method, path, status, body[:100]))
    assert reached == []


def test_the_client_routes_are_served(deployed):
    endpoint = sandbox_endpoint(deployed[0])
    assert endpoint.request("/v1/models")[0] == 200
    assert chat(endpoint)[0] == 200
    completion = {"model": "gemmaserve/tiny-gemma4-test", "prompt": "Hi", "max_tokens": 4}
    assert endpoint.request("/v1/completions", completion)[0] == 200
    assert endpoint.request(HEALTH_PATH, key=None)[0] == 200


# --- hygiene: no key this module made or used anywhere on the host -------------------------------------


@pytest.mark.parametrize(
    "where, command",
    [
        ("the journal", "journalctl --no-pager -o cat"),
        ("HAProxy's log lines", "journalctl -u haproxy --no-pager -o cat"),
        (
            "key store, key map, HAProxy config",
            "cat /etc/gemmaserve/api-keys /etc/gemmaserve/api-keys.map /etc/haproxy/haproxy.cfg",
        ),
        ("systemctl show", "systemctl show haproxy gemmaserve-api-keys 'vllm@*'"),
        ("process environments", "cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n'"),
        ("process command lines", "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '"),
    ],
)
def test_no_api_key_on_the_host(deployed, sandbox_host, where, command):
    used = [*MADE, sandbox_endpoint(deployed[0]).credentials.api_key]
    assert len(used) >= 4, "the key tests above made no keys: the check would be vacuous"
    output = sandbox_host.run(command).stdout
    assert len(output) > 100, f"{where}: nothing read"
    assert [key for key in used if key in output] == []


def test_haproxy_logs_name_the_key_id(deployed, sandbox_host):
    log = sandbox_host.run("journalctl -u haproxy --no-pager -o cat").stdout
    assert re.search(r'"GET /v1/models HTTP/[0-9.]+" key=sandbox', log)


def test_no_api_key_in_pyinfra_output(deployed):
    assert sandbox_endpoint(deployed[0]).credentials.api_key not in deployed[3]


# --- the Secret Manager variants of the access units, which the sandbox (file sources) does not install ---


@pytest.mark.parametrize("unit", ["gemmaserve-api-keys.service", "gemmaserve-api-keys.timer", "gemmaserve-tls.service"])
def test_secret_manager_units_pass_systemd_analyze_verify(deployed, sandbox_host, unit):
    from roles.access import api_keys_timer, api_keys_unit, tls_unit

    spec = spec_from_host_data(
        {
            **sandbox_host_data(),
            "gemmaserve_serving": {
                "api_keys": {"secret_manager": "k"},
                "tls": {"secret_manager": "projects/p/secrets/t"},
            },
        }
    )
    access = plan(spec).require_ok().access
    text = {
        "gemmaserve-api-keys.service": api_keys_unit(access),
        "gemmaserve-api-keys.timer": api_keys_timer(),
        "gemmaserve-tls.service": tls_unit(access),
    }[unit]
    assert "secret_fetch.py" in text or unit.endswith(".timer")
    sandbox_host.run(f"mkdir -p /tmp/sm-units && cat > /tmp/sm-units/{unit} <<'EOF'\n{text}\nEOF")
    if unit.endswith(".timer"):  # a timer is verified with the service it starts
        sandbox_host.run("cp /etc/systemd/system/gemmaserve-api-keys.service /tmp/sm-units/")
    result = sandbox_host.run(f"systemd-analyze verify /tmp/sm-units/{unit}")
    assert result.rc == 0 and result.stderr.strip() == "", result.stderr
