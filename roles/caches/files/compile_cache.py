"""Keep compile caches in /dev/shm across reboots and preemption: restore before replicas start, save at
stop and periodically, bounded in size; with a bucket, carry them from one host of a fleet to the next.

Runs on serving hosts as a standalone script (stdlib + gcs_json, installed beside it), from the
gemmaserve-cache-* units:

    python3 compile_cache.py restore --keys K1 K2 ... [--bucket B --bucket-prefix P]  # (bucket ->) disk -> /dev/shm
    python3 compile_cache.py save --keys K1 K2 ... [--bucket B --bucket-prefix P]     # /dev/shm -> disk (-> bucket)
    python3 compile_cache.py promote --keys K1 ... --from-host H --bucket B --bucket-prefix P  # H's -> the fleet's

Each cache directory is named by the plan's cache key (vLLM version, model, TP and every flag that
changes compiled graphs), so a flag change starts a new cache instead of serving a stale one. Keys not
in --keys are pruned first when a store exceeds --max-gib; then the least recently saved. In the bucket
each key is one object per host, P hosts/<host>/<key>.tar, which only that host saves and restores: what a
replica wrote into its cache (compiled kernels every host that restores them executes) never reaches another
host by itself. Another host restores a cache only once it is promoted to P<key>.tar, fetched only by its
exact key: another vLLM, model, TP or graph-changing flag has another key and never gets this cache. A
download whose md5 differs from the object's is discarded.
"""

from __future__ import annotations

import argparse
import base64
import grp
import hashlib
import os
import pwd
import re
import shutil
import socket
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import gcs_json  # installed beside this program (roles/_lib/files/gcs_json.py)

SHM_ROOT = Path("/dev/shm/gemmaserve")
DISK_ROOT = Path("/var/lib/gemmaserve/compile-cache")
# Scratch space, not cache: never saved.
SKIP = {"tmp"}


def size_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def _copy(src: Path, dst: Path) -> None:
    """Replace dst by a copy of src, atomically (copy next to it, then rename)."""
    staging = dst.with_name(f".{dst.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(src, staging, symlinks=True, ignore=shutil.ignore_patterns(*SKIP))
    old = dst.with_name(f".{dst.name}.old")
    if dst.exists():
        dst.rename(old)
    staging.rename(dst)
    shutil.rmtree(old, ignore_errors=True)


def prune(root: Path, keep: set[str], max_bytes: int) -> list[str]:
    """Delete cache dirs until root fits max_bytes: unknown keys first, then the oldest."""
    if not root.is_dir():
        return []
    entries = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    sizes = {p: size_bytes(p) for p in entries}
    total = sum(sizes.values())
    removed = []
    for path in sorted(entries, key=lambda p: (p.name in keep, p.stat().st_mtime)):
        if total <= max_bytes:
            break
        shutil.rmtree(path, ignore_errors=True)
        total -= sizes[path]
        removed.append(path.name)
    return removed


def _chown_tree(path: Path, user: str | None) -> None:
    """Give the tree to `user`, never what a symlink in it points to (chown -h): a cache may hold links."""
    if user:
        uid, gid = pwd.getpwnam(user).pw_uid, grp.getgrnam(user).gr_gid
        for item in [path, *path.rglob("*")]:
            os.chown(item, uid, gid, follow_symlinks=False)


def restore(keys: list[str], shm: Path, disk: Path, bucket: Remote | None, user: str | None) -> None:
    shm.mkdir(parents=True, exist_ok=True)
    for key in keys:
        target = shm / key
        if bucket and not (disk / key).exists() and not target.exists():
            bucket.fetch(key, disk)
        if (disk / key).is_dir() and not target.exists():
            _copy(disk / key, target)
            _chown_tree(target, user)
            print(f"restored {key} ({size_bytes(target) / 2**20:.1f} MiB)", file=sys.stderr)
        elif target.exists():
            print(f"{key}: already in {shm}", file=sys.stderr)
        else:
            print(f"{key}: no saved cache yet (first start compiles)", file=sys.stderr)


def save(keys: list[str], shm: Path, disk: Path, bucket: Remote | None, max_bytes: int) -> None:
    disk.mkdir(parents=True, exist_ok=True)
    for key in keys:
        source = shm / key
        if not source.is_dir():
            continue
        _copy(source, disk / key)
        os.utime(disk / key)
        if bucket:
            bucket.store(key, disk / key)
        print(f"saved {key} ({size_bytes(disk / key) / 2**20:.1f} MiB)", file=sys.stderr)
    for root in (disk, shm):
        for name in prune(root, set(keys), max_bytes):
            print(f"pruned {name} from {root} (over {max_bytes / 2**30:.1f} GiB)", file=sys.stderr)


def tree_digest(path: Path) -> str:
    """sha256 over every file's relative path and bytes: the same cache has the same digest on any host."""
    digest = hashlib.sha256()
    for item in sorted(p for p in path.rglob("*") if p.is_file() and not p.is_symlink()):
        digest.update(f"{item.relative_to(path).as_posix()}\0{item.stat().st_size}\0".encode())
        digest.update(hashlib.sha256(item.read_bytes()).digest())
    return digest.hexdigest()


HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*(\.[A-Za-z0-9_-]+)*")


class Remote:
    """Caches in a bucket: one tar object per host and cache key under a prefix (what `host` saves and restores
    itself), and the promoted one per key that every host restores."""

    def __init__(self, bucket: gcs_json.Bucket, prefix: str, host: str | None = None):
        self.bucket, self.prefix = bucket, f"{prefix.strip('/')}/" if prefix.strip("/") else ""
        self.host = host or socket.gethostname()
        if not HOST_NAME.fullmatch(self.host):
            raise ValueError(f"{self.host!r} cannot name an object prefix")

    def own(self, key: str, host: str | None = None) -> str:
        return f"{self.prefix}hosts/{host or self.host}/{key}.tar"

    def promoted(self, key: str) -> str:
        return f"{self.prefix}{key}.tar"

    def store(self, key: str, source: Path) -> None:
        digest = tree_digest(source)
        name = self.own(key)
        try:
            current = self.bucket.stat(name)
            if current and (current.get("metadata") or {}).get("gemmaserve-digest") == digest:
                print(f"{key}: bucket copy is current", file=sys.stderr)
                return
            with tempfile.TemporaryDirectory() as scratch:
                archive = Path(scratch) / f"{key}.tar"
                with tarfile.open(archive, "w") as tar:
                    tar.add(source, arcname=".", filter=lambda info: None if info.issym() or info.islnk() else info)
                metadata = {"gemmaserve-digest": digest, "gemmaserve-key": key, "gemmaserve-host": self.host}
                self.bucket.upload(name, str(archive), metadata)
            print(f"{key}: saved to gs://{self.bucket.name}/{name}", file=sys.stderr)
        except gcs_json.StorageError as error:
            print(f"{key}: not saved to the bucket: {error}", file=sys.stderr)

    def _download(self, name: str, meta: dict, archive: Path) -> bool:
        """The object's bytes into `archive`, pinned to the generation `meta` describes; False when they fail
        the object's md5."""
        md5 = hashlib.md5()
        with self.bucket.read(name, generation=int(meta["generation"])) as response:
            with archive.open("wb") as out:
                while chunk := response.read(4 * 2**20):
                    md5.update(chunk)
                    out.write(chunk)
        return base64.b64encode(md5.digest()).decode() == meta.get("md5Hash")

    def fetch(self, key: str, disk: Path) -> bool:
        """Download and unpack the key's cache into disk/key: this host's own, else the promoted one; False when
        the bucket has neither (or it is bad)."""
        try:
            for name in (self.own(key), self.promoted(key)):
                meta = self.bucket.stat(name)
                if meta is not None:
                    break
            else:
                print(
                    f"{key}: no cache of this host or promoted in gs://{self.bucket.name}/{self.prefix}",
                    file=sys.stderr,
                )
                return False
            disk.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=disk) as scratch:
                archive = Path(scratch) / "cache.tar"
                if not self._download(name, meta, archive):
                    print(f"{key}: bucket copy failed its md5 check; not restored", file=sys.stderr)
                    return False
                staging = Path(scratch) / key
                with tarfile.open(archive) as tar:
                    members = [m for m in tar.getmembers() if _inside(m) and (m.isfile() or m.isdir())]
                    tar.extractall(staging, members=members)
                staging.rename(disk / key)
            print(
                f"{key}: fetched from gs://{self.bucket.name}/{name} ({int(meta['size']) / 2**20:.1f} MiB)",
                file=sys.stderr,
            )
            return True
        except gcs_json.StorageError as error:
            print(f"{key}: not fetched from the bucket: {error}", file=sys.stderr)
            return False

    def promote(self, key: str, host: str) -> bool:
        """Make `host`'s saved cache of `key` the one every host restores (a copy, md5-checked on the way)."""
        if not HOST_NAME.fullmatch(host):
            raise ValueError(f"{host!r} cannot name an object prefix")
        source = self.own(key, host)
        try:
            meta = self.bucket.stat(source)
            if meta is None:
                print(f"{key}: gs://{self.bucket.name}/{source} does not exist; nothing promoted", file=sys.stderr)
                return False
            with tempfile.TemporaryDirectory() as scratch:
                archive = Path(scratch) / "cache.tar"
                if not self._download(source, meta, archive):
                    print(
                        f"{key}: gs://{self.bucket.name}/{source} failed its md5 check; not promoted", file=sys.stderr
                    )
                    return False
                metadata = {**(meta.get("metadata") or {}), "gemmaserve-key": key}
                self.bucket.upload(self.promoted(key), str(archive), metadata)
        except gcs_json.StorageError as error:
            print(f"{key}: not promoted: {error}", file=sys.stderr)
            return False
        print(f"{key}: promoted {host}'s cache to gs://{self.bucket.name}/{self.promoted(key)}", file=sys.stderr)
        return True


def _inside(member: tarfile.TarInfo) -> bool:
    parts = Path(member.name).parts
    return not Path(member.name).is_absolute() and ".." not in parts


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="compile_cache.py")
    parser.add_argument("action", choices=["restore", "save", "promote"])
    parser.add_argument("--keys", nargs="+", required=True)
    parser.add_argument("--shm", type=Path, default=SHM_ROOT)
    parser.add_argument("--disk", type=Path, default=DISK_ROOT)
    parser.add_argument("--bucket", default=None, help="bucket that carries caches between hosts")
    parser.add_argument("--bucket-prefix", default="compile-cache/", help="object prefix in --bucket")
    parser.add_argument("--max-gib", type=float, default=8.0)
    parser.add_argument("--user", default=None, help="owner of restored files")
    parser.add_argument("--host", default=None, help="this host's name in the bucket (default: its hostname)")
    parser.add_argument("--from-host", default=None, help="promote: the host whose saved cache every host gets")
    args = parser.parse_args(argv)
    started = time.monotonic()
    remote = Remote(gcs_json.Bucket(args.bucket), args.bucket_prefix, args.host) if args.bucket else None
    if args.action == "promote":
        if remote is None or not args.from_host:
            parser.error("promote needs --bucket and --from-host")
        return 0 if all([remote.promote(key, args.from_host) for key in args.keys]) else 1
    if args.action == "restore":
        restore(args.keys, args.shm, args.disk, remote, args.user)
    else:
        save(args.keys, args.shm, args.disk, remote, int(args.max_gib * 2**30))
    print(f"{args.action} took {time.monotonic() - started:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
