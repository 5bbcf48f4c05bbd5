"""`gemmaserve keys --stack`: the real google-cloud-secret-manager client (REST transport) against a local
fake of the Secret Manager API. Google ships no Secret Manager emulator, so the fake is held to Google's own
discovery document for secretmanager v1 (from the google-api-python-client wheel): every request must be a
declared method at its declared path, with declared query parameters and a body that fits the method's
request schema. `--inventory` runs against a real sandbox host in tests/roles/sandbox/test_access.py."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest
import yaml

from gemmaserve.sandbox.credentials import key_digest

REPO = Path(__file__).resolve().parents[2]
PROJECT = "demo-project"
# The stack file says `api-keys`; the stack creates it under its own prefix (stack_secret_name).
SECRET = f"projects/{PROJECT}/secrets/gs-gpu8-api-keys"


def discovery() -> dict:
    import googleapiclient

    path = Path(googleapiclient.__file__).parent / "discovery_cache" / "documents" / "secretmanager.v1.json"
    return json.loads(path.read_text())


def methods(document: dict) -> list[dict]:
    found = []

    def walk(resource: dict) -> None:
        found.extend(resource.get("methods", {}).values())
        for child in resource.get("resources", {}).values():
            walk(child)

    walk(document)
    return found


def fits(schemas: dict, schema: dict, value, where: str) -> list[str]:
    """Problems of `value` against a discovery schema (object properties, $ref, byte/int64 formats)."""
    if "$ref" in schema:
        return fits(schemas, schemas[schema["$ref"]], value, where)
    kind = schema.get("type")
    if kind == "object":
        if not isinstance(value, dict):
            return [f"{where}: not an object"]
        problems = []
        for key, item in value.items():
            if key not in schema.get("properties", {}):
                problems.append(f"{where}.{key}: not in the schema")
            else:
                problems += fits(schemas, schema["properties"][key], item, f"{where}.{key}")
        return problems
    if kind == "string" and schema.get("format") == "byte":
        try:
            base64.b64decode(value, validate=True)
        except Exception:
            return [f"{where}: not base64"]
    return []


class FakeSecretManager(BaseHTTPRequestHandler):
    document = discovery()
    routes = [
        (m["httpMethod"], re.compile("^/" + re.sub(r"\{[^}]+\}", "[^/:]+", m["flatPath"]) + "$"), m)
        for m in methods(document)
    ]
    secrets: dict[str, list[dict]] = {}
    problems: list[str] = []
    calls: list[str] = []

    def _route(self, http_method: str):
        url = urlparse(self.path)
        for method, pattern, spec in self.routes:
            if method == http_method and pattern.match(url.path):
                allowed = set(spec.get("parameters", {})) | set(self.document["parameters"]) | {"$alt"}
                for name in parse_qs(url.query):
                    if name not in allowed:
                        self.problems.append(f"{spec['id']}: undeclared query parameter {name}")
                self.calls.append(spec["id"])
                return spec, url
        self.problems.append(f"{http_method} {url.path}: no such method in the discovery document")
        return None, url

    def _body(self, spec: dict) -> dict:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = json.loads(raw or b"{}")
        if "request" in spec:
            self.problems += fits(self.document["schemas"], spec["request"], body, spec["id"])
        return body

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, code: int, status: str, message: str) -> None:
        self._send(code, {"error": {"code": code, "message": message, "status": status}})

    def do_GET(self):  # noqa: N802 - http.server's API
        spec, url = self._route("GET")
        path = url.path.removeprefix("/v1/")
        if spec is None:
            return self._error(404, "NOT_FOUND", "no such method")
        if spec["id"].endswith("versions.access"):
            secret = path.split("/versions/")[0]
            versions = self.secrets.get(secret)
            if versions is None:
                return self._error(404, "NOT_FOUND", f"Secret [{secret}] not found.")
            enabled = [v for v in versions if v["state"] == "ENABLED"]
            if not versions:
                return self._error(404, "NOT_FOUND", f"Secret Version [{secret}/versions/latest] not found.")
            if not enabled or versions[-1]["state"] != "ENABLED":
                return self._error(400, "FAILED_PRECONDITION", "latest is disabled")
            latest = versions[-1]
            return self._send(200, {"name": latest["name"], "payload": {"data": latest["data"]}})
        if spec["id"].endswith("secrets.get"):
            if path not in self.secrets:
                return self._error(404, "NOT_FOUND", f"Secret [{path}] not found.")
            return self._send(200, {"name": path})
        if spec["id"].endswith("versions.list"):
            secret = path.removesuffix("/versions")
            wanted = parse_qs(url.query).get("filter", [""])[0]
            versions = [v for v in self.secrets.get(secret, []) if wanted != "state:ENABLED" or v["state"] == "ENABLED"]
            return self._send(200, {"versions": [{"name": v["name"], "state": v["state"]} for v in versions]})
        return self._error(501, "UNIMPLEMENTED", spec["id"])

    def do_POST(self):  # noqa: N802 - http.server's API
        spec, url = self._route("POST")
        if spec is None:
            return self._error(404, "NOT_FOUND", "no such method")
        body = self._body(spec)
        path = url.path.removeprefix("/v1/")
        if spec["id"].endswith("secrets.addVersion"):
            secret = path.removesuffix(":addVersion")
            versions = self.secrets[secret]
            version = {
                "name": f"{secret}/versions/{len(versions) + 1}",
                "state": "ENABLED",
                "data": body["payload"]["data"],
            }
            versions.append(version)
            return self._send(200, {"name": version["name"], "state": "ENABLED"})
        if spec["id"].endswith("versions.disable"):
            name = path.removesuffix(":disable")
            version = next(v for v in self.secrets[name.split("/versions/")[0]] if v["name"] == name)
            version["state"] = "DISABLED"
            return self._send(200, {"name": name, "state": "DISABLED"})
        return self._error(501, "UNIMPLEMENTED", spec["id"])

    def log_message(self, *args):
        pass


@pytest.fixture
def fake(tmp_path):
    FakeSecretManager.secrets = {SECRET: []}  # `pulumi up` made the secret; no version yet
    FakeSecretManager.problems, FakeSecretManager.calls = [], []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeSecretManager)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    # A project directory as `pulumi config set gcp:project` leaves it.
    stack = yaml.safe_load((REPO / "Pulumi.gpu8.yaml").read_text())
    stack["config"]["gcp:project"] = PROJECT
    (tmp_path / "Pulumi.gpu8.yaml").write_text(yaml.safe_dump(stack))
    yield f"http://127.0.0.1:{server.server_port}", tmp_path
    server.shutdown()
    assert FakeSecretManager.problems == []


def keys(fake, *args: str) -> subprocess.CompletedProcess:
    endpoint, project_dir = fake
    return subprocess.run(
        [sys.executable, "-m", "gemmaserve", "keys", *args, "--stack", "gpu8", "--project-dir", str(project_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "GEMMASERVE_SECRETMANAGER_ENDPOINT": endpoint, "HOME": str(project_dir)},
    )


def stored(version: int) -> str:
    return base64.b64decode(FakeSecretManager.secrets[SECRET][version - 1]["data"]).decode()


def test_add_prints_the_key_once_and_stores_only_its_digest(fake):
    result = keys(fake, "add", "alice")
    assert result.returncode == 0, result.stderr
    key = result.stdout.strip()
    assert key.startswith("gsk-") and key not in result.stderr
    assert f"{SECRET}/versions/1" in result.stderr
    assert key not in stored(1) and f"alice {key_digest(key)} " in stored(1)


def test_each_change_is_a_new_version_and_supersedes_the_last(fake):
    alice = keys(fake, "add", "alice").stdout.strip()
    bob = keys(fake, "add", "bob").stdout.strip()
    assert keys(fake, "revoke", "alice").returncode == 0
    versions = FakeSecretManager.secrets[SECRET]
    assert [v["state"] for v in versions] == ["DISABLED", "DISABLED", "ENABLED"]
    assert key_digest(alice) not in stored(3) and key_digest(bob) in stored(3)
    listed = json.loads(keys(fake, "list", "--json").stdout)
    assert [entry["id"] for entry in listed[SECRET]] == ["bob"]
    assert {"secretmanager.projects.secrets.addVersion", "secretmanager.projects.secrets.versions.disable"} <= set(
        FakeSecretManager.calls
    )


def test_taken_id_and_unknown_id_are_refused_without_a_new_version(fake):
    keys(fake, "add", "alice")
    taken = keys(fake, "add", "alice")
    unknown = keys(fake, "revoke", "carol")
    assert taken.returncode == 2 and "key id 'alice' exists" in taken.stderr and taken.stdout == ""
    assert unknown.returncode == 2 and "no key with id 'carol'; known ids: alice" in unknown.stderr
    assert len(FakeSecretManager.secrets[SECRET]) == 1


def test_a_key_from_stdin(fake):
    endpoint, project_dir = fake
    result = subprocess.run(
        [sys.executable, "-m", "gemmaserve", "keys", "add", "ci", "--key-stdin", "--stack", "gpu8"]
        + ["--project-dir", str(project_dir)],
        input="my-own-key-from-a-vault-0123456789\n",
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "GEMMASERVE_SECRETMANAGER_ENDPOINT": endpoint, "HOME": str(project_dir)},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "" and key_digest("my-own-key-from-a-vault-0123456789") in stored(1)


def test_missing_secret_is_named(fake):
    FakeSecretManager.secrets = {}
    result = keys(fake, "list")
    assert result.returncode == 2 and f"{SECRET}: no such secret (run `pulumi up`" in result.stderr


def test_missing_project_is_named(fake, tmp_path):
    endpoint, _ = fake
    result = keys((endpoint, REPO), "list")
    assert result.returncode == 2 and "gcp:project is not set" in result.stderr


def test_inventory_hosts_with_a_secret_are_sent_to_stack(tmp_path):
    inventory = tmp_path / "stack_hosts.py"
    data = {
        "gemmaserve_model": "e2b",
        "gemmaserve_accelerator": {"kind": "l4", "count": 1},
        "gemmaserve_serving": {"api_keys": {"secret_manager": "x-api-keys"}},
    }
    inventory.write_text(f"hosts = [('h1', {data!r})]\n")
    result = subprocess.run(
        [sys.executable, "-m", "gemmaserve", "keys", "list", "--inventory", str(inventory)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert result.returncode == 2 and "its keys live in Secret Manager; use --stack" in result.stderr
