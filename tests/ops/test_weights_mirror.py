"""`gemmaserve weights mirror` against a real GCS API emulator, from a local source in the hub's shape."""

from __future__ import annotations

import hashlib

import pytest

from gemmaserve.ops.weights import LocalSource, MirrorError, git_blob_sha1, mirror, read_manifest
from gemmaserve.plan import WeightsPlan


def plan_for(bucket_name: str, revision: str, prefix: str = "team/") -> WeightsPlan:
    return WeightsPlan("pull", "org/test-model", revision, bucket_name, prefix)


def test_git_blob_sha1_is_gits_object_id(tmp_path):
    # `printf 'hello\n' | git hash-object --stdin` = ce013625030ba8dba906f756967f9e9ca394464a
    (tmp_path / "f").write_bytes(b"hello\n")
    assert git_blob_sha1(tmp_path / "f") == "ce013625030ba8dba906f756967f9e9ca394464a"


def test_local_source_serves_the_hubs_shape(model_dir):
    source = LocalSource(model_dir)
    revision = source.resolve(None)
    files = {f.path: f for f in source.files(revision)}
    assert ".gitattributes" not in files
    weights = files["model-00002-of-00002.safetensors"]
    assert weights.sha256 == hashlib.sha256((model_dir / weights.path).read_bytes()).hexdigest()
    assert files["config.json"].sha256 is None  # small files are plain git blobs on the hub
    with pytest.raises(MirrorError, match="is not .*content"):
        source.resolve("0" * 40)


def test_mirror_copies_then_a_second_run_copies_nothing(bucket, model_dir):
    source = LocalSource(model_dir)
    weights = plan_for(bucket.name, source.resolve(None))
    first = mirror(weights, source, progress=lambda _: None)
    assert sorted(first.copied) == sorted(f.path for f in source.files(weights.revision)) and first.manifest_written
    stored = {b.name: b for b in bucket.list_blobs(prefix=weights.object_prefix)}
    assert set(stored) == {weights.object_prefix + p for p in first.copied} | {weights.manifest_object}
    generations = {name: b.generation for name, b in stored.items()}
    second = mirror(weights, source, progress=lambda _: None)
    assert second.copied == [] and not second.manifest_written and second.bytes_copied == 0
    assert {b.name: b.generation for b in bucket.list_blobs(prefix=weights.object_prefix)} == generations
    manifest = read_manifest(weights)
    assert manifest["revision"] == weights.revision
    entry = next(e for e in manifest["files"] if e["path"].endswith("00002-of-00002.safetensors"))
    assert entry["generation"] == stored[weights.object_prefix + entry["path"]].generation
    assert entry["md5"] == stored[weights.object_prefix + entry["path"]].md5_hash


def test_an_interrupted_mirror_resumes_with_the_missing_files(bucket, model_dir):
    source = LocalSource(model_dir)
    weights = plan_for(bucket.name, source.resolve(None))
    mirror(weights, source, progress=lambda _: None)
    # As if the run stopped after the first files: one weight file and the manifest never arrived.
    bucket.blob(weights.object_prefix + "model-00001-of-00002.safetensors").delete()
    bucket.blob(weights.manifest_object).delete()
    again = mirror(weights, source, progress=lambda _: None)
    assert again.copied == ["model-00001-of-00002.safetensors"] and again.manifest_written


def test_a_source_file_that_does_not_match_its_hash_is_never_uploaded(bucket, model_dir, tmp_path):
    import shutil

    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    source = LocalSource(copy)
    weights = plan_for(bucket.name, source.resolve(None))
    source.files(weights.revision)  # hashes recorded, as the hub lists them
    (copy / "config.json").write_text('{"tampered": true}\n')
    with pytest.raises(MirrorError, match="config.json: the downloaded bytes do not match"):
        mirror(weights, source, progress=lambda _: None)
    assert bucket.get_blob(weights.object_prefix + "config.json") is None
    assert bucket.get_blob(weights.manifest_object) is None


def test_a_missing_bucket_is_a_clear_error(gcs_emulator, model_dir):
    source = LocalSource(model_dir)
    with pytest.raises(MirrorError, match="gs://no-such-bucket: no such bucket"):
        mirror(plan_for("no-such-bucket", source.resolve(None)), source, progress=lambda _: None)


def test_the_sandbox_mirror_fills_the_bucket_its_host_data_names(gcs_emulator, model_dir):
    """The demo's and the sandbox tests' mirror (gemmaserve.sandbox.demo): the host data it returns plans the
    objects it wrote, a second run copies nothing, and it leaves the process environment alone."""
    import os

    from gemmaserve.ops.weights import storage_client
    from gemmaserve.plan import plan
    from gemmaserve.sandbox.demo import mirror_test_model
    from gemmaserve.sandbox.profile import SANDBOX_BUCKET, sandbox_host_data
    from gemmaserve.sources import spec_from_host_data

    environ = dict(os.environ)
    client = storage_client()
    data, first = mirror_test_model(client, model_dir, progress=lambda _: None)
    assert dict(os.environ) == environ
    assert data["gemmaserve_weights"]["revision"] == LocalSource(model_dir).resolve(None) == first.revision
    weights = plan(spec_from_host_data({**sandbox_host_data(), **data})).require_ok().weights
    assert first.manifest_written and first.uri == f"gs://{SANDBOX_BUCKET}/{weights.object_prefix}"
    stored = {b.name for b in client.bucket(SANDBOX_BUCKET).list_blobs(prefix=weights.object_prefix)}
    assert stored == {weights.object_prefix + p for p in first.copied} | {weights.manifest_object}
    again_data, again = mirror_test_model(client, model_dir, progress=lambda _: None)
    assert again_data == data and again.copied == [] and not again.manifest_written
