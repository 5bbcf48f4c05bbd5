"""hosts/sandbox.py gives each host the sandbox's client credentials as host data, and the fleet calls a sandbox
host exactly as the sandbox itself does (the sandbox's base URL, key and CA), without ops reading the sandbox's
state. Run on a state directory of its own (GEMMASERVE_SANDBOX_STATE): no host is booted, no root needed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gemmaserve.ops import fleet
from tests import ROOT


@pytest.fixture
def sandbox_state(tmp_path, monkeypatch) -> Path:
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    host = {
        "name": "sandbox-7",
        "index": 7,
        "address": "10.231.7.2",
        "gateway": "10.231.7.1",
        "netns": "gemmaserve-sandbox-7",
        "veth": "gs-sb7",
        "root": str(state_dir / "hosts" / "sandbox-7"),
    }
    (state_dir / "state.json").write_text(json.dumps({"hosts": [host]}))
    monkeypatch.setenv("GEMMASERVE_SANDBOX_STATE", str(state_dir))
    monkeypatch.delenv("GEMMASERVE_API_KEY", raising=False)
    return state_dir


def the_sandboxs_own_endpoint(state_dir: Path) -> tuple[str, str | None, str | None]:
    """(base URL, key, CA) as gemmaserve.sandbox.credentials.endpoint gives them, in a child with that state."""
    code = (
        "from gemmaserve.sandbox import credentials, state; "
        "e = credentials.endpoint(state.load_state().host('sandbox-7')); "
        "print(e.base_url); print(e.credentials.api_key); print(e.credentials.ca_cert)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True, timeout=120
    ).stdout
    return tuple(out.split())


def test_a_sandbox_host_is_called_with_the_sandboxs_own_url_key_and_ca(sandbox_state):
    (host,) = fleet.load("hosts/sandbox.py")
    assert host.data[fleet.CLIENT_CREDENTIALS_KEY] == {
        "ca_cert": str(sandbox_state / "tls" / "ca.pem"),
        "api_key_file": str(sandbox_state / "api-key"),
    }
    endpoint = host.endpoint(environ={})
    assert (endpoint.base_url, endpoint.credentials.api_key, endpoint.credentials.ca_cert) == (
        the_sandboxs_own_endpoint(sandbox_state)
    )
    assert endpoint.credentials.api_key.startswith("gsk-")
    # The operator's own key and CA still win.
    named = host.endpoint(environ={"GEMMASERVE_API_KEY": "gsk-mine", "GEMMASERVE_CA_CERT": "/mine.pem"})
    assert (named.credentials.api_key, named.credentials.ca_cert) == ("gsk-mine", "/mine.pem")
