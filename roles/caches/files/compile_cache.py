"""Keep compile caches in /dev/shm across reboots and preemption: restore before replicas start, save at
stop and periodically, bounded in size.

Runs on serving hosts as a standalone script (stdlib only), from the gemmaserve-cache-* units:

    python3 compile_cache.py restore --keys K1 K2 ...   # disk (and optionally GCS) -> /dev/shm
    python3 compile_cache.py save --keys K1 K2 ...      # /dev/shm -> disk (and optionally GCS)

Each cache directory is named by the plan's cache key (vLLM version, model, TP and every flag that
changes compiled graphs), so a flag change starts a new cache instead of serving a stale one. Keys not
in --keys are pruned first when a store exceeds --max-gib; then the least recently saved.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

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
    if user:
        shutil.chown(path, user, user)
        for item in path.rglob("*"):
            shutil.chown(item, user, user)


def restore(keys: list[str], shm: Path, disk: Path, gcs: str | None, user: str | None) -> None:
    shm.mkdir(parents=True, exist_ok=True)
    for key in keys:
        target = shm / key
        if gcs and not (disk / key).exists():
            _gcs_sync(f"{gcs.rstrip('/')}/{key}", disk / key)
        if (disk / key).is_dir() and not target.exists():
            _copy(disk / key, target)
            _chown_tree(target, user)
            print(f"restored {key} ({size_bytes(target) / 2**20:.1f} MiB)", file=sys.stderr)
        elif target.exists():
            print(f"{key}: already in {shm}", file=sys.stderr)
        else:
            print(f"{key}: no saved cache yet (first start compiles)", file=sys.stderr)


def save(keys: list[str], shm: Path, disk: Path, gcs: str | None, max_bytes: int) -> None:
    disk.mkdir(parents=True, exist_ok=True)
    for key in keys:
        source = shm / key
        if not source.is_dir():
            continue
        _copy(source, disk / key)
        os.utime(disk / key)
        if gcs:
            _gcs_sync(str(disk / key), f"{gcs.rstrip('/')}/{key}")
        print(f"saved {key} ({size_bytes(disk / key) / 2**20:.1f} MiB)", file=sys.stderr)
    for root in (disk, shm):
        for name in prune(root, set(keys), max_bytes):
            print(f"pruned {name} from {root} (over {max_bytes / 2**30:.1f} GiB)", file=sys.stderr)


def _gcs_sync(src: str, dst: str) -> None:
    if not shutil.which("gcloud"):
        print("gcloud not installed: GCS cache copy skipped", file=sys.stderr)
        return
    subprocess.run(["gcloud", "storage", "rsync", "--recursive", src, dst], check=False)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="compile_cache.py")
    parser.add_argument("action", choices=["restore", "save"])
    parser.add_argument("--keys", nargs="+", required=True)
    parser.add_argument("--shm", type=Path, default=SHM_ROOT)
    parser.add_argument("--disk", type=Path, default=DISK_ROOT)
    parser.add_argument("--gcs", default=None, help="gs://bucket/prefix to mirror the disk copy to")
    parser.add_argument("--max-gib", type=float, default=8.0)
    parser.add_argument("--user", default=None, help="owner of restored files")
    args = parser.parse_args(argv)
    started = time.monotonic()
    if args.action == "restore":
        restore(args.keys, args.shm, args.disk, args.gcs, args.user)
    else:
        save(args.keys, args.shm, args.disk, args.gcs, int(args.max_gib * 2**30))
    print(f"{args.action} took {time.monotonic() - started:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
