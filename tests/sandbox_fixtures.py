"""Sandbox hosts for the tests that deploy to real hosts: brought up once per session and always torn down."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gemmaserve.sandbox import state


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "sandbox_teardown: checks what `down` leaves behind; runs before other sandbox tests"
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The teardown checks must run while no session host is up, or the NAT table
    # (removed only with the last host) could not be checked.
    items.sort(key=lambda item: item.get_closest_marker("sandbox_teardown") is None)


def sandbox_prerequisites() -> list[str]:
    missing = []
    if os.geteuid() != 0:
        missing.append("root (netns, veth, cgroups, systemd-nspawn)")
    if shutil.which("systemd-nspawn") is None and shutil.which("apt-get") is None:
        missing.append("systemd-nspawn (package systemd-container), and no apt-get to install it")
    if not os.path.exists("/proc/self/mounts") or "cgroup" not in open("/proc/self/mounts").read():
        missing.append("a mounted cgroup hierarchy")
    return missing


@pytest.fixture(scope="session")
def sandbox_ready() -> None:
    """Skip without the prerequisites; with CI=true, fail loudly instead of skipping."""
    missing = sandbox_prerequisites()
    if not missing:
        return
    reason = "sandbox hosts need " + "; ".join(missing)
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true and {reason}", pytrace=False)
    pytest.skip(reason)


class SandboxTeardown:
    """Downs the hosts this session started, once: from the finalizer, or atexit as a last resort.

    SIGTERM and SIGHUP become KeyboardInterrupt, so an `up` in progress unwinds (tearing down
    its half-made host and releasing the sandbox lock) and pytest runs the finalizers.
    """

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.started = False
        self.previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
        for sig in self.previous:
            signal.signal(sig, self._on_signal)
        atexit.register(self)

    def __call__(self) -> None:
        if self.started:
            return
        self.started = True
        from gemmaserve.sandbox import lifecycle

        try:
            ours = [h.name for h in state.load_state().hosts if h.name in self.names]
            if ours:
                lifecycle.down(ours)
        finally:
            atexit.unregister(self)
            for sig, handler in self.previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: object) -> None:
        if not self.started:  # a signal during teardown must not cut it short
            raise KeyboardInterrupt(f"signal {signum}: tearing the sandbox hosts down")


def bring_up(indices: list[int], request: pytest.FixtureRequest, bind_ro: tuple[str, ...] = ()) -> list[state.Host]:
    """Up the given hosts (with extra read-only binds, SRC:DST); only the ones this call started are torn
    down afterwards."""
    from gemmaserve.sandbox import lifecycle

    already = {h.name for h in lifecycle.status() if h.running}
    teardown = SandboxTeardown([state.host_name(i) for i in indices if state.host_name(i) not in already])
    request.addfinalizer(teardown)
    return lifecycle.up_hosts(indices, bind_ro=bind_ro)


def bring_up_new(count: int, request: pytest.FixtureRequest, bind_ro: tuple[str, ...] = ()) -> list[state.Host]:
    """`count` hosts of their own (with extra read-only binds, SRC:DST), at free indices from 101 taken under
    the sandbox lock (make test's other worker may be taking some at the same time: tests/conftest.py); torn
    down afterwards."""
    from gemmaserve.sandbox import lifecycle

    teardown = SandboxTeardown([])
    request.addfinalizer(teardown)
    hosts = lifecycle.up_new_hosts(count, bind_ro=bind_ro)
    teardown.names = [h.name for h in hosts]
    return hosts


@pytest.fixture(scope="session")
def served_assets(sandbox_ready: None) -> None:
    """The prebuilt vLLM CPU venv and the tiny test model, which hosts bind read-only at boot.

    Built before any host comes up (binds are fixed when nspawn starts); both are cached after the
    first build, so later sessions take well under a second here.
    """
    from gemmaserve.sandbox.demo import ensure_engine_and_model

    ensure_engine_and_model()


@pytest.fixture(scope="session")
def sandbox_hosts(
    request: pytest.FixtureRequest, sandbox_ready: None, served_assets: None
) -> Iterator[list[state.Host]]:
    """sandbox-1..N (N = request.param, default 1), running; hosts that were already up are reused."""
    count = getattr(request, "param", 1)
    yield bring_up(list(range(1, count + 1)), request)


@pytest.fixture(scope="session")
def sandbox_ssh_config(tmp_path_factory: pytest.TempPathFactory) -> str:
    # Host keys are new on every `up`; there is nothing to pin.
    path = tmp_path_factory.mktemp("ssh") / "config"
    path.write_text(
        f"Host *\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  IdentityFile {state.SSH_KEY}\n"
    )
    return str(path)


@pytest.fixture(scope="session")
def sandbox_host(sandbox_hosts: list[state.Host], sandbox_ssh_config: str):
    """A testinfra host for sandbox-1, over ssh (paramiko) with the sandbox key."""
    import testinfra

    return testinfra.get_host(
        f"paramiko://{state.SSH_USER}@{sandbox_hosts[0].address}",
        ssh_config=sandbox_ssh_config,
        ssh_identity_file=str(state.SSH_KEY),
    )


@pytest.fixture(scope="module")
def fresh_sandbox_host(
    request: pytest.FixtureRequest, sandbox_ready: None, served_assets: None
) -> Iterator[state.Host]:
    """A host of its own (first free index from 101), for tests that take it down themselves.

    The engine and test model are built first: hosts bind them read-only when they boot.
    """
    [host] = bring_up_new(1, request)
    yield host


@pytest.fixture(scope="session")
def served_image(served_assets: None):
    """The sandbox's serving image (gemmaserve/sandbox/image.py): built once per input change (minutes),
    then cached as an OCI archive that hosts booted afterwards get bound read-only."""
    from gemmaserve.sandbox.demo import ensure_image

    return ensure_image()


def compiled_data() -> dict:
    """Host data for a replica with torch.compile on (the sandbox profile runs eager)."""
    from gemmaserve.sandbox.profile import sandbox_host_data

    return {"gemmaserve_workload": {**sandbox_host_data()["gemmaserve_workload"], "enforce_eager": False}}


@dataclass
class SandboxBucket:
    """The running emulator and the host data that deploys from its mirror of the test model (compiled)."""

    emulator: Any
    data: dict


@pytest.fixture(scope="session")
def bucket_emulator(served_assets: None) -> Iterator[SandboxBucket]:
    """The sandbox's bucket (fake-gcs-server on the sandbox network, gemmaserve/sandbox/bucket.py) holding
    the test model's mirror; stopped and its data removed at the end of the session."""
    from gemmaserve.ops.weights import storage_client
    from gemmaserve.sandbox import bucket
    from gemmaserve.sandbox.demo import mirror_test_model

    emulator = bucket.up()
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("STORAGE_EMULATOR_HOST", emulator.endpoint)
            data, mirrored = mirror_test_model(storage_client(), progress=lambda _: None)
            assert mirrored.manifest_written
        yield SandboxBucket(emulator, {**compiled_data(), **data})
    finally:
        bucket.down()


@dataclass
class BucketHosts:
    """Two hosts deployed from the sandbox's bucket with torch.compile on: A pulled the weights, compiled
    and saved its compile cache to the bucket; B was deployed after that (at `b_started`, its clock) and
    restored A's cache. `data` is the host data both were deployed with."""

    hosts: list[state.Host]
    remotes: list[Any]
    plan: Any
    data: dict
    b_started: float


@pytest.fixture(scope="session")
def bucket_hosts(
    request: pytest.FixtureRequest,
    bucket_emulator: SandboxBucket,
    sandbox_ssh_config: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> BucketHosts:
    """Deployed once per session and read by three modules: the compile-cache tests (host A: a compiled
    replica, its cache on /dev/shm and disk), the bucket tests (A and B), and as `serving_peer` (B)."""
    import testinfra

    from gemmaserve.plan import plan
    from gemmaserve.sandbox.profile import sandbox_host_data
    from gemmaserve.sources import spec_from_host_data

    data = bucket_emulator.data
    up = bring_up_new(2, request)
    remotes = [
        testinfra.get_host(
            f"paramiko://{state.SSH_USER}@{h.address}",
            ssh_config=sandbox_ssh_config,
            ssh_identity_file=str(state.SSH_KEY),
        )
        for h in up
    ]
    first = deploy(up[0].name, data, tmp_path_factory.mktemp("bucket-a"))
    assert first.returncode == 0, first.output[-4000:]
    saved = remotes[0].run(
        "systemctl start gemmaserve-cache-save.service && journalctl -u gemmaserve-cache-save -o cat"
    )
    assert saved.rc == 0, saved.stderr
    host_plan = plan(spec_from_host_data({**sandbox_host_data(), **data})).require_ok()
    # A host restores another host's cache only once it is promoted (docs/weights-and-caches.md): A's, with the
    # command the docs give operators, run on A (with its access to the bucket: here the emulator's address).
    weights = host_plan.weights
    promote = (
        f"STORAGE_EMULATOR_HOST={bucket_emulator.emulator.endpoint} python3 /opt/gemmaserve/lib/compile_cache.py "
        f"promote --keys {host_plan.replicas[0].cache_key} --from-host $(hostname) --bucket {weights.bucket} "
        f"--bucket-prefix {weights.compile_cache_prefix}"
    )
    promoted = remotes[0].run(promote)
    assert promoted.rc == 0, promoted.stderr
    started = float(remotes[1].run("date +%s.%N").stdout)
    second = deploy(up[1].name, data, tmp_path_factory.mktemp("bucket-b"))
    assert second.returncode == 0, second.output[-4000:]
    return BucketHosts(up, remotes, host_plan, data, started)


@pytest.fixture(scope="session")
def serving_peer(bucket_hosts: BucketHosts) -> state.Host:
    """A second host serving the test model: where clients go while a host under test reboots, and a wheel
    host without a container runtime. Bucket host B (one wheel replica) is that host already; a host of its
    own would cost a boot and a deploy (about a minute) for nothing the tests read."""
    return bucket_hosts.hosts[1]


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The vLLM CPU venv's python, built on first use (about 2 minutes, then cached under /opt/gemmaserve)."""
    from gemmaserve.sandbox.demo import ensure_engine, sandbox_plan

    python = Path(f"{sandbox_plan().engine.venv}/bin/python")
    if not python.exists() and os.geteuid() != 0:
        reason = f"building the vLLM CPU venv {python.parent.parent} needs root"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    return Path(ensure_engine())


def deploy(host_name: str, data: dict | None = None, tmp_path: Path | None = None, timeout: float = 900):
    """`pyinfra --json -y --limit HOST hosts/sandbox.py deploy.py`, with host-data overrides (a YAML file in
    `tmp_path`, named by the sandbox profile's override variable); returns the fleet's PyinfraRun."""
    import time

    import yaml

    from gemmaserve.ops import fleet
    from gemmaserve.sandbox.profile import OVERRIDE_ENV

    override = None
    if data is not None:
        assert tmp_path is not None, "host-data overrides are written to a file in tmp_path"
        override = tmp_path / f"override-{time.monotonic_ns()}.yaml"
        override.write_text(yaml.safe_dump(data))
    return fleet.run_pyinfra(
        limit=[host_name], env={OVERRIDE_ENV: str(override) if override else None}, timeout=timeout
    )


def sandbox_endpoint(host: state.Host):
    """The one way tests call a sandbox host's load balancer, as a client would: over TLS verified against
    the sandbox's CA, with the sandbox's API key (gemmaserve.ops.endpoint.Endpoint: .base_url, .openai(),
    .request(path, payload), .url(path), .credentials)."""
    from gemmaserve.sandbox import credentials

    return credentials.endpoint(host)


def poll(predicate, timeout: float, interval: float = 1.0) -> bool:
    """Whether `predicate` held within `timeout` seconds, polled every `interval` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


def wait_until(predicate, timeout: float, what: str) -> None:
    """Poll `predicate` every second until it holds; fail naming `what` after `timeout` seconds."""
    if not poll(predicate, timeout):
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


# A host's answer when none of its replicas is in service, so no replica accepted the request: HAProxy's own
# 503 body (least-outstanding), or the router's OpenAI-style 503 (prefix-affinity: roles/router error_bodies'
# "overloaded", code server_overloaded; a status 503, never the 429 of a queue that timed out at a replica).
NO_SERVER = ("No server is available to handle this request", '"code": "server_overloaded"')


@dataclass
class Load:
    """A bounded client loop against sandbox hosts' balancers: `threads` workers, at most `limit` chat
    requests or `seconds`, whichever first; every non-200 answer or error is recorded in `failures`.
    `key` overrides the endpoint's API key ("" keeps it).

    `endpoint` is one host's endpoint or several: a request a host does not accept (connection refused, or
    HAProxy with no replica to give it to) goes to the next, as a balancer in front of the hosts would send
    it (`rerouted` counts those). Every `stream_every`-th request streams `stream_tokens` tokens and must
    reach `[DONE]`; `spans` records (start, end, endpoint index) of every completed request."""

    endpoint: Any
    model: str
    limit: int = 400
    seconds: float = 600
    threads: int = 3
    key: str | None = ""
    stream_every: int = 0
    stream_tokens: int = 200
    ok: int = 0
    rerouted: int = 0
    failures: list[str] = field(default_factory=list)
    # When each failed request was sent (monotonic), in the order of `failures`.
    failures_sent: list[float] = field(default_factory=list)
    spans: list[tuple[float, float, int]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _sent: int = 0

    def _attempt(self, endpoint: Any, streaming: bool, number: int) -> tuple[int, str]:
        # Each request its own conversation: under prefix-affinity routing (the default) identical requests
        # would all hash to one replica, and a fault on the other would prove nothing.
        payload = {"model": self.model, "temperature": 0, "messages": [{"role": "user", "content": f"ping {number}"}]}
        if streaming:
            payload.update(max_tokens=self.stream_tokens, stream=True, ignore_eos=True)
        else:
            payload.update(max_tokens=4)
        return endpoint.request("/v1/chat/completions", payload, 120, key=self.key)

    def _one(self, number: int) -> None:
        from gemmaserve.ops.endpoint import EndpointError

        endpoints = list(self.endpoint) if isinstance(self.endpoint, list | tuple) else [self.endpoint]
        order = [(number + k) % len(endpoints) for k in range(len(endpoints))]
        streaming = bool(self.stream_every) and number % self.stream_every == 0
        started = time.monotonic()
        for position, which in enumerate(order):
            last, url = position == len(order) - 1, endpoints[which].base_url
            try:
                status, body = self._attempt(endpoints[which], streaming, number)
            except EndpointError as error:
                cause = error.__cause__
                if isinstance(getattr(cause, "reason", cause), ConnectionRefusedError) and not last:
                    with self._lock:
                        self.rerouted += 1
                    continue
                with self._lock:
                    self.failures.append(f"{url}: {error!r}")
                    self.failures_sent.append(started)
                return
            if status == 503 and any(marker in body for marker in NO_SERVER) and not last:
                with self._lock:
                    self.rerouted += 1
                continue
            problem = None
            if status != 200:
                problem = f"HTTP {status}: {body[:200]}"
            elif streaming and "data: [DONE]" not in body:
                problem = f"stream cut after {body.count('data:')} events"
            elif not streaming and "choices" not in json.loads(body):
                problem = f"no choices: {body[:200]}"
            with self._lock:
                if problem:
                    self.failures.append(f"{url}: {problem}")
                    self.failures_sent.append(started)
                else:
                    self.ok += 1
                    self.spans.append((started, time.monotonic(), which))
            return

    def failed_sent_before(self, moment: float) -> int:
        """Failed requests that were sent before `moment`."""
        return sum(1 for sent in self.failures_sent if sent < moment)

    def failures_sent_after(self, moment: float) -> list[str]:
        """The failures of requests sent at or after `moment`."""
        return [failure for failure, sent in zip(self.failures, self.failures_sent, strict=True) if sent >= moment]

    def in_flight_at(self, moment: float, endpoint: int | None = None) -> int:
        """Completed requests (to endpoint number `endpoint`, or any) that started before `moment` and ended
        after it."""
        return sum(1 for start, end, to in self.spans if start < moment < end and endpoint in (None, to))

    def _worker(self, deadline: float) -> None:
        while not self._stop.is_set() and time.monotonic() < deadline:
            with self._lock:
                if self._sent >= self.limit:
                    return
                self._sent += 1
                number = self._sent
            self._one(number)

    def __enter__(self) -> Load:
        deadline = time.monotonic() + self.seconds
        self._workers = [
            threading.Thread(target=self._worker, args=(deadline,), daemon=True) for _ in range(self.threads)
        ]
        for worker in self._workers:
            worker.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for worker in self._workers:
            worker.join(timeout=150)
