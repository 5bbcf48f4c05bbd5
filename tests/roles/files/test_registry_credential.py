"""The Artifact Registry credential helper as podman runs it (the credential-helper protocol on stdin and
stdout), against a local stand-in for the metadata server. The real podman calls it on a sandbox host
(tests/roles/sandbox/test_container_mode.py)."""

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from roles._lib.programs import program_source
from roles.vllm import needs_gcp_credentials, registry_auth, registry_host

SCRIPT = program_source("vllm", "registry_credential.py")


class FakeMetadata(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's API
        if self.headers.get("Metadata-Flavor") != "Google" or not self.path.endswith(
            "/instance/service-accounts/default/token"
        ):
            self.send_response(403)
            self.end_headers()
            return
        body = json.dumps({"access_token": "ya29.fake-vm-token", "expires_in": 3599, "token_type": "Bearer"})
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def metadata():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeMetadata)
    # serve_forever's default 0.5 s poll is what shutdown() waits for, at every teardown.
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/computeMetadata/v1"
    server.shutdown()


def helper(action: str, stdin: str, metadata_url: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "GEMMASERVE_METADATA_URL": metadata_url}
    return subprocess.run(
        [sys.executable, str(SCRIPT), action], input=stdin, capture_output=True, text=True, env=env, timeout=30
    )


def test_get_returns_the_vms_token_as_artifact_registrys_oauth_user(metadata):
    result = helper("get", "us-docker.pkg.dev\n", metadata)
    assert result.returncode == 0
    assert json.loads(result.stdout) == {
        "ServerURL": "us-docker.pkg.dev",
        "Username": "oauth2accesstoken",
        "Secret": "ya29.fake-vm-token",
    }


def test_no_metadata_server_is_an_error_naming_the_registry():
    result = helper("get", "europe-west4-docker.pkg.dev", "http://127.0.0.1:9/computeMetadata/v1")
    assert result.returncode == 1 and "europe-west4-docker.pkg.dev" in result.stdout
    assert "Secret" not in result.stdout


@pytest.mark.parametrize("action", ["store", "erase", ""])
def test_nothing_is_stored(metadata, action):
    assert helper(action, "{}", metadata).returncode == 1


def test_list_is_empty(metadata):
    assert json.loads(helper("list", "", metadata).stdout) == {}


@pytest.mark.parametrize(
    "image, registry, gcp",
    [
        ("us-docker.pkg.dev/p/r/vllm@sha256:" + "0" * 64, "us-docker.pkg.dev", True),
        ("europe-west4-docker.pkg.dev/p/r/vllm:v0.33.0", "europe-west4-docker.pkg.dev", True),
        ("gcr.io/p/vllm:v0.33.0", "gcr.io", True),
        ("vllm/vllm-openai:v0.33.0", "docker.io", False),
        ("localhost/gemmaserve/vllm-cpu:0.32.0", "localhost", False),
        ("registry.example.com:5000/vllm:1.0", "registry.example.com:5000", False),
    ],
)
def test_registry_credentials_only_for_google_registries(image, registry, gcp):
    assert registry_host(image) == registry and needs_gcp_credentials(image) is gcp
    helpers = json.loads(registry_auth(image))["credHelpers"]
    assert helpers == ({registry: "gemmaserve-gcp"} if gcp else {})
