"""Compile caches carried between hosts through a bucket (a real GCS API emulator), keyed by the plan's key: each
host saves under its own prefix and restores its own; another host restores a cache only once it is promoted."""

from __future__ import annotations

import pytest

from roles._lib.programs import load_program

compile_cache = load_program("caches", "compile_cache")
gcs_json = __import__("gcs_json")


def fill(root, files):
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)


def remote(bucket, host: str = "host-a"):
    return compile_cache.Remote(gcs_json.Bucket(bucket.name), "compile-cache/", host)


def test_a_second_host_restores_the_first_hosts_cache_once_promoted(bucket, tmp_path):
    """Host A's save lands under its own prefix; host B restores nothing from it (what A's replica wrote, kernels
    B would execute, never reaches B by itself) until A's cache is promoted, then exactly A's cache."""
    first, second = tmp_path / "first", tmp_path / "second"
    fill(first / "shm" / "k1", {"inductor/ab/kernel.so": b"\x7fELF" * 100, "vllm/torch_compile_cache/x": b"y"})
    compile_cache.save(["k1"], first / "shm", first / "disk", remote(bucket), 10**9)
    assert bucket.get_blob("compile-cache/hosts/host-a/k1.tar") is not None
    assert bucket.get_blob("compile-cache/k1.tar") is None
    compile_cache.restore(["k1"], second / "shm", second / "disk", remote(bucket, "host-b"), None)
    assert list((second / "shm").iterdir()) == []
    assert remote(bucket, "operator").promote("k1", "host-a")
    compile_cache.restore(["k1"], second / "shm", second / "disk", remote(bucket, "host-b"), None)
    assert (second / "shm" / "k1" / "inductor/ab/kernel.so").read_bytes() == b"\x7fELF" * 100
    assert compile_cache.tree_digest(second / "shm" / "k1") == compile_cache.tree_digest(first / "disk" / "k1")


def test_a_host_restores_its_own_saved_cache_before_the_promoted_one(bucket, tmp_path):
    """A host that lost its disk (a recreated VM of the same name) gets its own last save back, not the fleet's."""
    fill(tmp_path / "other" / "shm" / "k1", {"inductor/kernel.so": b"promoted"})
    compile_cache.save(["k1"], tmp_path / "other" / "shm", tmp_path / "other" / "disk", remote(bucket, "other"), 10**9)
    assert remote(bucket).promote("k1", "other")
    fill(tmp_path / "a" / "shm" / "k1", {"inductor/kernel.so": b"own"})
    compile_cache.save(["k1"], tmp_path / "a" / "shm", tmp_path / "a" / "disk", remote(bucket), 10**9)
    compile_cache.restore(["k1"], tmp_path / "a2" / "shm", tmp_path / "a2" / "disk", remote(bucket), None)
    assert (tmp_path / "a2" / "shm" / "k1" / "inductor/kernel.so").read_bytes() == b"own"


def test_promoting_a_cache_no_host_saved_promotes_nothing(bucket, tmp_path):
    assert not remote(bucket).promote("k1", "never-saved")
    assert bucket.get_blob("compile-cache/k1.tar") is None


@pytest.mark.parametrize("name", ["../k1", "a/b", ".hidden", "a b"])
def test_a_host_name_that_could_leave_its_prefix_is_refused(bucket, name):
    with pytest.raises(ValueError):
        remote(bucket, name)
    with pytest.raises(ValueError):
        remote(bucket).promote("k1", name)


def test_another_key_never_restores_this_cache(bucket, tmp_path):
    fill(tmp_path / "a" / "shm" / "vllm-0.32-tp1-aaaa", {"inductor/kernel.so": b"x"})
    compile_cache.save(["vllm-0.32-tp1-aaaa"], tmp_path / "a" / "shm", tmp_path / "a" / "disk", remote(bucket), 10**9)
    assert remote(bucket).promote("vllm-0.32-tp1-aaaa", "host-a")
    compile_cache.restore(["vllm-0.32-tp2-bbbb"], tmp_path / "b" / "shm", tmp_path / "b" / "disk", remote(bucket), None)
    assert list((tmp_path / "b" / "shm").iterdir()) == []


def test_an_unchanged_cache_is_not_uploaded_again(bucket, tmp_path):
    fill(tmp_path / "shm" / "k1", {"inductor/kernel.so": b"x" * 10})
    compile_cache.save(["k1"], tmp_path / "shm", tmp_path / "disk", remote(bucket), 10**9)
    generation = bucket.get_blob("compile-cache/hosts/host-a/k1.tar").generation
    compile_cache.save(["k1"], tmp_path / "shm", tmp_path / "disk", remote(bucket), 10**9)
    assert bucket.get_blob("compile-cache/hosts/host-a/k1.tar").generation == generation
    fill(tmp_path / "shm" / "k1", {"inductor/other.so": b"z"})
    compile_cache.save(["k1"], tmp_path / "shm", tmp_path / "disk", remote(bucket), 10**9)
    assert bucket.get_blob("compile-cache/hosts/host-a/k1.tar").generation != generation


def test_a_corrupted_cache_object_is_not_restored(bucket, gcs_emulator, tmp_path):
    fill(tmp_path / "a" / "shm" / "k1", {"inductor/kernel.so": b"x" * 4096})
    compile_cache.save(["k1"], tmp_path / "a" / "shm", tmp_path / "a" / "disk", remote(bucket), 10**9)
    assert remote(bucket).promote("k1", "host-a")
    backing = gcs_emulator.backing_file(bucket.name, "compile-cache/k1.tar")
    data = bytearray(backing.read_bytes())
    data[700] ^= 0xFF
    backing.write_bytes(bytes(data))
    compile_cache.restore(["k1"], tmp_path / "b" / "shm", tmp_path / "b" / "disk", remote(bucket, "host-b"), None)
    assert list((tmp_path / "b" / "shm").iterdir()) == [] and not (tmp_path / "b" / "disk" / "k1").exists()
