"""Where a replica's weights come from, as the plan decides it: hub, a local test model, the mirror (pull or stream)."""

from __future__ import annotations

import json

import pytest

from gemmaserve.plan import plan
from gemmaserve.spec import SpecError, parse_spec

REVISION = "0123456789abcdef0123456789abcdef01234567"


def plan_for(weights: dict | None = None, secret: dict | None = None, model: str = "31b"):
    data = {"model": model, "accelerator": {"kind": "rtx-pro-6000", "count": 2}}
    if weights is not None:
        data["weights"] = weights
    if secret is not None:
        data["secret"] = secret
    return plan(parse_spec(data)).require_ok()


def test_hub_by_default_with_the_token_and_no_local_copy():
    result = plan_for(secret={"secret_manager": "hf-token"})
    replica = result.replicas[0]
    assert result.weights.mode == "hub" and result.weights.local_dir is None
    assert replica.argv[2] == "google/gemma-4-31B-it" and "--revision" not in replica.argv
    assert replica.env["HF_TOKEN_PATH"].startswith("/run/credentials/") and "HF_HUB_OFFLINE" not in replica.env


def test_hub_with_a_pinned_revision_passes_it_to_vllm():
    argv = plan_for({"revision": REVISION}).replicas[0].argv
    assert argv[argv.index("--revision") + 1] == REVISION


def test_pull_serves_the_one_local_copy_offline_and_without_the_token():
    result = plan_for(
        {"source": "bucket", "bucket": "gs://acme-weights/team", "revision": REVISION},
        secret={"secret_manager": "hf-token"},
    )
    local = f"/var/lib/gemmaserve/weights/google/gemma-4-31B-it/{REVISION}"
    assert result.weights.local_dir == local
    assert result.weights.uri == f"gs://acme-weights/team/models/google/gemma-4-31B-it/{REVISION}/"
    assert result.weights.compile_cache_prefix == "team/compile-cache/"
    assert result.replicas
    for replica in result.replicas:  # every replica serves the same copy
        assert replica.argv[2:5] == [local, "--served-model-name", "google/gemma-4-31B-it"]
        assert replica.env["HF_HUB_OFFLINE"] == "1" and "HF_TOKEN_PATH" not in replica.env
    assert result.token_source_path is None
    assert any("no host needs the Hugging Face token" in w for w in result.warnings)


def test_stream_reads_the_bucket_with_the_runai_streamer():
    replica = plan_for(
        {"source": "bucket", "bucket": "gs://acme-weights", "revision": REVISION, "load": "stream"}
    ).replicas[0]
    assert replica.argv[2] == f"gs://acme-weights/models/google/gemma-4-31B-it/{REVISION}/"
    assert replica.argv[replica.argv.index("--load-format") + 1] == "runai_streamer"


def test_a_test_model_is_served_from_its_directory():
    result = plan(parse_spec({"model": "tiny", "accelerator": {"kind": "cpu"}})).require_ok()
    assert result.weights.mode == "local" and result.replicas[0].argv[2] == "/var/lib/gemmaserve/models/tiny-gemma4"


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ({"source": "bucket", "revision": REVISION}, "weights.bucket = None: required with source bucket"),
        ({"source": "bucket", "bucket": "gs://acme"}, "weights.revision = None: required with source bucket"),
        (
            {"source": "bucket", "bucket": "gs://acme", "revision": "main"},
            "weights.revision = 'main': must be a commit sha",
        ),
        (
            {"source": "bucket", "bucket": "s3://acme", "revision": REVISION},
            "weights.bucket = 's3://acme': allowed: gs://BUCKET",
        ),
        ({"source": "bucket", "bucket": "gs://Acme.Corp", "revision": REVISION}, "allowed: gs://BUCKET"),
        ({"load": "stream"}, "weights.load = 'stream': streams only from the bucket"),
        ({"source": "s3"}, "weights.source = 's3'"),
    ],
)
def test_bad_weights_input_names_field_value_and_what_is_allowed(weights, message):
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        plan_for(weights)


# --- LoRA adapters with the weights from the bucket ------------------------------------------------------------------

ADAPTER_CONFIG = '{"peft_type": "LORA", "r": 16, "target_modules": ["q_proj", "v_proj"]}\n'
ADAPTER_COMMIT = "a" * 40
TREE = "b" * 40  # a directory's content revision (`gemmaserve weights mirror --resolve --from-dir DIR`)


def adapter_spec(tmp_path, monkeypatch) -> dict:
    """A directory adapter and a hub adapter (its adapter_config.json in a local Hugging Face cache)."""
    import huggingface_hub.constants

    directory = tmp_path / "legal"
    directory.mkdir()
    (directory / "adapter_config.json").write_text(ADAPTER_CONFIG)
    snapshot = tmp_path / "hub" / "models--my-org--sql-lora" / "snapshots" / ADAPTER_COMMIT
    snapshot.mkdir(parents=True)
    (snapshot / "adapter_config.json").write_text(ADAPTER_CONFIG)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    adapters = [
        {"name": "sql", "source": "my-org/sql-lora", "revision": ADAPTER_COMMIT},
        {"name": "legal", "source": str(directory), "revision": TREE},
    ]
    return {
        "model": "31b",
        "accelerator": {"kind": "rtx-pro-6000", "count": 2},
        "weights": {"source": "bucket", "bucket": "gs://acme-weights/team", "revision": REVISION},
        "serving": {"lora_adapters": adapters},
    }


def test_adapters_come_from_the_bucket_beside_the_weights(tmp_path, monkeypatch):
    """Each pinned adapter has its folder in the mirror (adapters/<hub id or name>/<revision>/) and is served from
    the copy the weights role pulls to WEIGHTS_DIR/adapters/<same>/<revision>."""
    data = adapter_spec(tmp_path, monkeypatch)
    result = plan(parse_spec(data)).require_ok()
    sql, legal = result.weights.adapters
    assert sql.object_prefix == f"team/adapters/my-org/sql-lora/{ADAPTER_COMMIT}/"
    assert legal.object_prefix == f"team/adapters/legal/{TREE}/"
    assert legal.manifest_object == f"team/adapters/legal/{TREE}/gemmaserve-manifest.json"
    argv = result.replicas[0].argv
    modules = argv[argv.index("--lora-modules") + 1 : argv.index("--lora-modules") + 3]
    assert modules == [
        f"sql=/var/lib/gemmaserve/weights/adapters/my-org/sql-lora/{ADAPTER_COMMIT}",
        f"legal=/var/lib/gemmaserve/weights/adapters/legal/{TREE}",
    ]
    assert result.replicas[0].env["HF_HUB_OFFLINE"] == "1"
    data["weights"]["load"] = "stream"
    streamed = plan(parse_spec(data)).require_ok()
    assert streamed.weights.adapters == result.weights.adapters  # streamed weights: adapters still pulled


def test_an_adapter_from_the_bucket_must_be_pinned(tmp_path, monkeypatch):
    data = adapter_spec(tmp_path, monkeypatch)
    del data["serving"]["lora_adapters"][1]["revision"]
    result = plan(parse_spec(data))
    assert not result.ok and len(result.refusals) == 1
    assert result.refusals[0].startswith("serving.lora_adapters[1].revision: none given")
    assert f"gemmaserve weights mirror --resolve --from-dir {tmp_path / 'legal'}" in result.refusals[0]


def test_without_the_bucket_a_directory_adapter_is_served_where_it_is(tmp_path, monkeypatch):
    data = adapter_spec(tmp_path, monkeypatch)
    del data["weights"], data["serving"]["lora_adapters"][0]
    result = plan(parse_spec(data)).require_ok()
    assert result.weights.adapters == ()
    assert f"legal={tmp_path / 'legal'}" in result.replicas[0].argv


def test_mtp_with_weights_from_the_bucket_serves_the_mirrored_assistant():
    """vLLM downloads the MTP assistant by its hub id when it starts, which replicas serving the mirror cannot: the
    assistant is mirrored beside the model at a pinned commit, pulled first, and --speculative-config names the copy.
    Unpinned, it is refused naming the field and how to pin it."""
    data = {"model": "26b-a4b", "accelerator": {"kind": "h100-80gb"}, "workload": {"speculative": {"method": "mtp"}}}
    assert plan(parse_spec(data)).ok
    bucket = {"source": "bucket", "bucket": "gs://acme/w", "revision": REVISION}
    result = plan(parse_spec(data | {"weights": bucket}))
    assert not result.ok and result.refusals == [
        "weights.assistant_revision: none given; with weights from the bucket the MTP assistant "
        "google/gemma-4-26B-A4B-it-assistant is mirrored beside the model at a pinned commit (`gemmaserve weights "
        "mirror --resolve --model google/gemma-4-26B-A4B-it-assistant --revision main` prints it); allowed: a commit "
        "sha (40 hex)"
    ]
    pinned = "e" * 40
    result = plan(parse_spec(data | {"weights": bucket | {"assistant_revision": pinned}})).require_ok()
    assistant = result.weights.assistant
    assert assistant.object_prefix == f"w/models/google/gemma-4-26B-A4B-it-assistant/{pinned}/"
    assert assistant.local_dir == f"/var/lib/gemmaserve/weights/google/gemma-4-26B-A4B-it-assistant/{pinned}"
    argv = result.replicas[0].argv
    config = json.loads(argv[argv.index("--speculative-config") + 1])
    assert config == {"method": "mtp", "model": assistant.local_dir, "num_speculative_tokens": 4}
    # From the hub, a pinned assistant is vLLM's own download at that revision (SpeculativeConfig.revision).
    hub = plan(parse_spec(data | {"weights": {"assistant_revision": pinned}})).require_ok()
    argv = hub.replicas[0].argv
    config = json.loads(argv[argv.index("--speculative-config") + 1])
    assert config["model"] == "google/gemma-4-26B-A4B-it-assistant" and config["revision"] == pinned
    assert hub.weights.assistant is None
    with pytest.raises(SpecError, match="weights.assistant_revision"):
        parse_spec(data | {"weights": bucket | {"assistant_revision": "main"}})
