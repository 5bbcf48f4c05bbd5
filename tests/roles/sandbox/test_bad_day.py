"""A sandbox host on a bad day: a replica that drops the requests it takes (HAProxy replays none of them), and a
reboot while the API key source is unreachable (the last good keys stay live, the failure is reported)."""

from __future__ import annotations

import base64
import json
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from gemmaserve.ops.keys import key_digest, new_api_key
from gemmaserve.plan import plan
from gemmaserve.sandbox import credentials, lifecycle
from gemmaserve.sandbox.profile import sandbox_host_data
from gemmaserve.sources import spec_from_host_data
from tests.roles import dropping_replica, fake_secret_manager
from tests.sandbox_fixtures import deploy, sandbox_endpoint, wait_until

pytestmark = pytest.mark.sandbox

LIB = "/opt/gemmaserve/lib"
# What this module puts on the host, removed at the end of each fixture.
TEST_DIR = "/opt/gemmaserve-bad-day"
DROPPING_UNIT = "gemmaserve-test-dropping-replica"
SECRET_MANAGER_UNIT = "gemmaserve-test-secret-manager"
# test_preemption's fake metadata server takes 8999.
SECRET_MANAGER_PORT = 8998
SECRET = "projects/gemmaserve-sandbox/secrets/api-keys"
KEYS_UNIT = "gemmaserve-api-keys.service"
KEY_MAP = "/etc/gemmaserve/api-keys.map"
# The key unit's own environment, as a drop-in: where secret_fetch.py finds Google (the fake, on loopback), and
# how long it retries an unreachable one (120 s by default; 15 s keeps the boot short and still retries).
METADATA = f"http://127.0.0.1:{SECRET_MANAGER_PORT}/computeMetadata/v1"
FETCH_ENV = "/etc/systemd/system/gemmaserve-api-keys.service.d/gemmaserve-test-secret-manager.conf"
FETCH_TIMEOUT = 15
FROM_SECRET_MANAGER = {"gemmaserve_serving": {"api_keys": {"secret_manager": SECRET}}}


def install(sandbox_host, source: bytes, dest: str, mode: str = "0600") -> None:
    encoded = base64.b64encode(source).decode()
    result = sandbox_host.run(
        f"install -d -m 0700 {TEST_DIR} && echo {encoded} | base64 -d > {dest} && chmod {mode} {dest}"
    )
    assert result.rc == 0, result.stderr


def haproxy_status(sandbox_host) -> dict[str, str]:
    return json.loads(sandbox_host.run(f"python3 {LIB}/haproxy_admin.py status vllm").stdout or "{}")


def replica_up(sandbox_host, index: int) -> bool:
    return haproxy_status(sandbox_host).get(f"replica{index}") == "UP"


def replica_back(sandbox_host, replica) -> bool:
    active = sandbox_host.run(f"systemctl is-active {replica.unit}").stdout.strip() == "active"
    return active and replica_up(sandbox_host, replica.index)


def chat(endpoint, model: str, key: str | None = "") -> tuple[int, str]:
    payload = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    return endpoint.request("/v1/chat/completions", payload, 120, key=key)


def key_journal(sandbox_host) -> str:
    return sandbox_host.run(f"journalctl -b -u {KEYS_UNIT} --no-pager -o cat").stdout


@pytest.fixture(scope="module")
def served(sandbox_hosts, tmp_path_factory):
    """sandbox-1 deployed with the profile as it is (one replica, keys from the file source)."""
    host = sandbox_hosts[0]
    tmp_path = tmp_path_factory.mktemp("bad-day")
    result = deploy(host.name, {}, tmp_path)
    assert result.returncode == 0, result.output[-4000:]
    return host, plan(spec_from_host_data(sandbox_host_data())).require_ok(), tmp_path


# --- a replica that drops what it takes ---------------------------------------------------------------


@pytest.fixture
def dropping(served, sandbox_host):
    """Replica 0 stopped and, on its port, a program that counts each request it gets and closes the connection
    unanswered (tests/roles/dropping_replica.py), in HAProxy's rotation; replica 0 back and UP afterwards."""
    _, host_plan, _ = served
    replica = host_plan.replicas[0]
    program = f"{TEST_DIR}/dropping_replica.py"
    wait_until(lambda: replica_back(sandbox_host, replica), 300, f"{replica.unit} active and UP")
    try:
        install(sandbox_host, Path(dropping_replica.__file__).read_bytes(), program)
        # Its ExecStop drains it in HAProxy first (weight 0, state drain).
        stopped = sandbox_host.run(f"systemctl stop {replica.unit}")
        assert stopped.rc == 0, stopped.stderr
        started = sandbox_host.run(
            f"systemd-run --unit {DROPPING_UNIT} --collect --property=Type=simple "
            f"python3 {program} --bind {replica.address} --port {replica.port}"
        )
        assert started.rc == 0, started.stderr
        # /received is no vLLM route: only the dropping replica answers it.
        wait_until(
            lambda: sandbox_host.run(f"curl -fsS -o /dev/null {replica.url}/received").rc == 0,
            30,
            "the dropping replica to listen on replica 0's port",
        )
        ready = sandbox_host.run(f"python3 {LIB}/haproxy_admin.py ready vllm/replica{replica.index} --timeout 30")
        assert ready.rc == 0, ready.stderr
        wait_until(lambda: replica_up(sandbox_host, replica.index), 30, "HAProxy to see the dropping replica UP")
        yield replica
    finally:
        sandbox_host.run(f"systemctl stop {DROPPING_UNIT}")
        sandbox_host.run(f"rm -f {program}; rmdir {TEST_DIR}")
        # ExecStartPost puts it back in rotation once vLLM is ready.
        restarted = sandbox_host.run(f"systemctl start --no-block {replica.unit}")
        assert restarted.rc == 0, restarted.stderr
        # Active once its ExecStartPost found vLLM ready (HAProxy may still call the stopped program UP until
        # its checks fail); then UP in HAProxy.
        wait_until(lambda: replica_back(sandbox_host, replica), 300, f"{replica.unit} active and UP again")


def test_a_request_a_replica_dropped_is_not_replayed(served, sandbox_host, dropping):
    """HAProxy retries only a request no replica received (`retry-on conn-failure`): one that a replica took and
    dropped unanswered reaches the client as an error, and the replica got it once, not once per retry."""
    host, host_plan, _ = served
    payload = {"model": host_plan.model.hf_id, "prompt": "Count to ten.", "max_tokens": 4}
    began = time.monotonic()
    status, body = sandbox_endpoint(host).request("/v1/completions", payload, 60)
    answered = time.monotonic() - began
    received = json.loads(sandbox_host.run(f"curl -fsS {dropping.url}/received").stdout)
    # Only HAProxy sends the replica POSTs (the host's metrics scraper GETs /metrics from it directly).
    posts = {request: count for request, count in received.items() if request.startswith("POST ")}
    print(
        f"\n[figure] a /v1/completions dropped by its replica: HTTP {status} after {answered:.2f} s; received {received}"
    )
    assert posts == {"POST /v1/completions": 1}
    assert status == 502, body


# --- a reboot without the key source ------------------------------------------------------------------


@pytest.fixture(scope="module")
def keys_from_secret_manager(served, sandbox_host):
    """sandbox-1 deployed with its keys in Secret Manager: a fake of it on the host's loopback
    (tests/roles/fake_secret_manager.py) whose secret holds the sandbox's key and one more, `bad-day`, that only
    the secret holds; yields (host, plan, that key). Afterwards: the fake stopped and the file source deployed."""
    host, host_plan, tmp_path = served
    extra_key = new_api_key()
    created = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    store = credentials.ensure(host).key_store.read_text() + f"bad-day {key_digest(extra_key)} {created}\n"
    program, payload = f"{TEST_DIR}/fake_secret_manager.py", f"{TEST_DIR}/api-keys-secret"
    try:
        install(sandbox_host, Path(fake_secret_manager.__file__).read_bytes(), program)
        install(sandbox_host, store.encode(), payload)
        start_secret_manager(sandbox_host)
        env = (
            "[Service]\n"
            f"Environment=GEMMASERVE_METADATA_URL={METADATA}\n"
            f"Environment=GEMMASERVE_SECRETMANAGER_URL=http://127.0.0.1:{SECRET_MANAGER_PORT}/v1\n"
            f"Environment=GEMMASERVE_FETCH_TIMEOUT={FETCH_TIMEOUT}\n"
        )
        written = sandbox_host.run(
            f"mkdir -p $(dirname {FETCH_ENV}) && cat > {FETCH_ENV} <<'EOF'\n{env}EOF\nsystemctl daemon-reload"
        )
        assert written.rc == 0, written.stderr
        result = deploy(host.name, FROM_SECRET_MANAGER, tmp_path)
        assert result.returncode == 0, result.output[-4000:]
        yield host, plan(spec_from_host_data({**sandbox_host_data(), **FROM_SECRET_MANAGER})).require_ok(), extra_key
    finally:
        sandbox_host.run(f"systemctl stop {SECRET_MANAGER_UNIT}")
        sandbox_host.run(f"rm -f {FETCH_ENV}; rmdir $(dirname {FETCH_ENV}); rm -rf {TEST_DIR}; systemctl daemon-reload")
        # The sandbox's own key source again: the unit syncs the file store, the key only the secret held is gone.
        restored = deploy(host.name, {}, tmp_path)
        assert restored.returncode == 0, restored.output[-4000:]


def start_secret_manager(sandbox_host) -> None:
    started = sandbox_host.run(
        f"systemd-run --unit {SECRET_MANAGER_UNIT} --collect --property=Type=simple python3 "
        f"{TEST_DIR}/fake_secret_manager.py --port {SECRET_MANAGER_PORT} --secret {SECRET} "
        f"--file {TEST_DIR}/api-keys-secret"
    )
    assert started.rc == 0, started.stderr
    project = f"curl -fsS -o /dev/null -H 'Metadata-Flavor: Google' {METADATA}/project/project-id"
    wait_until(lambda: sandbox_host.run(project).rc == 0, 30, "the fake Secret Manager to answer")


def test_a_reboot_without_the_key_source_keeps_the_last_good_keys(keys_from_secret_manager, sandbox_host):
    """At boot the key unit cannot fetch the secret (nothing answers where Secret Manager was): HAProxy starts
    with the key map the last good store left on disk, both keys of the secret are still served, a wrong key is
    still refused, and the unit's journal says the fetch failed and what is kept."""
    host, host_plan, extra_key = keys_from_secret_manager
    endpoint, model = sandbox_endpoint(host), host_plan.model.hf_id
    wait_until(lambda: replica_back(sandbox_host, host_plan.replicas[0]), 300, "replica0 active and UP")
    assert chat(endpoint, model, extra_key)[0] == 200, "the key only the secret holds is not served: no fetch"
    map_before = sandbox_host.run(f"cat {KEY_MAP}").stdout
    assert sorted(line.split()[1] for line in map_before.splitlines()) == ["bad-day", "sandbox"]

    stopped = sandbox_host.run(f"systemctl stop {SECRET_MANAGER_UNIT}")
    assert stopped.rc == 0, stopped.stderr
    began = time.monotonic()
    host.pid = lifecycle.reboot(host.name, timeout=300, boot_timeout=480).pid
    rebooted = time.monotonic() - began
    # The old ssh session died with the host: drop testinfra's cached paramiko client to reconnect.
    sandbox_host.backend.__dict__.pop("client", None)
    wait_until(
        lambda: replica_back(sandbox_host, host_plan.replicas[0]), 300, "replica0 active and UP after the reboot"
    )
    journal = key_journal(sandbox_host)
    failed_syncs = journal.count(f"could not fetch {SECRET}")
    print(
        f"\n[figure] reboot without the key source: booted in {rebooted:.1f} s, {failed_syncs} failed key sync(s) so far"
    )

    assert chat(endpoint, model)[0] == 200
    assert chat(endpoint, model, extra_key)[0] == 200
    status, body = chat(endpoint, model, "gsk-wrong-key-0123456789abcdefghij")
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key", body
    assert f"could not fetch {SECRET}" in journal, journal
    assert "keeps serving the 2 key(s) of the last good store (ids: bad-day, sandbox)" in journal, journal
    assert "Failed with result 'exit-code'" in journal, journal
    assert sandbox_host.run(f"cat {KEY_MAP}").stdout == map_before

    # The source answers again: the next sync takes the secret as it is.
    start_secret_manager(sandbox_host)
    synced = sandbox_host.run(f"systemctl start {KEYS_UNIT}")
    assert synced.rc == 0, synced.stderr
    assert "2 key(s) live in HAProxy (ids: sandbox, bad-day)" in key_journal(sandbox_host)
