"""A spot host on the sandbox: the preemption drain against a metadata-server fake running inside the host.

Under a bounded streaming load through HAProxy, the fake flips instance/preempted to TRUE: every
request that started before the notice must finish whole, and HAProxy's /health (what the cloud load
balancer probes) must stop answering 200. Clearing the flag brings the replica back; a deploy without
`gemmaserve_capacity` removes the unit again.
"""

from __future__ import annotations

import base64
import json
import re
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gemmaserve.plan import plan
from gemmaserve.sandbox.profile import sandbox_host_data
from gemmaserve.sources import spec_from_host_data
from tests.roles import fake_metadata
from tests.sandbox_fixtures import deploy, poll, sandbox_endpoint, wait_until

pytestmark = pytest.mark.sandbox

FAKE_PORT = 8999
FAKE = "/opt/gemmaserve-test/fake_metadata.py"
FAKE_UNIT = "gemmaserve-test-metadata"
UNIT = "gemmaserve-preemption.service"
GRACE = 20
SPOT = {
    "gemmaserve_capacity": {"kind": "gce-vm", "provisioning": "spot"},
    "preemption_metadata_url": f"http://127.0.0.1:{FAKE_PORT}/computeMetadata/v1",
    "preemption_grace_seconds": GRACE,
}


def health(endpoint) -> int:
    """HAProxy's /health as the cloud load balancer probes it (over TLS, no API key)."""
    try:
        with endpoint.credentials.opener().open(endpoint.url("/health"), timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return 0


def flip(sandbox_host, key: str, value: str) -> None:
    command = f"curl -fsS -X PUT --data {value} http://127.0.0.1:{FAKE_PORT}/control/{key}"
    assert sandbox_host.run(command).rc == 0


@pytest.fixture(scope="module")
def spot_host(sandbox_hosts, sandbox_host, tmp_path_factory):
    host = sandbox_hosts[0]
    tmp_path = tmp_path_factory.mktemp("preemption")
    source = base64.b64encode(Path(fake_metadata.__file__).read_bytes()).decode()
    started = sandbox_host.run(
        f"install -d /opt/gemmaserve-test && echo {source} | base64 -d > {FAKE} && "
        f"systemd-run --unit {FAKE_UNIT} --property=Type=simple python3 {FAKE} --port {FAKE_PORT}"
    )
    assert started.rc == 0, started.stderr
    result = deploy(host.name, SPOT, tmp_path)
    assert result.returncode == 0, result.output[-4000:]
    print(f"\n[figure] deploy adding the preemption drain: {result.seconds:.1f} s")
    host_plan = plan(spec_from_host_data({**sandbox_host_data(), **SPOT})).require_ok()
    endpoint = sandbox_endpoint(host)
    wait_until(lambda: health(endpoint) == 200, 300, "the endpoint to serve")
    yield host, host_plan, tmp_path, endpoint
    sandbox_host.run(f"systemctl stop {FAKE_UNIT}; rm -rf /opt/gemmaserve-test")
    for replica in host_plan.replicas:
        sandbox_host.run(f"python3 /opt/gemmaserve/lib/haproxy_admin.py ready vllm/replica{replica.index}")


@dataclass
class Stream:
    started: float
    ended: float = 0.0
    ok: bool = False
    error: str = ""
    chunks: int = 0
    answered: bool = False  # the response's headers came: HAProxy took it and a replica is answering


@dataclass
class StreamingLoad:
    """`workers` clients streaming chat completions back to back, each at most `seconds`; every one recorded."""

    endpoint: Any
    model: str
    seconds: float
    workers: int = 4
    max_tokens: int = 400
    streams: list[Stream] = field(default_factory=list)
    stop_new: threading.Event = field(default_factory=threading.Event)
    # While set, no worker starts a request: the notice lands when every request sent is being answered, so
    # "started before the notice" means "HAProxy took it", not "a client thread had begun its TLS handshake".
    hold: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _one(self, stream: Stream) -> None:
        body = json.dumps(
            {
                "model": self.model,
                "max_tokens": self.max_tokens,
                "temperature": 0,
                # vLLM's sampling extension: the tiny test model would otherwise stop at a random EOS.
                "ignore_eos": True,
                "stream": True,
                "messages": [{"role": "user", "content": "Count slowly."}],
            }
        ).encode()
        headers = {"Content-Type": "application/json", **self.endpoint.credentials.headers()}
        request = urllib.request.Request(self.endpoint.url("/v1/chat/completions"), data=body, headers=headers)
        try:
            with self.endpoint.credentials.opener().open(request, timeout=120) as response:
                stream.answered = True
                for line in response:
                    if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                        stream.chunks += 1
                    if line.strip() == b"data: [DONE]":
                        stream.ok = True
            if not stream.ok:
                stream.error = f"stream ended without [DONE] after {stream.chunks} chunks"
        except Exception as error:  # every failure is recorded and asserted on
            stream.error = repr(error)
        stream.ended = time.monotonic()

    def _worker(self, deadline: float) -> None:
        while time.monotonic() < deadline and not self.stop_new.is_set():
            with self._lock:  # checked and recorded at once: a request is either held or in `streams`
                stream = None if self.hold.is_set() else Stream(started=time.monotonic())
                if stream is not None:
                    self.streams.append(stream)
            if stream is None:
                time.sleep(0.05)
                continue
            self._one(stream)
            if not stream.ok:
                time.sleep(0.2)  # refused (after the notice): do not hammer HAProxy

    def in_flight(self, min_chunks: int) -> list[Stream]:
        return [s for s in list(self.streams) if not s.ended and s.chunks >= min_chunks]

    def pause(self) -> None:
        with self._lock:
            self.hold.set()

    def unanswered(self) -> list[Stream]:
        """Requests sent whose answer has not begun: on their way to HAProxy, or waiting in its queue."""
        return [s for s in list(self.streams) if not s.ended and not s.answered]

    def __enter__(self) -> StreamingLoad:
        deadline = time.monotonic() + self.seconds
        self._threads = [
            threading.Thread(target=self._worker, args=(deadline,), daemon=True) for _ in range(self.workers)
        ]
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        for thread in self._threads:
            thread.join(timeout=150)


def test_unit_is_installed_and_valid(spot_host, sandbox_host):
    assert sandbox_host.service(UNIT).is_running and sandbox_host.service(UNIT).is_enabled
    verify = sandbox_host.run(f"systemd-analyze verify /etc/systemd/system/{UNIT}")
    assert verify.rc == 0, verify.stderr


def test_preemption_notice_under_load_loses_no_request_started_before_it(spot_host, sandbox_host):
    host, host_plan, _, endpoint = spot_host
    assert health(endpoint) == 200
    with StreamingLoad(endpoint, host_plan.model.hf_id, seconds=150) as load:
        wait_until(lambda: sum(s.ok for s in load.streams) >= 2, 60, "the load to start")

        def midway() -> list[Stream]:
            # Streams past their first 20 chunks with 150 or more still to come: they outlast the notice.
            return [s for s in load.in_flight(min_chunks=20) if s.chunks < load.max_tokens - 150]

        for _attempt in range(3):
            # The notice lands while streams are half way: they must run to their end on a drained replica.
            # Polled often: a stream of the tiny model is midway for about two seconds.
            assert poll(lambda: len(midway()) >= 2, 60, interval=0.1), "no two streams in the middle of their answer"
            # A request whose client began it a moment before the notice may reach HAProxy after the drain, and
            # be refused as it should: no request starts until every one sent is being answered (CI on a loaded
            # machine caught one such 503, begun before the notice with no answer yet).
            load.pause()
            wait_until(lambda: not load.unanswered(), 30, "every request sent to be answered")
            if len(midway()) >= 2:
                break
            # On a loaded machine the streams ended while the last requests waited for their answer (a CI run
            # saw none left at the notice): let the load build up again.
            load.hold.clear()
        notice = time.monotonic()
        flip(sandbox_host, "instance/preempted", "TRUE")
        load.hold.clear()
        wait_until(lambda: health(endpoint) != 200, 10, "/health to fail after the notice")
        unhealthy = time.monotonic() - notice
        time.sleep(3)  # a few requests after the notice: refused, as the load balancer would stop sending them
        load.stop_new.set()
    before = [s for s in load.streams if s.started < notice]
    in_flight = [s for s in before if s.ended > notice]
    failed = [s for s in before if not s.ok]
    after = [s for s in load.streams if s.started >= notice]
    lasted = max(s.ended for s in in_flight) - notice if in_flight else 0.0
    print(
        f"\n[figure] preemption notice under load: {len(before)} requests started before it"
        f" ({len(in_flight)} in flight), {len(failed)} failed; /health non-200 after {unhealthy:.1f} s;"
        f" last in-flight stream ended {lasted:.1f} s after the notice; {len(after)} started after"
        f" ({sum(not s.ok for s in after)} refused)"
    )
    assert len(in_flight) >= 2, "fewer than two requests in flight at the notice: the test would prove little"
    assert failed == [], [s.error for s in failed]
    assert lasted < GRACE
    journal = sandbox_host.run(f"journalctl -u {UNIT} --no-pager -o cat").stdout
    assert "notice: instance/preempted=TRUE" in journal
    wait_until(
        lambda: "drained 1 replica(s)" in sandbox_host.run(f"journalctl -u {UNIT} --no-pager -o cat").stdout,
        GRACE + 5,
        "the drain to report idle replicas",
    )
    drained = re.search(
        r"drained 1 replica\(s\) \(replica0\) in ([\d.]+) s",
        sandbox_host.run(f"journalctl -u {UNIT} --no-pager -o cat").stdout,
    )
    print(f"[figure] drain: replica0 idle {drained[1]} s after the notice reached the host")
    assert sandbox_host.file("/run/gemmaserve-preemption/notice").exists


def test_cleared_notice_brings_the_replica_back(spot_host, sandbox_host):
    _, _, _, endpoint = spot_host
    flip(sandbox_host, "instance/preempted", "FALSE")
    wait_until(lambda: health(endpoint) == 200, 60, "/health to be 200 again")
    # The unit removes its marker once every replica is back in rotation, just after /health turns 200.
    wait_until(lambda: not sandbox_host.file("/run/gemmaserve-preemption/notice").exists, 10, "the notice marker to go")
    assert "notice cleared: replicas ready again" in sandbox_host.run(f"journalctl -u {UNIT} --no-pager -o cat").stdout


def test_a_host_that_is_not_preemptible_loses_the_unit(spot_host, sandbox_host):
    host, _, tmp_path, endpoint = spot_host
    result = deploy(host.name, {}, tmp_path)
    assert result.returncode == 0, result.output[-3000:]
    assert not sandbox_host.file(f"/etc/systemd/system/{UNIT}").exists
    assert sandbox_host.run(f"systemctl is-active {UNIT}").stdout.strip() != "active"
    assert health(endpoint) == 200
