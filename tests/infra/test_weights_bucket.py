"""The weights bucket under Pulumi's mocks, and what leaves our code checked against Google's own schemas
(the Cloud Storage v1 discovery document shipped in google-api-python-client)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jsonschema
import pytest

from roles._lib.programs import load_program
from tests.infra.conftest import PROJECT, run_program, stack_config

BUCKET = "gemmaserve-test-weights"
REVISION = "0123456789abcdef0123456789abcdef01234567"


def bucket_config(**cloud) -> dict:
    config = stack_config("gpu8")
    config["gemmaserve:weights"] = {"source": "bucket", "bucket": f"gs://{BUCKET}/team", "revision": REVISION}
    config["gemmaserve:cloud"] = {**config["gemmaserve:cloud"], **cloud}
    return config


@pytest.fixture(scope="module")
def run():
    return run_program("gpu8", bucket_config(weights_bucket={"writers": ["group:ml-platform@example.com"]}))


def discovery_schema(name: str) -> dict:
    """One schema of storage v1's discovery document as JSON Schema: $refs resolved, unknown fields refused."""
    import googleapiclient

    path = Path(googleapiclient.__file__).parent / "discovery_cache" / "documents" / "storage.v1.json"
    schemas = json.loads(path.read_text())["schemas"]

    def convert(node: dict) -> dict:
        if "$ref" in node:
            return convert(schemas[node["$ref"]])
        out = {k: v for k, v in node.items() if k in ("type", "enum")}
        if out.get("type") == "integer" or node.get("format") in ("int64", "uint64"):
            out["type"] = ["integer", "string"]
        if "properties" in node:
            out["properties"] = {k: convert(v) for k, v in node["properties"].items()}
            out["additionalProperties"] = False
        elif "additionalProperties" in node:
            out["additionalProperties"] = convert(node["additionalProperties"])
        if "items" in node:
            out["items"] = convert(node["items"])
        return out

    return convert(schemas[name])


def test_the_bucket_is_private_uniform_and_exported(run):
    bucket = run.one("gcp:storage/bucket:Bucket")
    assert bucket.inputs["name"] == BUCKET
    assert bucket.inputs["uniformBucketLevelAccess"] is True
    assert bucket.inputs["publicAccessPrevention"] == "enforced"
    assert run.outputs["weights_bucket"] == f"gs://{BUCKET}"


def test_hosts_read_everything_and_write_only_compile_caches(run):
    members = {
        (m.inputs["role"], m.inputs["member"]): m.inputs
        for m in run.of_type("gcp:storage/bucketIAMMember:BucketIAMMember")
    }
    hosts = f"serviceAccount:gs-gpu8-hosts@{PROJECT}.iam.gserviceaccount.com"
    assert ("roles/storage.objectViewer", hosts) in members
    cache = members[("roles/storage.objectUser", hosts)]
    assert cache["condition"]["expression"] == (
        f'resource.name.startsWith("projects/_/buckets/{BUCKET}/objects/team/compile-cache/")'
    )
    assert ("roles/storage.objectAdmin", "group:ml-platform@example.com") in members
    assert not any(role in ("roles/storage.objectAdmin", "roles/storage.admin") and m == hosts for role, m in members)


def test_no_bucket_without_weights_from_a_bucket(stack_runs):
    assert not stack_runs["gpu8"].of_type("gcp:storage/bucket:Bucket")
    assert "weights_bucket" not in stack_runs["gpu8"].outputs


def test_bucket_request_body_matches_the_storage_api_schema(run):
    """The REST body the provider sends for these arguments (google_storage_bucket's documented mapping)."""
    bucket = run.one("gcp:storage/bucket:Bucket").inputs
    body = {
        "name": bucket["name"],
        "location": bucket["location"],
        "labels": bucket["labels"],
        "iamConfiguration": {
            "uniformBucketLevelAccess": {"enabled": bucket["uniformBucketLevelAccess"]},
            "publicAccessPrevention": bucket["publicAccessPrevention"],
        },
    }
    jsonschema.validate(body, discovery_schema("Bucket"))
    with pytest.raises(jsonschema.ValidationError):  # the check can fail: a misspelt field is refused
        jsonschema.validate({**body, "uniformBucketAccess": True}, discovery_schema("Bucket"))


def test_iam_bindings_match_the_policy_schema(run):
    """Every IAM member the program registers on the bucket, judged as one bucket policy (storage v1 Policy)."""
    bindings = [
        {
            "role": m.inputs["role"],
            "members": [m.inputs["member"]],
            **({"condition": {k: v for k, v in m.inputs["condition"].items()}} if m.inputs.get("condition") else {}),
        }
        for m in run.of_type("gcp:storage/bucketIAMMember:BucketIAMMember")
    ]
    assert bindings, "the program registered no IAM member on the bucket"
    jsonschema.validate({"bindings": bindings, "version": 3}, discovery_schema("Policy"))
    with pytest.raises(jsonschema.ValidationError):  # the check can fail: a misspelt field is refused
        jsonschema.validate({"bindings": [{**bindings[0], "member": "x"}], "version": 3}, discovery_schema("Policy"))


def test_host_upload_body_matches_the_object_schema(bucket, tmp_path, monkeypatch):
    """What roles/_lib/files/gcs_json.py sends to start a resumable upload, captured as the compile cache saves one
    to a real GCS API emulator."""
    compile_cache = load_program("caches", "compile_cache")
    gcs_json = sys.modules["gcs_json"]
    sent, send = [], gcs_json.Bucket._open

    def recording(self, url, method="GET", headers=None, data=None, timeout=60):
        if method == "POST":
            sent.append(json.loads(data))
        return send(self, url, method, headers, data, timeout)

    monkeypatch.setattr(gcs_json.Bucket, "_open", recording)
    (tmp_path / "shm" / "k1").mkdir(parents=True)
    (tmp_path / "shm" / "k1" / "kernel.so").write_bytes(b"x")
    remote = compile_cache.Remote(gcs_json.Bucket(bucket.name), "team/compile-cache/", host="host-a")
    compile_cache.save(["k1"], tmp_path / "shm", tmp_path / "disk", remote, 10**9)
    # Each host saves under its own prefix (the caches role's layout: PREFIX hosts/<host>/<key>.tar).
    assert bucket.get_blob("team/compile-cache/hosts/host-a/k1.tar") is not None
    [body] = sent
    assert body["name"] == "team/compile-cache/hosts/host-a/k1.tar"
    jsonschema.validate(body, discovery_schema("Object"))


def test_bad_writer_is_refused_before_any_resource():
    from gemmaserve.spec import SpecError

    with pytest.raises(SpecError, match="writers"):
        run_program("gpu8", bucket_config(weights_bucket={"writers": ["ml-platform@example.com"]}))


def test_storage_api_is_enabled_before_the_bucket_and_its_bindings(run):
    """Issue 12's rule for what issue 15 added: the API first, and nothing of the bucket races it."""
    services = {s.inputs["service"]: s for s in run.of_type("gcp:projects/service:Service")}
    storage = services["storage.googleapis.com"]
    assert storage.inputs["disableOnDestroy"] is False
    buckets, members = (
        run.of_type("gcp:storage/bucket:Bucket"),
        run.of_type("gcp:storage/bucketIAMMember:BucketIAMMember"),
    )
    assert buckets and members
    for resource in buckets + members:
        assert storage.urn in resource.dependencies, f"{resource.name} does not wait for the storage API"


def test_no_storage_api_without_weights_from_a_bucket(stack_runs):
    enabled = {s.inputs["service"] for s in stack_runs["gpu8"].of_type("gcp:projects/service:Service")}
    assert "storage.googleapis.com" not in enabled


def test_a_stack_sharing_another_stacks_bucket_grants_only_its_own_hosts():
    """cloud.weights_bucket.create: false (another stack owns the name): no bucket, but this stack's hosts
    still read it and write compile caches, after the storage API is on."""
    shared = run_program("gpu8", bucket_config(weights_bucket={"create": False}))
    assert not shared.of_type("gcp:storage/bucket:Bucket")
    storage = next(
        s for s in shared.of_type("gcp:projects/service:Service") if s.inputs["service"] == "storage.googleapis.com"
    )
    members = shared.of_type("gcp:storage/bucketIAMMember:BucketIAMMember")
    hosts = f"serviceAccount:gs-gpu8-hosts@{PROJECT}.iam.gserviceaccount.com"
    assert {(m.inputs["bucket"], m.inputs["role"], m.inputs["member"]) for m in members} == {
        (BUCKET, "roles/storage.objectViewer", hosts),
        (BUCKET, "roles/storage.objectUser", hosts),
    }
    assert all(storage.urn in m.dependencies for m in members)
    assert shared.outputs["weights_bucket"] == f"gs://{BUCKET}"
