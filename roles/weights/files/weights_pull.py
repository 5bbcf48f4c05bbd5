"""Pull mirrored revisions (the model's, its LoRA adapters') from the bucket to local disk before any replica
starts: parallel ranged downloads pinned to the generations the mirror recorded, every file checked against
the hub's hashes (sha256 for LFS files, the git blob sha1 for the rest), one copy shared by all replicas.

Runs on serving hosts as a standalone script (stdlib + gcs_json and hostlib, installed beside it):

    python3 weights_pull.py check --bucket B --prefix P [--prefix P2 ...]   # each revision is in the mirror
    python3 weights_pull.py pull  --bucket B --prefix P --dest DIR [--prefix P2 --dest DIR2 ...] [--parallel 8]

`check` is what a deploy runs before it restarts anything. `pull` fetches each --prefix into the --dest given
after it, in order: into DIR.partial (files already there and verified are kept: an interrupted pull resumes),
verifies, then renames it to DIR and writes DIR/.gemmaserve-complete; a complete DIR is verified by size and left
alone. Progress goes to stderr and, under systemd, to the unit's status line ("fetching weights: 412/1090 MiB").
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import shutil
import sys
import threading
import time
from pathlib import Path

# Installed beside this program (roles/_lib/files).
import gcs_json
from hostlib import sd_notify

MANIFEST = "gemmaserve-manifest.json"
COMPLETE = ".gemmaserve-complete"
PIECE = 64 * 2**20
CHUNK = 4 * 2**20


class PullError(Exception):
    pass


def status(text: str) -> None:
    print(f"gemmaserve-weights: {text}", file=sys.stderr, flush=True)
    sd_notify(f"STATUS={text}")


def read_manifest(bucket: gcs_json.Bucket, prefix: str) -> dict:
    """The revision's manifest, or a PullError that says what is wrong (bucket, permission, revision)."""
    try:
        if not bucket.exists():
            raise PullError(f"gs://{bucket.name}: no such bucket (weights.bucket)")
        meta = bucket.stat(prefix + MANIFEST)
        if meta is None:
            raise PullError(
                f"gs://{bucket.name}/{prefix}: this revision is not in the mirror (no {MANIFEST}); "
                "run `gemmaserve weights mirror` for it first"
            )
        with bucket.read(prefix + MANIFEST, generation=int(meta["generation"])) as response:
            return json.loads(response.read())
    except gcs_json.StorageError as error:
        raise PullError(str(error)) from None


def manifest_digest(manifest: dict) -> str:
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()


def check(bucket: gcs_json.Bucket, prefix: str) -> dict:
    """The manifest is there and every object it names exists at its recorded generation and size."""
    manifest = read_manifest(bucket, prefix)
    try:
        for entry in manifest["files"]:
            meta = bucket.stat(prefix + entry["path"])
            if meta is None:
                raise PullError(f"gs://{bucket.name}/{prefix}{entry['path']}: missing from the mirror")
            if int(meta["generation"]) != entry["generation"] or int(meta["size"]) != entry["size"]:
                raise PullError(
                    f"gs://{bucket.name}/{prefix}{entry['path']}: changed since it was mirrored (generation "
                    f"{meta['generation']}, size {meta['size']}; the manifest has {entry['generation']}, {entry['size']})"
                )
    except gcs_json.StorageError as error:
        raise PullError(str(error)) from None
    return manifest


class Progress:
    def __init__(self, total: int):
        self.total, self.done, self.lock, self.started, self.last = total, 0, threading.Lock(), time.monotonic(), 0.0

    def add(self, count: int) -> None:
        with self.lock:
            self.done += count
            now = time.monotonic()
            if now - self.last >= 2 or self.done == self.total:
                self.last = now
                rate = self.done / 2**20 / max(now - self.started, 1e-6)
                status(
                    f"fetching weights: {self.done / 2**20:.0f}/{self.total / 2**20:.0f} MiB "
                    f"({100 * self.done / max(self.total, 1):.0f}%), {rate:.0f} MiB/s"
                )


def _fetch_piece(bucket, name, generation, path: Path, start: int, end: int, progress: Progress) -> None:
    with bucket.read(name, generation=generation, start=start, end=end) as response, open(path, "r+b") as out:
        out.seek(start)
        expected = end - start + 1
        while chunk := response.read(CHUNK):
            out.write(chunk)
            expected -= len(chunk)
            progress.add(len(chunk))
    if expected != 0:
        raise PullError(f"gs://{bucket.name}/{name}: {expected} bytes short in range {start}-{end}")


def verify(path: Path, entry: dict) -> str | None:
    """None when the file matches its manifest entry, else what is wrong."""
    if not path.is_file() or path.stat().st_size != entry["size"]:
        return f"size {path.stat().st_size if path.is_file() else 'missing'}, expected {entry['size']}"
    sha256 = hashlib.sha256()
    blob = hashlib.sha1(f"blob {entry['size']}\0".encode())
    with path.open("rb") as handle:
        while chunk := handle.read(CHUNK):
            sha256.update(chunk)
            blob.update(chunk)
    if entry.get("sha256") and sha256.hexdigest() != entry["sha256"]:
        return f"sha256 {sha256.hexdigest()}, expected {entry['sha256']} (the hub's hash)"
    if blob.hexdigest() != entry["git_sha1"]:
        return f"git blob sha1 {blob.hexdigest()}, expected {entry['git_sha1']} (the hub's hash)"
    return None


def _safe(dest: Path, relative: str) -> Path:
    target = (dest / relative).resolve()
    if dest.resolve() not in target.parents:
        raise PullError(f"manifest path {relative!r} escapes {dest}")
    return target


def pull(bucket: gcs_json.Bucket, prefix: str, dest: Path, parallel: int = 8, user: str | None = None) -> dict:
    manifest = check(bucket, prefix)
    digest = manifest_digest(manifest)
    marker = dest / COMPLETE
    if marker.is_file() and marker.read_text().strip() == digest:
        if all(
            (dest / e["path"]).is_file() and (dest / e["path"]).stat().st_size == e["size"] for e in manifest["files"]
        ):
            status(f"weights already local in {dest} (revision {manifest['revision'][:12]})")
            return {"bytes": 0, "seconds": 0.0, "files": 0}
    staging = dest.with_name(dest.name + ".partial")
    staging.mkdir(parents=True, exist_ok=True)
    todo = []
    for entry in manifest["files"]:
        path = _safe(staging, entry["path"])
        if path.is_file() and path.stat().st_size == entry["size"] and verify(path, entry) is None:
            continue  # resumed: verified in an earlier, interrupted pull
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as handle:
            handle.truncate(entry["size"])
        todo.append((entry, path))
    total = sum(e["size"] for e, _ in todo)
    progress = Progress(total)
    status(f"fetching weights: {len(todo)} files, {total / 2**20:.0f} MiB from gs://{bucket.name}/{prefix}")
    started = time.monotonic()
    pieces = [
        (prefix + e["path"], e["generation"], path, start, min(start + PIECE, e["size"]) - 1)
        for e, path in todo
        for start in range(0, e["size"], PIECE)
    ]
    with concurrent.futures.ThreadPoolExecutor(max_workers=parallel) as pool:
        futures = [pool.submit(_fetch_piece, bucket, *piece, progress) for piece in pieces]
        for future in concurrent.futures.as_completed(futures):
            try:
                future.result()
            except gcs_json.StorageError as error:
                raise PullError(str(error)) from None
    fetched = time.monotonic() - started
    status(f"verifying {len(todo)} files against the hub's hashes")
    for entry, path in todo:
        problem = verify(path, entry)
        if problem:
            path.unlink()
            raise PullError(f"gs://{bucket.name}/{prefix}{entry['path']} is corrupt: {problem}; nothing was replaced")
    if dest.exists():
        shutil.rmtree(dest)
    staging.rename(dest)
    if user:
        shutil.chown(dest, user, user)
        for item in dest.rglob("*"):
            shutil.chown(item, user, user)
    for item in [dest, *dest.rglob("*")]:
        item.chmod(0o755 if item.is_dir() else 0o644)
    marker.write_text(digest + "\n")
    seconds = time.monotonic() - started
    status(
        f"weights local in {dest}: {total / 2**20:.0f} MiB in {seconds:.1f} s "
        f"({total / 2**20 / max(fetched, 1e-6):.0f} MiB/s download, {seconds - fetched:.1f} s verify)"
    )
    return {"bytes": total, "seconds": seconds, "files": len(todo)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="weights_pull.py")
    parser.add_argument("action", choices=["check", "pull"])
    parser.add_argument("--bucket", required=True)
    parser.add_argument(
        "--prefix",
        required=True,
        action="append",
        help="a revision's folder: PREFIX/models/<id>/<revision>/ or PREFIX/adapters/<id>/<revision>/ (repeatable)",
    )
    parser.add_argument("--dest", type=Path, action="append", default=[], help="where the --prefix before it goes")
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--user", default=None, help="owner of the local copy")
    args = parser.parse_args(argv)
    bucket = gcs_json.Bucket(args.bucket)
    prefixes = [prefix.rstrip("/") + "/" for prefix in args.prefix]
    if args.action == "pull" and len(args.dest) != len(prefixes):
        parser.error(f"pull: give one --dest per --prefix ({len(prefixes)} --prefix, {len(args.dest)} --dest)")
    try:
        if args.action == "check":
            for prefix in prefixes:
                manifest = check(bucket, prefix)
                size = sum(e["size"] for e in manifest["files"])
                print(
                    f"gs://{args.bucket}/{prefix}: revision {manifest['revision']} in the mirror, "
                    f"{len(manifest['files'])} files, {size / 2**20:.0f} MiB",
                    file=sys.stderr,
                )
        else:
            for prefix, dest in zip(prefixes, args.dest, strict=True):
                pull(bucket, prefix, dest, args.parallel, args.user)
            time.sleep(0.2)  # let systemd read the last status line while this process is still the main one
    except PullError as error:
        status(f"failed: {error}")
        time.sleep(0.2)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
