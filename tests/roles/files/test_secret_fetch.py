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

from roles._lib.programs import load_program, program_source

SCRIPT = program_source("_lib", "secret_fetch.py")
TOKEN = "hf_TESTtokenNeverReal0123456789"


secret_fetch = load_program("_lib", "secret_fetch")


class FakeGoogle(BaseHTTPRequestHandler):
    secrets = {"projects/demo-project/secrets/hf-token/versions/latest": TOKEN}
    seen: list[tuple[str, dict]] = []
    # Per path: HTTP codes to answer before the real answer (a metadata server or API not ready yet).
    failures: dict[str, list[int]] = {}
    # Payload overrides: a wrong or missing dataCrc32c.
    crc: dict[str, str | None] = {}

    def do_GET(self):  # noqa: N802 - http.server's API
        FakeGoogle.seen.append((self.path, dict(self.headers)))
        pending = FakeGoogle.failures.get(self.path)
        if pending:
            return self._send(pending.pop(0), b"not ready")
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
                raw = self.secrets[name].encode()
                # AccessSecretVersionResponse as the secretmanager v1 discovery document defines it
                # (google-api-python-client 2.202.0): payload.data (bytes, base64) and payload.dataCrc32c
                # (int64 as a string).
                payload = {"data": base64.b64encode(raw).decode(), "dataCrc32c": str(secret_fetch.crc32c(raw))}
                if name in FakeGoogle.crc:
                    if FakeGoogle.crc[name] is None:
                        del payload["dataCrc32c"]
                    else:
                        payload["dataCrc32c"] = FakeGoogle.crc[name]
                return self._send(200, json.dumps({"name": name, "payload": payload}).encode())
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
    # serve_forever's default 0.5 s poll is what shutdown() waits for, at every teardown.
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_port}"
    yield {"GEMMASERVE_METADATA_URL": f"{base}/meta", "GEMMASERVE_SECRETMANAGER_URL": f"{base}/sm"}
    server.shutdown()


def run(secret, out, env):
    return subprocess.run(
        [sys.executable, str(SCRIPT), secret, str(out)],
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"], "GEMMASERVE_FETCH_TIMEOUT": "20", **env},
        timeout=60,
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
    assert result.returncode == 3  # not found: a status of its own (api_keys.py tells "no version yet" apart)
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
        env={"PATH": "/nonexistent", "GEMMASERVE_FETCH_TIMEOUT": "2", **env},
        timeout=30,
    )
    assert result.returncode == 1 and "no gcloud" in result.stderr
    # It kept trying for its whole window, saying so, before giving up.
    assert "not ready (ConnectionRefusedError), retry 1 in 1 s" in result.stderr


def test_uses_the_metadata_flavor_header(fake_google, tmp_path):
    FakeGoogle.seen.clear()
    run("hf-token", tmp_path / "t", fake_google)
    asked = [h for path, h in FakeGoogle.seen if path.startswith("/meta/")]
    assert asked, "the program never asked the metadata server"
    assert all(h.get("Metadata-Flavor") == "Google" for h in asked)


def test_crc32c_is_castagnoli() -> None:
    """The CRC-32C check value of "123456789" is 0xE3069283 (RFC 3720, iSCSI, Appendix B.4)."""
    assert secret_fetch.crc32c(b"123456789") == 0xE3069283
    assert secret_fetch.crc32c(b"") == 0


def test_retries_a_metadata_server_that_is_not_ready_yet(fake_google, tmp_path):
    FakeGoogle.failures["/meta/instance/service-accounts/default/token"] = [503, 503]
    FakeGoogle.failures["/sm/projects/demo-project/secrets/hf-token/versions/latest:access"] = [429]
    out = tmp_path / "t"
    result = run("hf-token", out, fake_google)
    assert result.returncode == 0, result.stderr
    assert out.read_text() == TOKEN
    assert result.stderr.count("not ready (HTTP 503)") == 2 and "not ready (HTTP 429)" in result.stderr
    assert TOKEN not in result.stderr


@pytest.mark.parametrize(("crc", "message"), [("12345", "does not match its dataCrc32c"), (None, "without dataCrc32c")])
def test_a_payload_that_fails_its_checksum_is_never_written(fake_google, tmp_path, crc, message):
    name = "projects/demo-project/secrets/hf-token/versions/latest"
    FakeGoogle.crc[name] = crc
    try:
        out = tmp_path / "t"
        result = run("hf-token", out, fake_google)
    finally:
        FakeGoogle.crc.pop(name)
    assert result.returncode == 1 and message in result.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []
