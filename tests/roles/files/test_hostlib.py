"""What host programs share (roles/_lib/files/hostlib.py): private writes, the metadata token, HAProxy's admin
socket, sd_notify; each program's own tests run it through them too."""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from roles._lib.programs import load_program
from tests.roles.files.test_haproxy_admin import FakeHaproxy

hostlib = load_program("_lib", "hostlib")


@pytest.mark.parametrize("data, mode", [("text\n", 0o600), (b"secret", 0o400)])
def test_a_private_write_replaces_the_file_with_its_mode(tmp_path, data, mode):
    path = tmp_path / "out"
    path.write_text("old")
    hostlib.write_private(str(path), data, mode)
    assert path.read_bytes() == (data.encode() if isinstance(data, str) else data)
    assert stat.S_IMODE(path.stat().st_mode) == mode
    assert os.listdir(tmp_path) == ["out"]


def test_a_failed_write_keeps_the_old_file_and_leaves_nothing(tmp_path):
    path = tmp_path / "out"
    path.write_text("old")
    with pytest.raises(TypeError):
        hostlib.write_private(str(path), 42)
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["out"]


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_sd_notify_sends_one_datagram(tmp_path, monkeypatch, abstract):
    name = f"@gemmaserve-test-{os.getpid()}" if abstract else str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name[1:] if abstract else name)
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", name)
        hostlib.sd_notify("STATUS=loading")
        assert sock.recv(512) == b"STATUS=loading"


def test_sd_notify_outside_systemd_or_with_nobody_listening_does_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    hostlib.sd_notify("STATUS=x")
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone"))
    hostlib.sd_notify("STATUS=x")


def test_an_admin_command_gets_haproxys_whole_answer(tmp_path):
    haproxy = FakeHaproxy(tmp_path / "admin.sock", {"replica0": [1, "UP"]})
    answer = hostlib.haproxy_command("show stat", str(tmp_path / "admin.sock"))
    assert answer.startswith("# pxname,svname") and "vllm,replica0," in answer
    assert haproxy.commands == ["show stat"]


class Metadata(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        ok = self.headers.get("Metadata-Flavor") == "Google" and self.path.endswith("/default/token")
        body = json.dumps({"access_token": "tok", "expires_in": 1234}).encode() if ok else b""
        self.send_response(200 if ok else 403)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_the_metadata_token_is_asked_with_the_metadata_flavor(monkeypatch):
    server = HTTPServer(("127.0.0.1", 0), Metadata)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(hostlib, "METADATA_URL", f"http://127.0.0.1:{server.server_port}/computeMetadata/v1")
    try:
        assert hostlib.metadata_token() == ("tok", 1234.0)
    finally:
        server.shutdown()
