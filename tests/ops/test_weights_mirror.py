"""`gemmaserve weights mirror` against a real GCS API emulator, from a local source in the hub's shape."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from gemmaserve.ops.weights import LocalSource, MirrorError, git_blob_sha1, mirror, mirror_adapters, read_manifest
from gemmaserve.plan import AdapterWeights, WeightsPlan


def plan_for(bucket_name: str, revision: str, prefix: str = "team/") -> WeightsPlan:
    return WeightsPlan("pull", "org/test-model", revision, bucket_name, prefix)


def in_stack_project(tmp_path: Path, monkeypatch, config: dict) -> Path:
    """A project directory holding stack x (Pulumi.x.yaml with `config`), made the working directory."""
    import yaml

    project = tmp_path / "project"
    project.mkdir(exist_ok=True)
    (project / "Pulumi.x.yaml").write_text(yaml.safe_dump({"config": config}))
    monkeypatch.chdir(project)
    return project


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


# --- LoRA adapters beside the model, and the checkpoints users bring --------------------------------------------------


def adapter_dir(root, extra: dict[str, bytes] | None = None):
    """A PEFT adapter as its trainer saves it: adapter_config.json, adapter_model.safetensors and a README."""
    root.mkdir(parents=True)
    (root / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8, "target_modules": ["q_proj"]}\n')
    (root / "adapter_model.safetensors").write_bytes(os.urandom(2 * 2**20 + 3))
    (root / "README.md").write_text("# an adapter\n")
    for name, data in (extra or {}).items():
        (root / name).write_bytes(data)
    return root


def adapter_weights(bucket_name: str, adapters: list[AdapterWeights], prefix: str = "team/") -> WeightsPlan:
    return WeightsPlan("pull", "org/test-model", "0" * 40, bucket_name, prefix, tuple(adapters))


def test_adapters_mirror_beside_the_model_then_a_second_run_copies_nothing(bucket, tmp_path):
    """A directory adapter at its content revision and a hub one at its commit (read here from a directory in the
    hub's shape), each under adapters/<id>/<revision>/ with its own manifest, the layout the hosts pull."""
    legal = LocalSource(adapter_dir(tmp_path / "legal"))
    sql = LocalSource(adapter_dir(tmp_path / "sql"))
    weights = adapter_weights(
        bucket.name,
        [
            AdapterWeights("legal", str(legal.directory), legal.resolve(None), "team/"),
            AdapterWeights("sql", "my-org/sql-lora", sql.resolve(None), "team/"),
        ],
    )
    lines: list[str] = []
    first = mirror_adapters(weights, sources={"sql": sql}, progress=lines.append)
    expected = {"adapter_config.json", "adapter_model.safetensors", "README.md"}
    for adapter, report in zip(weights.adapters, first, strict=True):
        assert set(report.copied) == expected and report.manifest_written
        assert report.uri == f"gs://{bucket.name}/{adapter.object_prefix}"
        stored = {b.name for b in bucket.list_blobs(prefix=adapter.object_prefix)}
        assert stored == {adapter.object_prefix + p for p in expected} | {adapter.manifest_object}
        manifest = read_manifest(weights, adapter=adapter)
        assert manifest["adapter"] == adapter.name and manifest["source"] == adapter.source
        assert manifest["revision"] == adapter.revision and {e["path"] for e in manifest["files"]} == expected
    assert weights.adapters[1].object_prefix == f"team/adapters/my-org/sql-lora/{sql.resolve(None)}/"
    assert any("adapter_model.safetensors: copied" in line for line in lines)  # progress, file by file
    again = mirror_adapters(weights, sources={"sql": sql}, progress=lambda _: None)
    assert [r.copied for r in again] == [[], []] and not any(r.manifest_written for r in again)


def test_a_directory_that_is_not_an_adapter_is_refused_before_any_upload(bucket, tmp_path):
    root = tmp_path / "half"
    root.mkdir()
    (root / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}\n')
    source = LocalSource(root)
    adapter = AdapterWeights("half", str(root), source.resolve(None))
    with pytest.raises(MirrorError, match=r"adapter half .*has no adapter_model.safetensors or adapter_model.bin"):
        mirror_adapters(adapter_weights(bucket.name, [adapter], ""), progress=lambda _: None)
    assert list(bucket.list_blobs()) == []


def test_an_adapter_directory_changed_since_its_revision_was_pinned_is_refused(bucket, tmp_path):
    root = adapter_dir(tmp_path / "legal")
    pinned = LocalSource(root).resolve(None)
    (root / "adapter_model.safetensors").write_bytes(os.urandom(1024))  # retrained since
    adapter = AdapterWeights("legal", str(root), pinned)
    with pytest.raises(MirrorError, match=f"revision {pinned} is not .*content"):
        mirror_adapters(adapter_weights(bucket.name, [adapter]), progress=lambda _: None)
    assert list(bucket.list_blobs()) == []


def test_a_quantized_checkpoint_mirrors_every_file_it_ships(bucket, tmp_path):
    """What vLLM reads besides the weights (quantization_config in config.json, ModelOpt's hf_quant_config.json,
    the recipe, the chat template) is copied like the weights: the mirror keeps every file but .gitattributes and
    original/."""
    root = tmp_path / "nvfp4"
    root.mkdir()
    files = {
        "config.json": b'{"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}}\n',
        "hf_quant_config.json": b'{"quantization": {"quant_algo": "NVFP4"}}\n',
        "recipe.yaml": b"quant_stage: {}\n",
        "chat_template.jinja": b"{{ messages }}\n",
        "model-00001-of-00001.safetensors": os.urandom(2**20),
        "model.safetensors.index.json": b'{"metadata": {"total_size": 1048576}, "weight_map": {}}\n',
        "original/model.bin": os.urandom(1024),
        ".gitattributes": b"*.safetensors filter=lfs\n",
    }
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    source = LocalSource(root)
    report = mirror(plan_for(bucket.name, source.resolve(None)), source, progress=lambda _: None)
    assert set(report.copied) == set(files) - {"original/model.bin", ".gitattributes"}


def test_the_cli_mirrors_the_stacks_adapters_after_the_model(gcs_emulator, bucket, model_dir, tmp_path, monkeypatch):
    """`gemmaserve weights mirror --stack NAME`: the model, then each adapter the stack's spec names; a directory's
    revision is what `--resolve --from-dir` prints."""
    from typer.testing import CliRunner

    from gemmaserve.ops.cli import app

    runner = CliRunner()
    legal = adapter_dir(tmp_path / "legal")
    resolved = runner.invoke(app, ["weights", "mirror", "--resolve", "--from-dir", str(legal)])
    assert resolved.exit_code == 0, resolved.output
    tree = resolved.output.strip()
    assert tree == LocalSource(legal).resolve(None)
    revision = LocalSource(model_dir).resolve(None)
    config = {
        "gemmaserve:model": "tiny",
        "gemmaserve:accelerator": {"kind": "cpu"},
        "gemmaserve:weights": {"source": "bucket", "bucket": f"gs://{bucket.name}/team", "revision": revision},
        "gemmaserve:serving": {"lora_adapters": [{"name": "legal", "source": str(legal), "revision": tree}]},
    }
    in_stack_project(tmp_path, monkeypatch, config)
    result = runner.invoke(app, ["weights", "mirror", "--stack", "x", "--from-dir", str(model_dir)])
    assert result.exit_code == 0, result.output
    assert f"mirroring adapter legal ({legal})@{tree[:12]}: 3 files" in result.output
    prefix = f"team/adapters/legal/{tree}/"
    assert {b.name for b in bucket.list_blobs(prefix=prefix)} == {
        prefix + name for name in ("adapter_config.json", "adapter_model.safetensors", "README.md")
    } | {prefix + "gemmaserve-manifest.json"}
    assert bucket.get_blob(f"team/models/gemmaserve/tiny-gemma4-test/{revision}/gemmaserve-manifest.json")


class FakeHub:
    """huggingface_hub as the mirror and `weights mirror`'s small-file fetch use it, served from directories in the
    hub's shape (one commit each): HfApi.model_info with the files' metadata, and hf_hub_download."""

    def __init__(self, repos: dict, cache):
        self.repos, self.cache, self.downloads = {r: LocalSource(d) for r, d in repos.items()}, cache, []

    def api(self, token=None):
        hub = self

        class Api:
            def model_info(self, repo_id, revision=None, files_metadata=False):
                import types

                source = hub.repos[repo_id]
                sha = source.resolve(revision)
                siblings = [
                    types.SimpleNamespace(
                        rfilename=f.path,
                        size=f.size,
                        blob_id=f.git_sha1,
                        lfs=types.SimpleNamespace(sha256=f.sha256) if f.sha256 else None,
                    )
                    for f in source._scan()
                ] + [types.SimpleNamespace(rfilename=".gitattributes", size=1, blob_id="0", lfs=None)]
                return types.SimpleNamespace(sha=sha, siblings=siblings)

        return Api()

    def download(self, repo_id, filename, revision=None, local_dir=None, token=None, **_):
        import shutil

        self.downloads.append((repo_id, filename))
        source = self.repos[repo_id]
        commit = source.resolve(revision)
        target = (
            Path(local_dir) / filename
            if local_dir
            else self.cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / commit / filename
        )
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source.directory / filename, target)
        if not local_dir:
            (target.parent.parent.parent / "refs").mkdir(exist_ok=True)
            (target.parent.parent.parent / "refs" / "main").write_text(commit)
        return str(target)


def test_a_quantized_hub_checkpoint_and_a_hub_adapter_mirror_by_id(bucket, tmp_path, monkeypatch):
    """`gemmaserve weights mirror --model OWNER/NAME`: the spec's small files are fetched first (a checkpoint not in
    the catalog is planned from them), then every file of the checkpoint and of the pinned hub adapter is copied,
    .gitattributes aside."""
    import json

    import huggingface_hub
    import huggingface_hub.constants
    from typer.testing import CliRunner

    from gemmaserve.ops.cli import app

    configs = Path(__file__).parents[1] / "unit" / "checkpoints"
    config = json.loads((configs / "configs" / "gemma-4-31B-it.json").read_text())
    config["quantization_config"] = json.loads((configs / "quantization" / "ct-fp8-dynamic.json").read_text())
    checkpoint = tmp_path / "fp8"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps(config))
    (checkpoint / "model.safetensors.index.json").write_text('{"metadata": {"total_size": 2048}, "weight_map": {}}')
    (checkpoint / "model-00001-of-00001.safetensors").write_bytes(os.urandom(2048))
    (checkpoint / "recipe.yaml").write_text("quant_stage: {}\n")
    adapter = adapter_dir(tmp_path / "sql")
    (adapter / "adapter_config.json").write_text((configs / "adapters" / "gemma4-31b-lora-r16.json").read_text())
    hub = FakeHub({"my-org/gemma4-31b-fp8": checkpoint, "my-org/sql-lora": adapter}, tmp_path / "hf" / "hub")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub.cache))
    monkeypatch.setattr(huggingface_hub, "HfApi", hub.api)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hub.download)
    model_sha, adapter_sha = LocalSource(checkpoint).resolve(None), LocalSource(adapter).resolve(None)
    config = {
        "gemmaserve:model": "my-org/gemma4-31b-fp8",
        "gemmaserve:accelerator": {"kind": "h100-80gb"},
        "gemmaserve:weights": {"source": "bucket", "bucket": f"gs://{bucket.name}", "revision": model_sha},
        "gemmaserve:serving": {
            "lora_adapters": [{"name": "sql", "source": "my-org/sql-lora", "revision": adapter_sha}]
        },
    }
    in_stack_project(tmp_path, monkeypatch, config)
    result = CliRunner().invoke(app, ["weights", "mirror", "--stack", "x"])
    assert result.exit_code == 0, result.output
    assert "fetch: my-org/sql-lora adapter_config.json" in result.output
    assert hub.downloads[:3] == [
        ("my-org/gemma4-31b-fp8", "config.json"),
        ("my-org/gemma4-31b-fp8", "model.safetensors.index.json"),
        ("my-org/sql-lora", "adapter_config.json"),
    ]
    model_prefix = f"models/my-org/gemma4-31b-fp8/{model_sha}/"
    assert {b.name for b in bucket.list_blobs(prefix=model_prefix)} == {
        model_prefix + name
        for name in (
            "config.json",
            "model.safetensors.index.json",
            "model-00001-of-00001.safetensors",
            "recipe.yaml",
            "gemmaserve-manifest.json",
        )
    }
    adapter_prefix = f"adapters/my-org/sql-lora/{adapter_sha}/"
    assert {b.name for b in bucket.list_blobs(prefix=adapter_prefix)} == {
        adapter_prefix + name
        for name in ("adapter_config.json", "adapter_model.safetensors", "README.md", "gemmaserve-manifest.json")
    }


def test_the_cli_mirrors_the_mtp_assistant_beside_the_model_at_its_pin(bucket, tmp_path, monkeypatch):
    """A stack serving MTP from the bucket: `gemmaserve weights mirror --stack` copies the assistant at
    weights.assistant_revision into models/<assistant id>/<commit>/ with its manifest, where the plan's pull and
    --speculative-config look for it; a pin the hub does not hold is an error naming it."""
    import json

    import huggingface_hub
    from typer.testing import CliRunner

    from gemmaserve.ops.cli import app
    from gemmaserve.plan import plan
    from gemmaserve.sources import load_stack_spec

    configs = Path(__file__).parents[1] / "unit" / "checkpoints" / "configs"
    repos = {}
    for repo in ("google/gemma-4-31B-it", "google/gemma-4-31B-it-assistant"):
        directory = tmp_path / repo.split("/")[1]
        directory.mkdir()
        (directory / "config.json").write_text((configs / "gemma-4-31B-it.json").read_text())
        (directory / "model.safetensors").write_bytes(os.urandom(1024))
        repos[repo] = directory
    hub = FakeHub(repos, tmp_path / "hf" / "hub")
    monkeypatch.setattr(huggingface_hub, "HfApi", hub.api)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hub.download)
    model_sha = LocalSource(repos["google/gemma-4-31B-it"]).resolve(None)
    assistant_sha = LocalSource(repos["google/gemma-4-31B-it-assistant"]).resolve(None)
    weights = {"source": "bucket", "bucket": f"gs://{bucket.name}/team", "revision": model_sha}
    config = {
        "gemmaserve:model": "31b",
        "gemmaserve:accelerator": {"kind": "h100-80gb", "count": 2},
        "gemmaserve:weights": weights | {"assistant_revision": assistant_sha},
        "gemmaserve:workload": {"speculative": {"method": "mtp"}},
    }
    project = in_stack_project(tmp_path, monkeypatch, config)
    result = CliRunner().invoke(app, ["weights", "mirror", "--stack", "x"])
    assert result.exit_code == 0, result.output
    assert f"mirroring MTP assistant google/gemma-4-31B-it-assistant@{assistant_sha[:12]}" in result.output
    served = plan(load_stack_spec("x", project)).require_ok()
    assistant = served.weights.assistant
    assert {b.name for b in bucket.list_blobs(prefix=assistant.object_prefix)} == {
        assistant.object_prefix + name for name in ("config.json", "model.safetensors", "gemmaserve-manifest.json")
    }
    assert json.loads(bucket.get_blob(assistant.manifest_object).download_as_text())["revision"] == assistant_sha
    argv = served.replicas[0].argv
    assert json.loads(argv[argv.index("--speculative-config") + 1])["model"] == assistant.local_dir
    # A pin the hub does not hold: nothing of the assistant is copied, and the error names the pin.
    config["gemmaserve:weights"] = weights | {"assistant_revision": "f" * 40}
    in_stack_project(tmp_path, monkeypatch, config)
    result = CliRunner().invoke(app, ["weights", "mirror", "--stack", "x"])
    assert result.exit_code == 1 and "f" * 40 in result.output
    assert not list(bucket.list_blobs(prefix=f"team/models/google/gemma-4-31B-it-assistant/{'f' * 40}/"))
