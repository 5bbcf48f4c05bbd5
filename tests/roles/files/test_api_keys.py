"""api_keys.py's key store: digests only, ids validated, bad lines named but never echoed (a key pasted by
mistake must not reach a log). The sync against a real HAProxy is in tests/roles/fixtures/test_haproxy_access.py."""

from __future__ import annotations

import base64
import json
import stat
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gemmaserve.sandbox.credentials import key_digest, new_api_key
from roles._lib.programs import load_program, program_source

api_keys = load_program("access", "api_keys")
secret_fetch = load_program("_lib", "secret_fetch")
FETCHER = program_source("_lib", "secret_fetch.py")
KEY = "gsk-" + "k" * 43


def test_round_trip_keeps_ids_digests_and_dates():
    entries = api_keys.add_entry([], "alice", key_digest(KEY), "2026-01-01T00:00:00Z")
    text = api_keys.format_store(entries)
    assert api_keys.parse_store(text) == entries
    assert KEY not in text and key_digest(KEY) in text


def test_map_is_digest_then_id():
    entries = api_keys.add_entry([], "alice", key_digest(KEY))
    assert api_keys.format_map(entries) == f"{key_digest(KEY)[7:]} alice\n"


def test_a_key_pasted_into_the_store_is_refused_without_echoing_it():
    with pytest.raises(api_keys.StoreError) as caught:
        api_keys.parse_store(f"alice {KEY}\n", "/etc/gemmaserve/api-keys")
    assert "line 1" in str(caught.value) and KEY not in str(caught.value)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda e: api_keys.add_entry(e, "alice", key_digest("other")), "exists"),
        (lambda e: api_keys.add_entry(e, "bob", key_digest(KEY)), "already in the store"),
        (lambda e: api_keys.add_entry(e, "Bad Id", key_digest("x")), "allowed: 1-63"),
        (lambda e: api_keys.add_entry(e, "bob", "sha256:xyz"), "64 lowercase hex"),
        (lambda e: api_keys.revoke_entry(e, "carol"), "known ids: alice"),
    ],
)
def test_bad_changes_are_named(change, message):
    entries = api_keys.add_entry([], "alice", key_digest(KEY))
    with pytest.raises(api_keys.StoreError, match=message):
        change(entries)


def test_duplicate_ids_in_a_store_are_refused():
    text = f"alice {key_digest('a')} -\nalice {key_digest('b')} -\n"
    with pytest.raises(api_keys.StoreError, match="listed twice: alice"):
        api_keys.parse_store(text)


def test_command_line_add_list_revoke(tmp_path, capsys):
    store = str(tmp_path / "api-keys")
    assert api_keys.main(["init", "--store", store]) == 0
    assert stat.S_IMODE((tmp_path / "api-keys").stat().st_mode) == 0o600
    assert api_keys.main(["add", "alice", key_digest(KEY), "--store", store]) == 0
    assert api_keys.main(["add", "alice", key_digest("x"), "--store", store]) == 1
    capsys.readouterr()
    assert api_keys.main(["list", "--store", store]) == 0
    assert [e["id"] for e in json.loads(capsys.readouterr().out)] == ["alice"]
    assert api_keys.main(["revoke", "alice", "--store", store]) == 0
    assert api_keys.parse_store((tmp_path / "api-keys").read_text()) == []


def test_sync_without_haproxy_writes_the_map(tmp_path):
    store, key_map = tmp_path / "api-keys", tmp_path / "api-keys.map"
    store.write_text(api_keys.format_store(api_keys.add_entry([], "alice", key_digest(KEY))))
    message = api_keys.sync(str(store), str(key_map), str(tmp_path / "no.sock"))
    assert "HAProxy not running" in message and "alice" in message
    assert key_map.read_text() == f"{key_digest(KEY)[7:]} alice\n"
    assert stat.S_IMODE(key_map.stat().st_mode) == 0o600


def test_new_keys_are_random_and_long():
    keys = {new_api_key() for _ in range(50)}
    assert len(keys) == 50 and all(k.startswith("gsk-") and len(k) >= 44 for k in keys)


# --- a failed fetch never empties the key map (issue 26) --------------------------------------------------

SECRET = "projects/demo-project/secrets/gs-gpu8-api-keys"


class FakeSecretManager(BaseHTTPRequestHandler):
    """The metadata server's token and Secret Manager's versions.access, answering `answer`:
    (HTTP code, body) as Secret Manager does (https://cloud.google.com/secret-manager/docs/reference/rest)."""

    answer: tuple[int, dict] = (200, {})

    def do_GET(self):  # noqa: N802 - http.server's API
        if self.path.endswith("/token"):
            return self._send(200, {"access_token": "ya29.fake", "expires_in": 3599})
        return self._send(*self.answer)

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def google(monkeypatch):
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeSecretManager)
    # serve_forever's default 0.5 s poll is what shutdown() waits for, at every teardown.
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_port}"
    monkeypatch.setenv("GEMMASERVE_METADATA_URL", f"{base}/meta")
    monkeypatch.setenv("GEMMASERVE_SECRETMANAGER_URL", f"{base}/sm")
    monkeypatch.setenv("GEMMASERVE_FETCH_TIMEOUT", "1")
    monkeypatch.setenv("PATH", "/nonexistent")  # no gcloud to fall back to
    yield FakeSecretManager
    server.shutdown()


def access_answer(text: str) -> tuple[int, dict]:
    raw = text.encode()
    payload = {"data": base64.b64encode(raw).decode(), "dataCrc32c": str(secret_fetch.crc32c(raw))}
    return 200, {"name": f"{SECRET}/versions/3", "payload": payload}


def host(tmp_path, keys: list[str] | None):
    """A host's paths after a reboot: the fetched store (tmpfs) is gone, the map on disk holds `keys`."""
    key_map = tmp_path / "api-keys.map"
    if keys is not None:
        key_map.write_text(api_keys.format_map([api_keys.Entry(k, key_digest(k), "-") for k in keys]))
    args = ["--store", str(tmp_path / "run" / "api-keys"), "--map", str(key_map), "--socket", str(tmp_path / "no")]
    (tmp_path / "run").mkdir()
    return key_map, args


def sync_from(args: list[str]) -> int:
    return api_keys.main(["sync", *args, "--secret", SECRET, "--fetcher", str(FETCHER)])


def test_a_missing_store_never_empties_the_map(tmp_path, capsys):
    """What the unit did after a reboot without Secret Manager: the fetch failed (ignored), then `sync`
    read no store as no keys and wrote an empty map: every client got 401."""
    key_map, args = host(tmp_path, ["alice", "bob"])
    before = key_map.read_text()
    assert api_keys.main(["sync", *args]) == 1
    assert key_map.read_text() == before
    assert "keeps serving the 2 key(s) of the last good store (ids: alice, bob)" in capsys.readouterr().err


@pytest.mark.parametrize("keys, window", [(["alice"], "15"), (None, "120")])
def test_a_host_with_keys_waits_briefly_for_secret_manager(tmp_path, monkeypatch, keys, window):
    """The unit runs before HAProxy at boot: a host that has keys gives the fetcher 15 s, not its 120 s, so a
    reboot during an outage serves the last good store at once (the timer fetches again later); a host that
    never had keys waits the whole window, since it has nothing to serve."""
    monkeypatch.setenv("GEMMASERVE_FETCH_TIMEOUT", "120")
    seen = tmp_path / "window"
    fetcher = tmp_path / "fetcher.py"
    fetcher.write_text(
        f"import os, sys\nopen({str(seen)!r}, 'w').write(os.environ['GEMMASERVE_FETCH_TIMEOUT'])\nsys.exit(1)\n"
    )
    _, args = host(tmp_path, keys)
    assert api_keys.main(["sync", *args, "--secret", SECRET, "--fetcher", str(fetcher)]) == 1
    assert seen.read_text() == window


@pytest.mark.parametrize(
    "answer",
    [
        (503, {"error": {"code": 503, "status": "UNAVAILABLE", "message": "unavailable"}}),
        (403, {"error": {"code": 403, "status": "PERMISSION_DENIED", "message": "denied"}}),
    ],
)
def test_a_failed_fetch_keeps_the_last_keys_and_fails_the_unit(google, tmp_path, capsys, answer):
    google.answer = answer
    key_map, args = host(tmp_path, ["alice"])
    before = key_map.read_text()
    assert sync_from(args) == 1
    assert key_map.read_text() == before
    err = capsys.readouterr().err
    assert f"could not fetch {SECRET}" in err and "keeps serving the 1 key(s)" in err


def test_a_disabled_latest_version_keeps_the_last_keys(google, tmp_path, capsys):
    """`gemmaserve keys --stack` holds its claim (a disabled latest version) for a moment: not a failure."""
    google.answer = (400, {"error": {"code": 400, "status": "FAILED_PRECONDITION", "message": "is DISABLED"}})
    key_map, args = host(tmp_path, ["alice"])
    before = key_map.read_text()
    assert sync_from(args) == 0
    assert key_map.read_text() == before and "not enabled" in capsys.readouterr().err


def test_no_version_yet_on_a_new_host_is_an_empty_map(google, tmp_path):
    """A new stack before its first `gemmaserve keys add`: HAProxy needs the map file to start."""
    google.answer = (404, {"error": {"code": 404, "status": "NOT_FOUND", "message": "no versions"}})
    key_map, args = host(tmp_path, None)
    assert sync_from(args) == 0
    assert key_map.read_text() == ""


def test_a_fetched_store_is_synced(google, tmp_path):
    google.answer = access_answer(api_keys.format_store([api_keys.Entry("carol", key_digest("carol"), "-")]))
    key_map, args = host(tmp_path, ["alice"])
    assert sync_from(args) == 0
    assert key_map.read_text() == f"{key_digest('carol')[7:]} carol\n"


def test_the_unit_runs_the_fetch_inside_sync():
    """No ignored `ExecStartPre=-` fetch: sync itself fetches, so it knows when the fetch failed."""
    from gemmaserve.plan import plan
    from gemmaserve.spec import parse_spec
    from roles.access import api_keys_unit

    spec = parse_spec(
        {
            "model": "e2b",
            "accelerator": {"kind": "l4"},
            "serving": {"api_keys": {"secret_manager": SECRET}, "tls": {"secret_manager": "tls"}},
        }
    )
    unit = api_keys_unit(plan(spec).access)
    assert "ExecStartPre" not in unit
    assert f"sync --store /run/gemmaserve-secrets/api-keys --map /etc/gemmaserve/api-keys.map --secret {SECRET}" in unit
