"""The API key store and HAProxy's key map: add, revoke and list keys, and sync the map into a running HAProxy.

Runs on serving hosts as a standalone script (stdlib only), from gemmaserve-api-keys.service and from
`gemmaserve keys` (which also uses it locally as the one reader and writer of the store format):

    python3 api_keys.py add ID sha256:HEX [--store PATH]   # a key's id and the SHA-256 digest of the key
    python3 api_keys.py revoke ID [--store PATH]
    python3 api_keys.py list [--store PATH]                # [{"id": ..., "created": ...}] as JSON
    python3 api_keys.py init [--store PATH]                # an empty store, where there is none
    python3 api_keys.py sync [--store PATH] [--map PATH] [--socket PATH] [--secret NAME --fetcher PATH]

The store holds one key per line, `ID sha256:HEX CREATED`: digests, never keys. HAProxy hashes the bearer
token a client presents (`sha2(256)`) and looks the digest up in the map (`DIGEST ID` per line), so neither
the store, the map, HAProxy's memory nor any log on the host holds a key. `sync` writes the map file
(read when HAProxy starts or reloads) and swaps the running HAProxy's copy atomically through its admin
socket (`prepare map` / `add map @VERSION` / `commit map`): keys that stay valid are never absent, a revoked
key fails from the next request on, and nothing restarts or reloads.

With `--secret`, `sync` first fetches the store from Secret Manager (through secret_fetch.py, into --store on
tmpfs). A fetch that fails, or a store that is missing, never changes the keys HAProxy serves: the map file
is on disk and keeps the last good store across reboots, and the failure is reported (exit status 1, so
the unit fails). Two answers are not failures: a new stack's secret without a version yet on a host that
never had keys (an empty map, so HAProxy can start), and a latest version that is not enabled (the claim
`gemmaserve keys --stack` holds for a moment while it writes; the last keys stay).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime, timezone

# Installed beside this program by the base role (roles/_lib/files/hostlib.py): the map file is written
# atomically, so HAProxy or a reader never sees half a file.
from hostlib import HAPROXY_SOCKET as SOCKET
from hostlib import haproxy_command as command
from hostlib import write_private

STORE = "/etc/gemmaserve/api-keys"
MAP = "/etc/gemmaserve/api-keys.map"
# secret_fetch.py's exit statuses: the secret has no version (yet); its latest version is not enabled.
FETCH_NOT_FOUND, FETCH_NOT_ENABLED = 3, 4
# How long secret_fetch.py retries Secret Manager (its GEMMASERVE_FETCH_TIMEOUT) when the host already serves a
# last good store: this unit runs before HAProxy at boot, and with the fetcher's default 120 s a reboot during an
# outage held the endpoint back two minutes for keys it already had. The timer tries again at its next refresh.
FETCH_TIMEOUT_WITH_KEYS = float(os.environ.get("GEMMASERVE_FETCH_TIMEOUT_WITH_KEYS", "15"))
HEADER = "# gemmaserve API keys: `ID sha256:DIGEST CREATED` per line (digests, never keys); see `gemmaserve keys`.\n"
# Safe in HAProxy's map values, its logs and a shell word.
KEY_ID = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


class StoreError(Exception):
    pass


@dataclass(frozen=True)
class Entry:
    id: str
    digest: str  # "sha256:<64 hex>"
    created: str

    @property
    def hex(self) -> str:
        return self.digest.removeprefix("sha256:")


def check_id(key_id: str) -> str:
    if not KEY_ID.match(key_id):
        raise StoreError(
            f"key id {key_id!r}: allowed: 1-63 of a-z, 0-9, '_', '.', '-', starting with a letter or digit"
        )
    return key_id


def parse_store(text: str, source: str = "store") -> list[Entry]:
    entries: list[Entry] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        words = line.split()
        if len(words) not in (2, 3) or not KEY_ID.match(words[0]) or not DIGEST.match(words[1]):
            # Never echo the line: a key pasted by mistake must not reach a log.
            raise StoreError(f"{source} line {number}: expected `ID sha256:DIGEST [CREATED]`")
        entries.append(Entry(words[0], words[1], words[2] if len(words) == 3 else "-"))
    ids = [e.id for e in entries]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise StoreError(f"{source}: key id(s) listed twice: {', '.join(duplicates)}")
    return entries


def format_store(entries: list[Entry]) -> str:
    return HEADER + "".join(f"{e.id} {e.digest} {e.created}\n" for e in entries)


def format_map(entries: list[Entry]) -> str:
    return "".join(f"{e.hex} {e.id}\n" for e in entries)


def add_entry(entries: list[Entry], key_id: str, digest: str, created: str | None = None) -> list[Entry]:
    check_id(key_id)
    if not DIGEST.match(digest):
        raise StoreError("digest: allowed: sha256: followed by 64 lowercase hex digits")
    if any(e.id == key_id for e in entries):
        raise StoreError(f"key id {key_id!r} exists; revoke it first or choose another id")
    if any(e.digest == digest for e in entries):
        raise StoreError("that key is already in the store (under another id)")
    # timezone.utc, not 3.11's datetime.UTC: hosts run /usr/bin/python3, 3.10 on Ubuntu 22.04.
    stamp = created or datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")  # noqa: UP017
    return [*entries, Entry(key_id, digest, stamp)]


def revoke_entry(entries: list[Entry], key_id: str) -> list[Entry]:
    if not any(e.id == key_id for e in entries):
        known = ", ".join(e.id for e in entries) or "none"
        raise StoreError(f"no key with id {key_id!r}; known ids: {known}")
    return [e for e in entries if e.id != key_id]


def read_store(path: str) -> list[Entry]:
    try:
        with open(path) as handle:
            return parse_store(handle.read(), path)
    except FileNotFoundError:
        return []


def running_map(map_path: str, sock: str = SOCKET) -> dict[str, str] | None:
    """The running HAProxy's copy of the map ({digest: id}), or None when it has not loaded this map."""
    out = command(f"show map {map_path}", sock)
    if "Unknown map identifier" in out or "unknown map" in out.lower():
        return None
    pairs = (line.split() for line in out.splitlines() if line.strip())
    # Each line: "<entry pointer> <key> <value>".
    return {words[1]: words[2] for words in pairs if len(words) == 3}


def swap_running_map(entries: list[Entry], map_path: str, sock: str = SOCKET) -> bool:
    """Replace the running map atomically; False when this HAProxy has not loaded the map (yet)."""
    prepared = command(f"prepare map {map_path}", sock)
    match = re.search(r"New version created:\s*(\d+)", prepared)
    if not match:
        if "Unknown map identifier" in prepared or "unknown map" in prepared.lower():
            return False
        raise StoreError(f"HAProxy refused `prepare map {map_path}`: {prepared.strip()}")
    version = match[1]
    for entry in entries:
        out = command(f"add map @{version} {map_path} {entry.hex} {entry.id}", sock).strip()
        if out:
            raise StoreError(f"HAProxy refused a map entry for key id {entry.id}: {out}")
    out = command(f"commit map @{version} {map_path}", sock).strip()
    if out:
        raise StoreError(f"HAProxy refused `commit map`: {out}")
    return True


def read_map(map_path: str) -> dict[str, str] | None:
    """The map file's {digest: id}: the keys HAProxy loads at start; None when there is no map file."""
    try:
        with open(map_path) as handle:
            return dict(line.split()[:2] for line in handle if len(line.split()) >= 2)
    except FileNotFoundError:
        return None


def kept(map_path: str) -> str:
    last = read_map(map_path) or {}
    ids = ", ".join(sorted(last.values())) or "none"
    return f"HAProxy keeps serving the {len(last)} key(s) of the last good store (ids: {ids}) from {map_path}"


def sync(store: str, map_path: str, sock: str = SOCKET) -> str:
    if not os.path.exists(store):
        # After a reboot the fetched store (tmpfs) is gone until a fetch succeeds: no store is not no keys.
        raise StoreError(f"{store}: no key store; {kept(map_path)}")
    entries = read_store(store)
    write_private(map_path, format_map(entries), 0o600)
    ids = ", ".join(e.id for e in entries) or "none"
    if not os.path.exists(sock):
        return f"{len(entries)} key(s) in {map_path} (ids: {ids}); HAProxy not running, it reads the map at start"
    if not swap_running_map(entries, map_path, sock):
        return f"{len(entries)} key(s) in {map_path} (ids: {ids}); HAProxy has not loaded the map yet (next reload)"
    live = running_map(map_path, sock) or {}
    if live != {e.hex: e.id for e in entries}:
        raise StoreError(f"HAProxy's map differs from {store} after the swap")
    return f"{len(entries)} key(s) live in HAProxy (ids: {ids})"


def fetch_and_sync(secret: str, fetcher: str, store: str, map_path: str, sock: str = SOCKET) -> str:
    """Fetch the store from Secret Manager, then sync it; a failed fetch keeps the last good keys."""
    env = dict(os.environ)
    if read_map(map_path) is not None:
        # Shorter than the fetcher's own window (its default, or one set for it), never longer.
        window = min(float(env.get("GEMMASERVE_FETCH_TIMEOUT", "inf")), FETCH_TIMEOUT_WITH_KEYS)
        env["GEMMASERVE_FETCH_TIMEOUT"] = f"{window:g}"
    status = subprocess.run([sys.executable, fetcher, secret, store], check=False, env=env).returncode  # says why
    if status == 0:
        return sync(store, map_path, sock)
    if read_map(map_path) is None:
        # This host never had keys; HAProxy cannot start without its map file: an empty one refuses everyone.
        write_private(map_path, "", 0o600)
        if status == FETCH_NOT_FOUND:
            return f"{secret} has no version yet: no keys, every request is refused until `gemmaserve keys add`"
    elif status == FETCH_NOT_ENABLED:
        return (
            f"the latest version of {secret} is not enabled (a `gemmaserve keys` change under way; if it stays so, "
            f"`gemmaserve keys list` says why); {kept(map_path)}"
        )
    raise StoreError(f"could not fetch {secret} (secret_fetch.py exit {status}, see above); {kept(map_path)}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="api_keys.py")
    sub = parser.add_subparsers(dest="action", required=True)
    add = sub.add_parser("add")
    add.add_argument("id")
    add.add_argument("digest", help="sha256:HEX of the key (never the key)")
    revoke = sub.add_parser("revoke")
    revoke.add_argument("id")
    sub.add_parser("list")
    sub.add_parser("init")
    sync_parser = sub.add_parser("sync")
    sync_parser.add_argument("--map", default=MAP)
    sync_parser.add_argument("--socket", default=SOCKET)
    sync_parser.add_argument("--secret", help="fetch the store from this Secret Manager secret first")
    # Installed next to this program by roles/access.
    fetcher = os.path.join(os.path.dirname(os.path.abspath(__file__)), "secret_fetch.py")
    sync_parser.add_argument("--fetcher", default=fetcher, help="secret_fetch.py, with --secret")
    for each in (add, revoke, sync_parser, sub.choices["list"], sub.choices["init"]):
        each.add_argument("--store", default=STORE)
    args = parser.parse_args(argv)
    try:
        entries = read_store(args.store) if args.action in ("list", "add", "revoke") else []
        if args.action == "list":
            print(json.dumps([{"id": e.id, "created": e.created} for e in entries]))
        elif args.action == "init":
            if not os.path.exists(args.store):
                write_private(args.store, format_store([]))
        elif args.action == "add":
            write_private(args.store, format_store(add_entry(entries, args.id, args.digest)))
            print(f"gemmaserve: key {args.id} added to {args.store}", file=sys.stderr)
        elif args.action == "revoke":
            write_private(args.store, format_store(revoke_entry(entries, args.id)))
            print(f"gemmaserve: key {args.id} revoked in {args.store}", file=sys.stderr)
        elif args.secret:
            message = fetch_and_sync(args.secret, args.fetcher, args.store, args.map, args.socket)
            print(f"gemmaserve: {message}", file=sys.stderr)
        else:
            print(f"gemmaserve: {sync(args.store, args.map, args.socket)}", file=sys.stderr)
    except (StoreError, OSError) as error:
        print(f"gemmaserve: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
