"""A checkpoint in Cloud Storage as the spec's model (gs://BUCKET/PATH): `gemmaserve plan --fetch` copies its small
files from a real GCS API emulator, the plan is the stock model's when the checkpoint is a fine-tune of it, and the
replicas stream it where it is; the stack grants its hosts read on that bucket."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gemmaserve.catalog import CATALOG
from gemmaserve.checkpoint import load_checkpoint
from gemmaserve.plan import plan
from gemmaserve.spec import SpecError, parse_spec

ROOT = Path(__file__).parents[2]
CONFIGS = ROOT / "tests" / "unit" / "checkpoints" / "configs"


@pytest.fixture(autouse=True)
def fresh_cache():
    load_checkpoint.cache_clear()
    yield
    load_checkpoint.cache_clear()


def upload_fine_tune(bucket, path: str) -> str:
    """A 31B fine-tune's config.json and weight index (the stock bytes) under gs://BUCKET/PATH."""
    bucket.blob(f"{path}/config.json").upload_from_string((CONFIGS / "gemma-4-31B-it.json").read_text())
    index = {"metadata": {"total_size": CATALOG.model("31b").checkpoint_bytes}, "weight_map": {}}
    bucket.blob(f"{path}/model.safetensors.index.json").upload_from_string(json.dumps(index))
    return f"gs://{bucket.name}/{path}"


def gemmaserve(cache: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "GEMMASERVE_GCS_CACHE": str(cache)}
    return subprocess.run(
        [sys.executable, "-m", "gemmaserve", *args], cwd=ROOT, capture_output=True, text=True, env=env, timeout=120
    )


def test_plan_fetches_a_bucket_checkpoint_and_streams_it_where_it_is(bucket, tmp_path):
    uri = upload_fine_tune(bucket, "tuned/support-31b")
    flags = ("plan", "--model", uri, "--accelerator", "h100-80gb", "--count", "2", "--json")
    offline = gemmaserve(tmp_path / "cache", *flags)
    assert offline.returncode == 2
    assert (
        f"config.json of {uri} is not in the local copy" in offline.stderr
        and "gemmaserve plan --fetch" in offline.stderr
    )
    fetched = gemmaserve(tmp_path / "cache", *flags, "--fetch")
    assert fetched.returncode == 0, fetched.stderr
    assert (
        f"fetch: {uri}/config.json" in fetched.stderr and f"fetch: {uri}/model.safetensors.index.json" in fetched.stderr
    )
    planned = json.loads(fetched.stdout)
    replica = planned["replicas"][0]
    assert replica["argv"][:5] == ["vllm", "serve", uri, "--served-model-name", "support-31b"]
    assert replica["argv"][5:7] == ["--load-format", "runai_streamer"]
    assert replica["env"]["HF_HUB_OFFLINE"] == "1"
    assert planned["engine"]["requirements"][0] == f"vllm[runai]=={planned['engine']['vllm_version']}"
    assert planned["weights"]["uri"] == uri
    # A fine-tune of 31B plans exactly like 31B.
    stock = json.loads(
        gemmaserve(
            tmp_path / "cache", "plan", "--model", "31b", "--accelerator", "h100-80gb", "--count", "2", "--json"
        ).stdout
    )
    assert replica["kv_cache_tokens"] == stock["replicas"][0]["kv_cache_tokens"]
    # Planned again with no network: the local copy is enough.
    again = gemmaserve(tmp_path / "cache", *flags)
    assert again.returncode == 0 and json.loads(again.stdout)["replicas"][0]["argv"] == replica["argv"]


def test_a_path_without_a_checkpoint_says_so(bucket, tmp_path):
    result = gemmaserve(
        tmp_path / "cache", "plan", "--model", f"gs://{bucket.name}/nothing", "--accelerator", "h100-80gb", "--fetch"
    )
    assert result.returncode == 2
    assert f"fetch: gs://{bucket.name}/nothing has no config.json" in result.stderr


def planned_offline(uri: str, tmp_path: Path, monkeypatch) -> str:
    """`uri`'s small files copied into a fresh planner copy (what `plan --fetch` leaves), for in-process planning."""
    import gemmaserve.checkpoint as checkpoint
    from gemmaserve.ops.weights import storage_client

    monkeypatch.setattr(checkpoint, "GCS_CACHE", tmp_path / "cache")
    bucket_name, _, path = uri.removeprefix("gs://").partition("/")
    cache = checkpoint.gcs_cache_dir(uri)
    cache.mkdir(parents=True)
    for name in ("config.json", "model.safetensors.index.json"):
        (cache / name).write_bytes(storage_client().bucket(bucket_name).blob(f"{path}/{name}").download_as_bytes())
    return uri


def test_what_a_bucket_checkpoint_cannot_be_given_is_named(bucket, tmp_path, monkeypatch):
    uri = planned_offline(upload_fine_tune(bucket, "tuned/x"), tmp_path, monkeypatch)
    base = {"model": uri, "accelerator": {"kind": "h100-80gb"}}
    assert parse_spec(base).model == uri
    cases = [
        ({"weights": {"source": "bucket", "bucket": "gs://acme", "revision": "a" * 40}}, "weights = "),
        ({"weights": {"load": "pull"}}, "weights.load = 'pull': a gs:// model is always streamed"),
    ]
    for extra, expected in cases:
        with pytest.raises(SpecError) as caught:
            parse_spec(base | extra)
        assert any(expected in p for p in caught.value.problems), caught.value.problems
    with pytest.raises(SpecError, match="gs://BUCKET/PATH"):
        parse_spec(base | {"model": "gs://Bad_Bucket/x"})
    # MTP: streaming replicas run offline, so the assistant must be pinned (the weights role downloads it), and only
    # the wheel engine's weights role does that.
    mtp = base | {"accelerator": {"kind": "h100-80gb", "count": 2}, "workload": {"speculative": {"method": "mtp"}}}
    unpinned = plan(parse_spec(mtp))
    assert unpinned.refusals == [
        "weights.assistant_revision: none given; replicas serving a gs:// model run offline (HF_HUB_OFFLINE=1), so "
        "vLLM cannot download the MTP assistant google/gemma-4-31B-it-assistant: the weights role downloads it before "
        "the replicas start, at a pinned commit (`gemmaserve weights mirror --resolve --model "
        "google/gemma-4-31B-it-assistant --revision main` prints it); allowed: a commit sha (40 hex)"
    ]
    pinned = mtp | {"weights": {"assistant_revision": "e" * 40}}
    streamed = plan(parse_spec(pinned)).require_ok()
    assert streamed.weights.hub_assistant == ("google/gemma-4-31B-it-assistant", "e" * 40)
    assert streamed.to_json()["weights"]["hub_snapshots"] == [
        {"repo": "google/gemma-4-31B-it-assistant", "revision": "e" * 40}
    ]
    argv = streamed.replicas[0].argv
    assert json.loads(argv[argv.index("--speculative-config") + 1])["model"] == (
        f"/var/lib/gemmaserve/hf/hub/models--google--gemma-4-31B-it-assistant/snapshots/{'e' * 40}"
    )
    boxed = plan(parse_spec(pinned | {"engine": {"kind": "container"}}))
    assert len(boxed.refusals) == 1 and boxed.refusals[0].startswith("engine.kind = 'container'")


def test_the_stack_grants_its_hosts_read_on_the_models_bucket(bucket, tmp_path, monkeypatch):
    """The Pulumi program under mocks: a non-authoritative objectViewer member on the model's bucket for the hosts'
    service account, and no mirror bucket."""
    from tests.infra.conftest import run_program, stack_config

    uri = planned_offline(upload_fine_tune(bucket, "tuned/y"), tmp_path, monkeypatch)
    config = stack_config("h100")
    config["gemmaserve:model"] = uri
    config["gemmaserve:workload"] = {
        k: v for k, v in (config.get("gemmaserve:workload") or {}).items() if k != "speculative"
    }
    config.pop("gemmaserve:weights", None)
    run = run_program("h100", config)
    members = [r.inputs for r in run.resources if r.type == "gcp:storage/bucketIAMMember:BucketIAMMember"]
    read = [m for m in members if m["bucket"] == bucket.name]
    assert [m["role"] for m in read] == ["roles/storage.objectViewer"]
    assert read[0]["member"].startswith("serviceAccount:")
    assert "gcp:storage/bucket:Bucket" not in run.types
