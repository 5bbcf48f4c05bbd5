"""The host's puller (roles/weights/files/weights_pull.py, stdlib only) against a real GCS API emulator."""

from __future__ import annotations

import pytest

from gemmaserve.ops.weights import LocalSource, mirror
from gemmaserve.plan import WeightsPlan
from roles._lib.programs import load_program

weights_pull = load_program("weights", "weights_pull")
gcs_json = __import__("gcs_json")  # the shared client the puller imported beside itself


@pytest.fixture
def mirrored(bucket, model_dir):
    source = LocalSource(model_dir)
    weights = WeightsPlan("pull", "org/test-model", source.resolve(None), bucket.name, "")
    mirror(weights, source, progress=lambda _: None)
    return weights, gcs_json.Bucket(bucket.name)


def test_pull_verifies_and_shares_one_copy(mirrored, model_dir, tmp_path, monkeypatch):
    weights, remote = mirrored
    monkeypatch.setattr(weights_pull, "PIECE", 2**20)  # several ranged reads per file, in parallel
    dest = tmp_path / "weights" / weights.revision
    result = weights_pull.pull(remote, weights.object_prefix, dest, parallel=4)
    assert result["files"] == 4
    for name in ("model-00002-of-00002.safetensors", "config.json", "tokenizer.json"):
        assert (dest / name).read_bytes() == (model_dir / name).read_bytes()
    assert (dest / weights_pull.COMPLETE).is_file() and not dest.with_name(dest.name + ".partial").exists()
    # Already local: nothing is fetched again.
    assert weights_pull.pull(remote, weights.object_prefix, dest)["bytes"] == 0


def test_an_interrupted_pull_resumes_without_fetching_verified_files(mirrored, tmp_path):
    weights, remote = mirrored
    dest = tmp_path / "w"
    weights_pull.pull(remote, weights.object_prefix, dest)
    (dest / weights_pull.COMPLETE).unlink()
    dest.rename(dest.with_name("w.partial"))  # as if stopped after every file landed, before the rename
    (dest.with_name("w.partial") / "tokenizer.json").unlink()
    again = weights_pull.pull(remote, weights.object_prefix, dest)
    assert again["files"] == 1 and again["bytes"] == len('{"version": "1.0"}\n')


def test_a_replaced_object_is_refused(mirrored, bucket, tmp_path):
    weights, remote = mirrored
    name = weights.object_prefix + "model-00001-of-00002.safetensors"
    data = bytearray(bucket.get_blob(name).download_as_bytes())
    data[1000] ^= 0xFF
    bucket.blob(name).upload_from_string(bytes(data))  # a new generation: not what was mirrored
    with pytest.raises(weights_pull.PullError, match="changed since it was mirrored"):
        weights_pull.pull(remote, weights.object_prefix, tmp_path / "w")
    assert not (tmp_path / "w").exists()


def test_corrupted_bytes_under_the_same_generation_fail_the_hash_check(mirrored, gcs_emulator, bucket, tmp_path):
    weights, remote = mirrored
    dest = tmp_path / "w"
    weights_pull.pull(remote, weights.object_prefix, dest)
    (dest / weights_pull.COMPLETE).unlink()  # a stale copy: the pull must fetch again and must keep this one
    backing = gcs_emulator.backing_file(bucket.name, "model-00001-of-00002.safetensors")
    with open(backing, "r+b") as handle:  # bit rot in the emulator's store: same size, same generation
        handle.seek(1000)
        byte = handle.read(1)
        handle.seek(1000)
        handle.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(weights_pull.PullError, match=r"is corrupt: sha256 .* expected .*the hub's hash"):
        weights_pull.pull(remote, weights.object_prefix, dest)
    assert (dest / "config.json").is_file()  # the old copy is still there; nothing was replaced


def test_a_revision_not_in_the_mirror(mirrored):
    weights, remote = mirrored
    other = weights.object_prefix.replace(weights.revision, "f" * 40)
    with pytest.raises(weights_pull.PullError, match="this revision is not in the mirror"):
        weights_pull.check(remote, other)


def test_a_missing_bucket(gcs_emulator):
    with pytest.raises(weights_pull.PullError, match="gs://nowhere: no such bucket"):
        weights_pull.check(gcs_json.Bucket("nowhere"), "models/x/")


def test_check_names_the_revision(mirrored, capsys):
    weights, remote = mirrored
    code = weights_pull.main(
        ["check", "--bucket", remote.name, "--prefix", weights.object_prefix, "--dest", "/nonexistent"]
    )
    assert code == 0 and weights.revision in capsys.readouterr().err


def test_one_run_pulls_the_adapters_and_the_model_each_to_its_folder(mirrored, bucket, tmp_path, capsys):
    """The weights unit's command: `pull` with a --prefix/--dest pair per mirrored revision, in order; `check`
    with every prefix."""
    from gemmaserve.ops.weights import mirror_adapters
    from gemmaserve.plan import AdapterWeights

    weights, remote = mirrored
    legal = tmp_path / "legal"
    legal.mkdir()
    (legal / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}\n')
    (legal / "adapter_model.safetensors").write_bytes(b"\0" * 4096)
    adapter = AdapterWeights("legal", str(legal), LocalSource(legal).resolve(None))
    mirror_adapters(WeightsPlan("pull", "org/test-model", "0" * 40, bucket.name, "", (adapter,)), progress=print)
    pairs = [(adapter.object_prefix, tmp_path / "local" / "legal"), (weights.object_prefix, tmp_path / "local" / "m")]
    prefixes = [arg for prefix, _ in pairs for arg in ("--prefix", prefix)]
    assert weights_pull.main(["check", "--bucket", remote.name, *prefixes]) == 0
    assert adapter.revision in capsys.readouterr().err
    each = [arg for prefix, dest in pairs for arg in ("--prefix", prefix, "--dest", str(dest))]
    assert weights_pull.main(["pull", "--bucket", remote.name, *each]) == 0
    adapter_copy, model_copy = (dest for _, dest in pairs)
    assert (adapter_copy / "adapter_model.safetensors").read_bytes() == b"\0" * 4096
    assert (adapter_copy / weights_pull.COMPLETE).is_file() and (model_copy / weights_pull.COMPLETE).is_file()
    with pytest.raises(SystemExit):  # a --dest short: refused before anything is fetched
        weights_pull.main(["pull", "--bucket", remote.name, *prefixes, "--dest", str(tmp_path / "x")])
