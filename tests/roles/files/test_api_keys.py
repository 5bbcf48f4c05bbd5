"""api_keys.py's key store: digests only, ids validated, bad lines named but never echoed (a key pasted by
mistake must not reach a log). The sync against a real HAProxy is in tests/roles/fixtures/test_haproxy_access.py."""

from __future__ import annotations

import json
import stat

import pytest

from gemmaserve.sandbox.credentials import key_digest, new_api_key
from tests.roles.files.programs import load

api_keys = load("access", "api_keys")
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
