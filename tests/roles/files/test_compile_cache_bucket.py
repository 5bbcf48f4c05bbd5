"""Compile caches carried between hosts through a bucket (a real GCS API emulator), keyed by the plan's key."""

from __future__ import annotations

from tests.roles.files.programs import load

compile_cache = load("caches", "compile_cache")
gcs_json = __import__("gcs_json")


def fill(root, files):
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)


def remote(bucket):
    return compile_cache.Remote(gcs_json.Bucket(bucket.name), "compile-cache/")


def test_a_second_host_restores_the_first_hosts_cache(bucket, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    fill(first / "shm" / "k1", {"inductor/ab/kernel.so": b"\x7fELF" * 100, "vllm/torch_compile_cache/x": b"y"})
    compile_cache.save(["k1"], first / "shm", first / "disk", remote(bucket), 10**9)
    assert bucket.get_blob("compile-cache/k1.tar") is not None
    compile_cache.restore(["k1"], second / "shm", second / "disk", remote(bucket), None)
    assert (second / "shm" / "k1" / "inductor/ab/kernel.so").read_bytes() == b"\x7fELF" * 100
    assert compile_cache.tree_digest(second / "shm" / "k1") == compile_cache.tree_digest(first / "disk" / "k1")


def test_another_key_never_restores_this_cache(bucket, tmp_path):
    fill(tmp_path / "a" / "shm" / "vllm-0.32-tp1-aaaa", {"inductor/kernel.so": b"x"})
    compile_cache.save(["vllm-0.32-tp1-aaaa"], tmp_path / "a" / "shm", tmp_path / "a" / "disk", remote(bucket), 10**9)
    compile_cache.restore(["vllm-0.32-tp2-bbbb"], tmp_path / "b" / "shm", tmp_path / "b" / "disk", remote(bucket), None)
    assert list((tmp_path / "b" / "shm").iterdir()) == []


def test_an_unchanged_cache_is_not_uploaded_again(bucket, tmp_path):
    fill(tmp_path / "shm" / "k1", {"inductor/kernel.so": b"x" * 10})
    compile_cache.save(["k1"], tmp_path / "shm", tmp_path / "disk", remote(bucket), 10**9)
    generation = bucket.get_blob("compile-cache/k1.tar").generation
    compile_cache.save(["k1"], tmp_path / "shm", tmp_path / "disk", remote(bucket), 10**9)
    assert bucket.get_blob("compile-cache/k1.tar").generation == generation
    fill(tmp_path / "shm" / "k1", {"inductor/other.so": b"z"})
    compile_cache.save(["k1"], tmp_path / "shm", tmp_path / "disk", remote(bucket), 10**9)
    assert bucket.get_blob("compile-cache/k1.tar").generation != generation


def test_a_corrupted_cache_object_is_not_restored(bucket, gcs_emulator, tmp_path):
    fill(tmp_path / "a" / "shm" / "k1", {"inductor/kernel.so": b"x" * 4096})
    compile_cache.save(["k1"], tmp_path / "a" / "shm", tmp_path / "a" / "disk", remote(bucket), 10**9)
    backing = gcs_emulator.backing_file(bucket.name, "k1.tar")
    data = bytearray(backing.read_bytes())
    data[700] ^= 0xFF
    backing.write_bytes(bytes(data))
    compile_cache.restore(["k1"], tmp_path / "b" / "shm", tmp_path / "b" / "disk", remote(bucket), None)
    assert list((tmp_path / "b" / "shm").iterdir()) == [] and not (tmp_path / "b" / "disk" / "k1").exists()
