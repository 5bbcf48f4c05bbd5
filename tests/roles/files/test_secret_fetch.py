"""The Secret Manager fetcher against a local fake of the metadata server and the Secret Manager API."""

import base64
import json
import os
import stat
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from roles._lib.programs import program_source

SCRIPT = program_source("_lib", "secret_fetch.py")
TOKEN = "hf_TESTtokenNeverReal0123456789"


class FakeGoogle(BaseHTTPRequestHandler):
    secrets = {"projects/demo-project/secrets/hf-token/versions/latest": TOKEN}
    seen: list[tuple[str, dict]] = []

    def do_GET(self):  # noqa: N802 - http.server's API
        FakeGoogle.seen.append((self.path, dict(self.headers)))
        if self.path.startswith("/meta/"):
            if self.headers.get("Metadata-Flavor") != "Google":
                return self._send(403, b"missing Metadata-Flavor")
            if self.path.endswith("/token"):
                return self._send(200, json.dumps({"access_token": "ya29.fake", "expires_in": 3599}).encode())
            if self.path.endswith("/project/project-id"):
                return self._send(200, b"demo-project")
        if self.path.startswith("/sm/") and self.path.endswith(":access"):
            if self.headers.get("Authorization") != "Bearer ya29.fake":
                return self._send(401, b"no")
            name = self.path.removeprefix("/sm/").removesuffix(":access")
            if name in self.secrets:
                data = base64.b64encode(self.secrets[name].encode()).decode()
                return self._send(200, json.dumps({"name": name, "payload": {"data": data}}).encode())
            return self._send(404, b"not found")
        self._send(404, b"?")

    def _send(self, code, body):
        self.send_response(code)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def fake_google():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeGoogle)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_port}"
    yield {"GEMMASERVE_METADATA_URL": f"{base}/meta", "GEMMASERVE_SECRETMANAGER_URL": f"{base}/sm"}
    server.shutdown()


def run(secret, out, env):
    return subprocess.run(
        [sys.executable, str(SCRIPT), secret, str(out)],
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"], **env},
        timeout=30,
    )


@pytest.mark.parametrize(
    "secret",
    ["hf-token", "projects/demo-project/secrets/hf-token", "projects/demo-project/secrets/hf-token/versions/latest"],
)
def test_fetches_token_into_a_0400_file(fake_google, tmp_path, secret):
    out = tmp_path / "hf-token"
    result = run(secret, out, fake_google)
    assert result.returncode == 0, result.stderr
    assert out.read_text() == TOKEN
    assert stat.S_IMODE(out.stat().st_mode) == 0o400


def test_token_never_printed(fake_google, tmp_path):
    result = run("hf-token", tmp_path / "t", fake_google)
    assert TOKEN not in result.stdout + result.stderr


def test_missing_secret_fails_naming_it_and_writes_nothing(fake_google, tmp_path):
    out = tmp_path / "t"
    result = run("projects/demo-project/secrets/other", out, fake_google)
    assert result.returncode == 1
    assert "projects/demo-project/secrets/other/versions/latest" in result.stderr and "404" in result.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_no_metadata_server_and_no_gcloud_is_a_clear_error(tmp_path):
    env = {
        "GEMMASERVE_METADATA_URL": "http://127.0.0.1:9/meta",
        "GEMMASERVE_SECRETMANAGER_URL": "http://127.0.0.1:9/sm",
    }
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "hf-token", str(tmp_path / "t")],
        capture_output=True,
        text=True,
        env={"PATH": "/nonexistent", **env},
        timeout=30,
    )
    assert result.returncode == 1 and "no gcloud" in result.stderr


def test_uses_the_metadata_flavor_header(fake_google, tmp_path):
    FakeGoogle.seen.clear()
    run("hf-token", tmp_path / "t", fake_google)
    assert all(h.get("Metadata-Flavor") == "Google" for path, h in FakeGoogle.seen if path.startswith("/meta/"))
