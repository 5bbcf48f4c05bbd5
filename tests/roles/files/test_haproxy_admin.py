"""Drain/ready against a fake HAProxy admin socket speaking the real `show stat` CSV."""

import socket
import threading

import pytest

from roles._lib.programs import load_program

haproxy_admin = load_program("router", "haproxy_admin")

HEADER = "# pxname,svname,qcur,qmax,scur,smax,slim,stot,bin,bout,dreq,dresp,ereq,econ,eresp,wretr,wredis,status\n"


class FakeHaproxy:
    def __init__(self, path, rows):
        self.rows = rows  # server -> [scur, status]
        self.commands = []
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(str(path))
        self.sock.listen()
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        while True:
            conn, _ = self.sock.accept()
            with conn:
                line = conn.recv(4096).decode().strip()
                self.commands.append(line)
                if line == "show stat":
                    body = HEADER + "".join(
                        f"vllm,{name},0,0,{scur},0,,0,0,0,,0,,0,0,0,0,{status}\n"
                        for name, (scur, status) in self.rows.items()
                    )
                    # Sessions finish one poll after a drain.
                    for row in self.rows.values():
                        if row[1] == "DRAIN":
                            row[0] = max(0, row[0] - 1)
                    conn.sendall(body.encode())
                elif line.startswith("set server vllm/") and line.split()[3] == "state":
                    name, state = line.split()[2].split("/")[1], line.split()[-1]
                    self.rows[name][1] = {"drain": "DRAIN", "ready": "UP"}[state]


@pytest.fixture
def fake(tmp_path):
    return FakeHaproxy(tmp_path / "admin.sock", {"replica0": [2, "UP"], "replica1": [0, "UP"]}), str(
        tmp_path / "admin.sock"
    )


def test_drain_waits_until_idle(fake):
    haproxy, path = fake
    haproxy_admin.drain("vllm/replica0", 10, path)
    # Weight 0 first: a draining server still takes persistent requests, and the router's table checks weights.
    assert haproxy.commands[1:3] == ["set server vllm/replica0 weight 0", "set server vllm/replica0 state drain"]
    assert haproxy.rows["replica0"][0] == 0


def test_drain_times_out_when_requests_never_finish(fake):
    haproxy, path = fake
    haproxy.rows["replica0"] = [10**6, "UP"]
    with pytest.raises(SystemExit, match="timed out"):
        haproxy_admin.drain("vllm/replica0", 1, path)


def test_ready_waits_for_up(fake):
    haproxy, path = fake
    haproxy.rows["replica1"][1] = "MAINT"
    haproxy_admin.ready("vllm/replica1", 10, path)
    assert haproxy.rows["replica1"][1] == "UP"
    assert "set server vllm/replica1 weight 100%" in haproxy.commands


def test_unknown_server_is_a_no_op(fake):
    haproxy, path = fake
    haproxy_admin.drain("vllm/replica7", 5, path)
    assert not any(c.startswith("set server") for c in haproxy.commands)


def test_missing_socket_is_a_no_op(tmp_path):
    assert haproxy_admin.main(["drain", "vllm/replica0", "--socket", str(tmp_path / "none.sock")]) == 0


def test_status_lists_servers(fake):
    _, path = fake
    assert haproxy_admin.backend_status("vllm", path) == {"replica0": "UP", "replica1": "UP"}


def test_ready_without_waiting_leaves_rotation_to_the_health_check(fake):
    """vllm@.service's ExecStartPost: ready at once; HAProxy keeps the server out until /health answers."""
    haproxy, path = fake
    haproxy.rows["replica1"][1] = "MAINT"
    assert haproxy_admin.main(["ready", "vllm/replica1", "--no-wait", "--socket", path]) == 0
    assert "set server vllm/replica1 state ready" in haproxy.commands


def test_socket_nobody_listens_on_is_a_no_op(tmp_path):
    """A stopped or stopping HAProxy leaves its socket file behind: a replica's stop must not fail on it."""
    path = tmp_path / "stale.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()
    assert haproxy_admin.main(["drain", "vllm/replica0", "--socket", str(path)]) == 0
