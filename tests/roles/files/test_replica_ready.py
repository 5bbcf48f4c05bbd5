"""The readiness reporter a replica unit runs as ExecStartPost: its phases, and its sd_notify status lines."""

from __future__ import annotations

import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

from roles._lib.programs import load_program

replica_ready = load_program("replicas", "replica_ready")


class Health(BaseHTTPRequestHandler):
    ready = threading.Event()

    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(200 if self.ready.is_set() else 503)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_phases_loading_then_compiling_then_ready(tmp_path, monkeypatch):
    server = HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    notify = tmp_path / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(notify))
    sock.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", str(notify))
    cache = tmp_path / "inductor"
    cache.mkdir()
    (cache / "old.so").write_bytes(b"x")
    os.utime(cache / "old.so", (1, 1))  # restored from a cache: keeps its old time
    url = f"http://127.0.0.1:{server.server_port}/health"
    result = {}
    worker = threading.Thread(target=lambda: result.update(code=replica_ready.main([url, str(cache)])))
    worker.start()
    assert sock.recv(512) == b"STATUS=loading model"
    (cache / "new-kernel.so").write_bytes(b"y")  # a kernel being built now
    assert sock.recv(512) == b"STATUS=compiling (1 new compile-cache files)"
    Health.ready.set()
    assert sock.recv(512).startswith(b"STATUS=ready (")
    worker.join(10)
    server.shutdown()
    assert result == {"code": 0}


def test_without_systemd_it_only_logs(capsys):
    os.environ.pop("NOTIFY_SOCKET", None)
    replica_ready.sd_notify("STATUS=x")  # no socket: nothing to send, no error
    assert replica_ready.phase(0) == "loading model" and replica_ready.phase(3).startswith("compiling (3")
