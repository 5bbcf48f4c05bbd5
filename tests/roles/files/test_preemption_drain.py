"""The preemption drain against a local fake metadata server and a fake HAProxy admin socket."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

import pytest

from roles._lib.programs import installed_copy, load_program
from tests.roles.fake_metadata import serve
from tests.roles.files.test_haproxy_admin import FakeHaproxy

drain = load_program("preemption", "preemption_drain")


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    """The drain and the router's haproxy_admin.py beside what they import, as hosts hold them."""
    return installed_copy(
        tmp_path_factory.mktemp("lib"), ("preemption", "preemption_drain.py"), ("router", "haproxy_admin.py")
    )


@pytest.mark.parametrize(
    "values, notice",
    [
        ({}, None),
        ({"instance/preempted": "FALSE", "instance/maintenance-event": "NONE"}, None),
        ({"instance/maintenance-event": "MIGRATE_ON_HOST_MAINTENANCE"}, None),
        ({"instance/preempted": "TRUE"}, "instance/preempted=TRUE"),
        (
            {"instance/maintenance-event": "TERMINATE_ON_HOST_MAINTENANCE"},
            "instance/maintenance-event=TERMINATE_ON_HOST_MAINTENANCE",
        ),
    ],
)
def test_what_is_a_notice(values, notice):
    assert drain.is_notice(values) == notice


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def flip(server, key: str, value: str) -> None:
    port = server.server_address[1]
    request = urllib.request.Request(f"http://127.0.0.1:{port}/control/{key}", data=value.encode(), method="PUT")
    urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=5).read()


@pytest.fixture
def running(tmp_path, request, lib):
    """The drain program (a 5 s notice window unless parametrized), a fake metadata server and a fake HAProxy
    with two replicas, one busy."""
    server, _ = serve()
    haproxy = FakeHaproxy(tmp_path / "admin.sock", {"replica0": [3, "UP"], "replica1": [0, "UP"]})
    marker = tmp_path / "notice"
    env = {**os.environ, "GEMMASERVE_METADATA_URL": f"http://127.0.0.1:{server.server_address[1]}/computeMetadata/v1"}
    grace = getattr(request, "param", 5)
    argv = [sys.executable, str(lib / "preemption_drain.py"), "--grace", str(grace)]
    argv += ["--haproxy-admin", str(lib / "haproxy_admin.py")]
    argv += ["--socket", str(tmp_path / "admin.sock"), "--state-file", str(marker)]
    process = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
    yield server, haproxy, marker, process
    process.terminate()
    process.wait(timeout=10)
    server.shutdown()


def log_of(process) -> str:
    process.terminate()
    return process.communicate(timeout=10)[1]


def test_a_preemption_notice_drains_every_replica_until_idle(running):
    server, haproxy, marker, process = running
    time.sleep(0.5)
    assert not any(c.startswith("set server") for c in haproxy.commands)
    flip(server, "instance/preempted", "TRUE")
    wait_for(lambda: all(row[1] == "DRAIN" for row in haproxy.rows.values()), 10, "both replicas in DRAIN")
    wait_for(lambda: haproxy.rows["replica0"][0] == 0, 10, "replica0's requests to finish")
    time.sleep(2)  # haproxy_admin's next poll sees it idle and returns
    assert marker.read_text().startswith("instance/preempted=TRUE")
    log = log_of(process)
    assert "notice: instance/preempted=TRUE" in log and "drained 2 replica(s)" in log


def test_migration_is_not_a_notice_termination_is_and_clearing_restores(running):
    server, haproxy, marker, process = running
    flip(server, "instance/maintenance-event", "MIGRATE_ON_HOST_MAINTENANCE")
    time.sleep(1)
    assert not any(c.startswith("set server") for c in haproxy.commands)
    flip(server, "instance/maintenance-event", "TERMINATE_ON_HOST_MAINTENANCE")
    wait_for(lambda: all(row[1] == "DRAIN" for row in haproxy.rows.values()), 10, "both replicas in DRAIN")
    flip(server, "instance/maintenance-event", "NONE")
    wait_for(lambda: all(row[1] == "UP" for row in haproxy.rows.values()), 10, "both replicas back UP")
    wait_for(lambda: not marker.exists(), 5, "the notice marker to go")
    assert "notice cleared: replicas ready again" in log_of(process)


@pytest.mark.parametrize("running", [2], indirect=True, ids=["2 s window"])
def test_requests_outliving_the_notice_window_are_reported(running):
    server, haproxy, _, process = running
    haproxy.rows["replica0"] = [10**6, "UP"]
    flip(server, "instance/preempted", "TRUE")
    wait_for(lambda: haproxy.rows["replica0"][1] == "DRAIN", 10, "replica0 in DRAIN")
    time.sleep(2 + 1.5)
    assert "still busy: replica0" in log_of(process)


def test_survives_a_metadata_server_that_comes_late(tmp_path, lib):
    port_holder, _ = serve()
    port = port_holder.server_address[1]
    port_holder.shutdown()
    port_holder.server_close()
    env = {**os.environ, "GEMMASERVE_METADATA_URL": f"http://127.0.0.1:{port}/computeMetadata/v1"}
    haproxy = FakeHaproxy(tmp_path / "admin.sock", {"replica0": [0, "UP"]})
    argv = [
        sys.executable,
        str(lib / "preemption_drain.py"),
        "--grace",
        "2",
        "--haproxy-admin",
        str(lib / "haproxy_admin.py"),
        "--socket",
        str(tmp_path / "admin.sock"),
    ]
    process = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.5)
        server, _ = serve(port=port)
        flip(server, "instance/preempted", "TRUE")
        wait_for(lambda: haproxy.rows["replica0"][1] == "DRAIN", 20, "the drain after the server came up")
    finally:
        log = log_of(process)
    assert "metadata server unreachable" in log
