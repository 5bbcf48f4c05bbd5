"""The API key store and HAProxy's key map: add, revoke and list keys, and sync the map into a running HAProxy.

Runs on serving hosts as a standalone script (stdlib only), from gemmaserve-api-keys.service and from
`gemmaserve keys` (which also uses it locally as the one reader and writer of the store format):

    python3 api_keys.py add ID sha256:HEX [--store PATH]   # a key's id and the SHA-256 digest of the key
    python3 api_keys.py revoke ID [--store PATH]
    python3 api_keys.py list [--store PATH]                # [{"id": ..., "created": ...}] as JSON
    python3 api_keys.py init [--store PATH]                # an empty store, where there is none
    python3 api_keys.py sync [--store PATH] [--map PATH] [--socket PATH]

The store holds one key per line, `ID sha256:HEX CREATED`: digests, never keys. HAProxy hashes the bearer
token a client presents (`sha2(256)`) and looks the digest up in the map (`DIGEST ID` per line), so neither
the store, the map, HAProxy's memory nor any log on the host holds a key. `sync` writes the map file
(read when HAProxy starts or reloads) and swaps the running HAProxy's copy atomically through its admin
socket (`prepare map` / `add map @VERSION` / `commit map`): keys that stay valid are never absent, a revoked
key fails from the next request on, and nothing restarts or reloads.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import socket
import sys
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime

STORE = "/etc/gemmaserve/api-keys"
MAP = "/etc/gemmaserve/api-keys.map"
SOCKET = "/run/haproxy/admin.sock"
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
    stamp = created or datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
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


def write_private(path: str, text: str, mode: int = 0o600) -> None:
    """Atomically, so HAProxy or a reader never sees half a file."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".gemmaserve-keys.")
    try:
        with os.fdopen(fd, "w") as handle:
            os.fchmod(handle.fileno(), mode)
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def command(line: str, path: str = SOCKET) -> str:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(10)
        conn.connect(path)
        conn.sendall(line.encode() + b"\n")
        chunks = []
        while chunk := conn.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks).decode()


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


def sync(store: str, map_path: str, sock: str = SOCKET) -> str:
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
    for each in (add, revoke, sync_parser, sub.choices["list"], sub.choices["init"]):
        each.add_argument("--store", default=STORE)
    args = parser.parse_args(argv)
    try:
        entries = read_store(args.store)
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
        else:
            print(f"gemmaserve: {sync(args.store, args.map, args.socket)}", file=sys.stderr)
    except (StoreError, OSError) as error:
        print(f"gemmaserve: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
