"""`gemmaserve keys --stack`: the real google-cloud-secret-manager client (REST transport) against a local
fake of the Secret Manager API. Google ships no Secret Manager emulator, so the fake is held to Google's own
discovery document for secretmanager v1 (from the google-api-python-client wheel): every request must be a
declared method at its declared path, with declared query parameters and a body that fits the method's
request schema. `--inventory` runs against a real sandbox host in tests/roles/sandbox/test_access.py."""

from __future__ import annotations

import base64
import itertools
import json
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest
import yaml

from gemmaserve.ops.keys import key_digest
from roles._lib.programs import load_program
from tests import ROOT

PROJECT = "demo-project"
# The stack file says `api-keys`; the stack creates it under its own prefix (stack_secret_name).
SECRET = f"projects/{PROJECT}/secrets/gs-gpu8-api-keys"
secret_fetch = load_program("_lib", "secret_fetch")


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
    """Secret Manager as documented: versions numbered from 1 (`latest` is the most recently created, whatever
    its state), ENABLED/DISABLED/DESTROYED, an etag on the Secret and on each SecretVersion that changes with
    every change of that resource only, and disable/enable/destroy refused with FAILED_PRECONDITION (HTTP 400)
    when a given etag is not the current one (https://cloud.google.com/secret-manager/docs/etags)."""

    document = discovery()
    routes = [
        (m["httpMethod"], re.compile("^/" + re.sub(r"\{[^}]+\}", "[^/:]+", m["flatPath"]) + "$"), m)
        for m in methods(document)
    ]
    secrets: dict[str, list[dict]] = {}
    secret_etags: dict[str, str] = {}
    problems: list[str] = []
    calls: list[str] = []
    # Seconds every answer waits before it is sent: lets concurrent writers interleave in tests.
    delay = 0.0
    lock = threading.Lock()
    etags = itertools.count(1)

    @classmethod
    def reset(cls, secrets: dict[str, list[dict]]) -> None:
        cls.secrets, cls.problems, cls.calls, cls.delay = secrets, [], [], 0.0
        cls.secret_etags = {name: cls.new_etag() for name in secrets}

    @classmethod
    def new_etag(cls) -> str:
        return f'"{next(cls.etags):x}"'  # quotes included, as AIP-154 has them

    @classmethod
    def add(cls, secret: str, text: str, state: str = "ENABLED") -> dict:
        """A version as addVersion makes it (tests use it to set up a secret's history)."""
        versions = cls.secrets[secret]
        version = {
            "name": f"{secret}/versions/{len(versions) + 1}",
            "state": state,
            "data": base64.b64encode(text.encode()).decode(),
            "etag": cls.new_etag(),
            "createTime": f"2026-01-01T00:00:{len(versions):02d}Z",
        }
        versions.append(version)
        return version

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

    def _version(self, name: str) -> dict | None:
        """projects/P/secrets/S/versions/N|latest -> the version, None when there is none."""
        secret, _, number = name.partition("/versions/")
        versions = self.secrets.get(secret) or []
        if number == "latest":
            return versions[-1] if versions else None
        return versions[int(number) - 1] if number.isdigit() and 0 < int(number) <= len(versions) else None

    @staticmethod
    def _public(version: dict) -> dict:
        return {key: version[key] for key in ("name", "state", "etag", "createTime", "destroyTime") if key in version}

    def do_GET(self):  # noqa: N802 - http.server's API
        time.sleep(self.delay)
        with self.lock:
            self._get()

    def do_POST(self):  # noqa: N802 - http.server's API
        time.sleep(self.delay)
        with self.lock:
            self._post()

    def _get(self) -> None:
        spec, url = self._route("GET")
        path = url.path.removeprefix("/v1/")
        if spec is None:
            return self._error(404, "NOT_FOUND", "no such method")
        if spec["id"].endswith("secrets.get"):
            if path not in self.secrets:
                return self._error(404, "NOT_FOUND", f"Secret [{path}] not found.")
            return self._send(200, {"name": path, "etag": self.secret_etags[path]})
        if spec["id"].endswith("versions.list"):
            secret = path.removesuffix("/versions")
            if secret not in self.secrets:
                return self._error(404, "NOT_FOUND", f"Secret [{secret}] not found.")
            wanted = parse_qs(url.query).get("filter", [""])[0]
            if wanted not in ("", "state:ENABLED"):
                self.problems.append(f"versions.list: the fake knows no filter {wanted!r}")
            chosen = [v for v in self.secrets[secret] if not wanted or v["state"] == "ENABLED"]
            # ListSecretVersionsResponse.versions: "sorted in reverse by create_time (newest first)".
            return self._send(200, {"versions": [self._public(v) for v in reversed(chosen)]})
        name = path.removesuffix(":access")
        if name.split("/versions/")[0] not in self.secrets:
            return self._error(404, "NOT_FOUND", f"Secret [{name.split('/versions/')[0]}] not found.")
        version = self._version(name)
        if version is None:
            return self._error(404, "NOT_FOUND", f"Secret Version [{name}] not found.")
        if spec["id"].endswith("versions.get"):
            return self._send(200, self._public(version))
        if spec["id"].endswith("versions.access"):
            if version["state"] != "ENABLED":
                return self._error(400, "FAILED_PRECONDITION", f"{version['name']} is in {version['state']} state.")
            data = base64.b64decode(version["data"])
            payload = {"data": version["data"], "dataCrc32c": str(secret_fetch.crc32c(data))}
            return self._send(200, {"name": version["name"], "payload": payload})
        return self._error(501, "UNIMPLEMENTED", spec["id"])

    def _post(self) -> None:
        spec, url = self._route("POST")
        if spec is None:
            return self._error(404, "NOT_FOUND", "no such method")
        body = self._body(spec)
        path = url.path.removeprefix("/v1/")
        if spec["id"].endswith("secrets.addVersion"):
            secret = path.removesuffix(":addVersion")
            if secret not in self.secrets:
                return self._error(404, "NOT_FOUND", f"Secret [{secret}] not found.")
            version = self.add(secret, base64.b64decode(body["payload"]["data"]).decode())
            return self._send(200, self._public(version))
        verb = path.rsplit(":", 1)[-1]
        if verb in ("disable", "enable", "destroy"):
            version = self._version(path.removesuffix(f":{verb}"))
            if version is None:
                return self._error(404, "NOT_FOUND", f"Secret Version [{path}] not found.")
            if body.get("etag") and body["etag"] != version["etag"]:
                return self._error(400, "FAILED_PRECONDITION", f"etag {body['etag']} is not the current etag")
            if version["state"] == "DESTROYED":
                return self._error(400, "FAILED_PRECONDITION", f"{version['name']} is in DESTROYED state.")
            version["state"] = {"disable": "DISABLED", "enable": "ENABLED", "destroy": "DESTROYED"}[verb]
            version["etag"] = self.new_etag()
            if verb == "destroy":
                version["data"], version["destroyTime"] = "", "2026-01-02T00:00:00Z"
            return self._send(200, self._public(version))
        return self._error(501, "UNIMPLEMENTED", spec["id"])

    def log_message(self, *args):
        pass


@pytest.fixture
def fake(tmp_path):
    FakeSecretManager.reset({SECRET: []})  # `pulumi up` made the secret; no version yet
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeSecretManager)
    # serve_forever's default 0.5 s poll is what shutdown() waits for, at every teardown.
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    # A project directory as `pulumi config set gcp:project` leaves it.
    stack = yaml.safe_load((ROOT / "Pulumi.gpu8.yaml").read_text())
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
    FakeSecretManager.reset({})
    result = keys(fake, "list")
    assert result.returncode == 2 and f"{SECRET}: no such secret (run `pulumi up`" in result.stderr


def test_missing_project_is_named(fake, tmp_path):
    endpoint, _ = fake
    result = keys((endpoint, ROOT), "list")
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
        cwd=ROOT,
    )
    assert result.returncode == 2 and "its keys live in Secret Manager; use --stack" in result.stderr


# --- concurrent writers and unreadable versions (issue 26) ------------------------------------------------


def client_for(fake, monkeypatch):
    from gemmaserve.ops import keys as keys_ops

    monkeypatch.setenv(keys_ops.ENDPOINT_ENV, fake[0])
    return keys_ops


def cli(fake, *args: str):
    """The real command line in this process (so a test may shorten its waits)."""
    from typer.testing import CliRunner

    from gemmaserve.ops.cli import app

    return CliRunner().invoke(app, ["keys", *args, "--stack", "gpu8", "--project-dir", str(fake[1])])


def latest_store() -> list[str]:
    """The ids in the version hosts fetch (`versions/latest`), which must be enabled."""
    latest = FakeSecretManager.secrets[SECRET][-1]
    assert latest["state"] == "ENABLED", [v["state"] for v in FakeSecretManager.secrets[SECRET]]
    text = base64.b64decode(latest["data"]).decode()
    return sorted(line.split()[0] for line in text.splitlines() if line and not line.startswith("#"))


def store_text(*ids: str) -> str:
    return "".join(f"{i} {key_digest(i)} 2026-01-01T00:00:00Z\n" for i in ids)


def run_together(*changes) -> list[BaseException]:
    """Each change in its own thread, all started at once; the errors they raised."""
    errors: list[BaseException] = []
    start = threading.Barrier(len(changes))

    def run(change):
        start.wait()
        try:
            change()
        except BaseException as error:  # noqa: BLE001 - reported to the test
            errors.append(error)

    threads = [threading.Thread(target=run, args=(change,)) for change in changes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return errors


def test_a_revoke_and_a_concurrent_add_both_hold(fake, monkeypatch):
    keys_ops = client_for(fake, monkeypatch)
    FakeSecretManager.add(SECRET, store_text("alice", "bob"))
    FakeSecretManager.delay = 0.05  # both writers read before either writes
    errors = run_together(
        lambda: keys_ops.secret_change(SECRET, "revoke", "alice"),
        lambda: keys_ops.secret_change(SECRET, "add", "carol", key_digest("carol")),
    )
    assert errors == []
    assert latest_store() == ["bob", "carol"]  # alice stays revoked, carol stays added
    assert [v["state"] for v in FakeSecretManager.secrets[SECRET]].count("ENABLED") == 1


@pytest.mark.parametrize("writers", [2, 4])
def test_concurrent_first_keys_are_all_kept(fake, monkeypatch, writers):
    keys_ops = client_for(fake, monkeypatch)  # the secret has no version yet
    FakeSecretManager.delay = 0.05
    ids = [f"client-{i}" for i in range(writers)]
    errors = run_together(*(lambda i=i: keys_ops.secret_change(SECRET, "add", i, key_digest(i)) for i in ids))
    assert errors == []
    assert latest_store() == ids


def test_many_concurrent_writers_lose_no_change(fake, monkeypatch):
    keys_ops = client_for(fake, monkeypatch)
    FakeSecretManager.add(SECRET, store_text("old-1", "old-2", "old-3"))
    FakeSecretManager.delay = 0.01
    changes = [lambda i=i: keys_ops.secret_change(SECRET, "revoke", f"old-{i}") for i in (1, 2, 3)]
    changes += [
        lambda i=i: keys_ops.secret_change(SECRET, "add", f"new-{i}", key_digest(f"new-{i}")) for i in (1, 2, 3)
    ]
    assert run_together(*changes) == []
    assert latest_store() == ["new-1", "new-2", "new-3"]


def test_a_disabled_latest_version_is_never_an_empty_store(fake, monkeypatch):
    """An interrupted change (or a person) left the latest version disabled: hosts keep the keys they have;
    `keys` must neither list nothing nor write a store holding only the new key."""
    keys_ops = client_for(fake, monkeypatch)
    FakeSecretManager.add(SECRET, store_text("alice"))
    FakeSecretManager.add(SECRET, store_text("alice", "bob"), state="DISABLED")
    monkeypatch.setattr(keys_ops, "CLAIM_WAIT_S", 0.5, raising=False)
    listed, added = cli(fake, "list"), cli(fake, "add", "carol")
    assert listed.exit_code == 2 and added.exit_code == 2, (listed.output, added.output)
    for result in (listed, added):
        assert f"{SECRET}/versions/2 is DISABLED" in result.stderr, result.stderr
        assert "gcloud secrets versions enable 2" in result.stderr
    assert added.stdout == "" and len(FakeSecretManager.secrets[SECRET]) == 2
