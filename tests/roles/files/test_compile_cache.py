"""Compile cache save/restore/prune on real directories (the script runs on hosts as-is)."""

import os
import pwd
import time

import pytest

from roles._lib.programs import load_program

compile_cache = load_program("caches", "compile_cache")


def fill(path, name, size):
    path.mkdir(parents=True, exist_ok=True)
    (path / name).write_bytes(b"x" * size)


def test_save_then_restore_round_trip(tmp_path):
    shm, disk = tmp_path / "shm", tmp_path / "disk"
    fill(shm / "k1" / "inductor", "graph.bin", 1000)
    fill(shm / "k1" / "tmp", "scratch", 1000)
    compile_cache.save(["k1"], shm, disk, None, 10**9)
    assert (disk / "k1" / "inductor" / "graph.bin").stat().st_size == 1000
    assert not (disk / "k1" / "tmp").exists()  # scratch space is not cache
    fresh = tmp_path / "shm-after-reboot"
    compile_cache.restore(["k1"], fresh, disk, None, None)
    assert (fresh / "k1" / "inductor" / "graph.bin").read_bytes() == b"x" * 1000


def test_restore_never_overwrites_a_live_cache(tmp_path):
    shm, disk = tmp_path / "shm", tmp_path / "disk"
    fill(disk / "k1", "old", 10)
    fill(shm / "k1", "new", 10)
    compile_cache.restore(["k1"], shm, disk, None, None)
    assert (shm / "k1" / "new").exists() and not (shm / "k1" / "old").exists()


def test_unknown_keys_restore_nothing(tmp_path):
    compile_cache.restore(["missing"], tmp_path / "shm", tmp_path / "disk", None, None)
    assert list((tmp_path / "shm").iterdir()) == []


def test_prune_drops_stale_keys_before_current_ones(tmp_path):
    fill(tmp_path / "stale", "a", 600)
    fill(tmp_path / "current", "a", 600)
    removed = compile_cache.prune(tmp_path, {"current"}, 1000)
    assert removed == ["stale"] and (tmp_path / "current").exists()


def test_prune_drops_oldest_current_key_when_still_over(tmp_path):
    fill(tmp_path / "old", "a", 600)
    fill(tmp_path / "new", "a", 600)
    past = time.time() - 3600
    os.utime(tmp_path / "old", (past, past))
    assert compile_cache.prune(tmp_path, {"old", "new"}, 1000) == ["old"]


def test_prune_keeps_everything_under_the_bound(tmp_path):
    fill(tmp_path / "a", "a", 100)
    assert compile_cache.prune(tmp_path, set(), 1000) == []


def test_save_bounds_the_stores(tmp_path):
    shm, disk = tmp_path / "shm", tmp_path / "disk"
    fill(shm / "k1", "a", 800)
    fill(disk / "stale", "a", 800)
    compile_cache.save(["k1"], shm, disk, None, 1000)
    assert sorted(p.name for p in disk.iterdir()) == ["k1"]


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_restore_gives_a_symlink_to_the_user_never_its_target(tmp_path):
    """A cache holding a symlink to a file outside it (a replica can write one into /dev/shm, and the save
    keeps links): restored for the user, the link is theirs and the root-owned target stays root's."""
    outside = tmp_path / "outside"
    outside.write_text("root's")
    fill(tmp_path / "disk" / "k1", "graph.bin", 10)
    (tmp_path / "disk" / "k1" / "link").symlink_to(outside)
    compile_cache.restore(["k1"], tmp_path / "shm", tmp_path / "disk", None, "daemon")
    restored = tmp_path / "shm" / "k1"
    daemon = pwd.getpwnam("daemon").pw_uid
    assert os.lstat(restored / "link").st_uid == daemon and (restored / "graph.bin").stat().st_uid == daemon
    assert outside.stat().st_uid == 0
