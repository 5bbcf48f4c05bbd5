"""Weights and compile caches from a bucket, on real sandbox hosts: the sandbox's GCS API emulator
(fake-gcs-server on 10.231.0.1) holds the mirrored test model; host A pulls it, serves with torch.compile
on and saves its compile cache to the bucket; host B deploys from the bucket alone and builds no kernel
again. Then bad input on the serving host B: each a clear error before any replica restarts."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from gemmaserve.ops.weights import LocalSource, mirror, storage_client
from gemmaserve.plan import plan
from gemmaserve.sandbox import bucket as sandbox_bucket
from gemmaserve.sandbox.profile import SANDBOX_BUCKET, TINY_MODEL_DIR, bucket_host_data, sandbox_host_data
from gemmaserve.sources import spec_from_host_data
from tests.roles.sandbox.test_compile_cache import chat, kernels
from tests.sandbox_fixtures import BucketHosts, SandboxBucket, deploy

pytestmark = pytest.mark.sandbox


@pytest.fixture(scope="module")
def emulator(bucket_emulator: SandboxBucket):
    """The sandbox's bucket, with this module's own storage clients pointed at it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("STORAGE_EMULATOR_HOST", bucket_emulator.emulator.endpoint)
        yield bucket_emulator.emulator


@pytest.fixture(scope="module")
def data(bucket_emulator: SandboxBucket) -> dict:
    return bucket_emulator.data


@pytest.fixture(scope="module")
def hosts(bucket_hosts: BucketHosts):
    """Host A deployed from the bucket (compiling), its cache saved to the bucket; then host B from the bucket
    (tests/sandbox_fixtures.py; the compile-cache tests and `serving_peer` use them too)."""
    return bucket_hosts.hosts, bucket_hosts.remotes, bucket_hosts.plan, bucket_hosts.b_started


def test_host_a_serves_the_pulled_copy(hosts):
    up, remotes, host_plan, _ = hosts
    weights = host_plan.weights
    remote = remotes[0]
    assert remote.file(f"{weights.local_dir}/.gemmaserve-complete").exists
    assert remote.file(f"{weights.local_dir}/model.safetensors").user == "gemmaserve"
    env = remote.file("/etc/gemmaserve/replica-0.env").content_string
    assert f"VLLM_ARGS='{weights.local_dir} --served-model-name {host_plan.model.hf_id}" in env
    assert "HF_HUB_OFFLINE=1" in env
    assert chat(up[0], host_plan.model.hf_id) in ("length", "stop")


def test_status_lines_say_ready_and_weights_local(hosts):
    _, remotes, host_plan, _ = hosts
    for remote in remotes:
        replica = remote.run("systemctl show -p StatusText --value vllm@0").stdout
        assert replica.startswith("ready"), replica
        fetched = remote.run("systemctl show -p StatusText --value gemmaserve-weights").stdout
        assert fetched.startswith(("weights local in", "weights already local")), fetched


def test_the_compile_cache_is_in_the_bucket_under_the_plans_key(hosts, emulator):
    _, _, host_plan, _ = hosts
    key = host_plan.replicas[0].cache_key
    blob = storage_client().bucket(SANDBOX_BUCKET).get_blob(f"{host_plan.weights.compile_cache_prefix}{key}.tar")
    assert blob is not None and blob.size > 0


def test_host_b_compiled_nothing_again(hosts):
    """Every kernel in host B's /dev/shm cache predates its deploy: restored from the bucket, not built."""
    up, remotes, host_plan, started = hosts
    key = host_plan.replicas[0].cache_key
    found = kernels(remotes[1], key)
    assert found, "no kernels were restored to host B"
    assert max(found.values()) < started, "host B built kernels again"
    restored = remotes[1].run("journalctl -u gemmaserve-cache-restore -o cat").stdout
    assert f"{key}: fetched from gs://{SANDBOX_BUCKET}/" in restored
    assert chat(up[1], host_plan.model.hf_id) in ("length", "stop")


def test_host_b_never_asked_hugging_face(hosts):
    _, remotes, host_plan, _ = hosts
    remote = remotes[1]
    # Nothing in the hub cache, no token anywhere, offline mode on, and no hub host in any log.
    assert remote.run("find /var/lib/gemmaserve/hf -path '*hub*' -type f 2>/dev/null | head -1").stdout == ""
    assert "LoadCredential" not in remote.file("/etc/systemd/system/vllm@.service").content_string
    assert "HF_TOKEN_PATH=" not in remote.file("/etc/gemmaserve/replica-0.env").content_string
    environ = remote.run("tr '\\0' '\\n' < /proc/$(systemctl show -p MainPID --value vllm@0)/environ").stdout
    assert "HF_HUB_OFFLINE=1" in environ and "HF_TOKEN" not in environ
    assert remote.run("journalctl --no-pager -o cat | grep -ci huggingface.co").stdout.strip() == "0"


def _replica_pid(remote) -> str:
    return remote.run("systemctl show -p MainPID --value vllm@0").stdout.strip()


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("missing bucket", "gs://gemmaserve-no-such-bucket: no such bucket"),
        ("revision not in the mirror", "this revision is not in the mirror"),
        ("corrupted object", "is corrupt: sha256"),
        # The emulator implements no IAM; the nearest real refusal is a host without credentials: outside
        # the emulator it asks the metadata server for its service account's token and there is none.
        ("no credentials", "no service account token from the metadata server"),
    ],
)
def test_bad_mirror_input_fails_before_any_restart(hosts, data, emulator, tmp_path, case, expected):
    up, remotes, host_plan, _ = hosts
    remote = remotes[1]
    weights = dict(data["gemmaserve_weights"])
    if case == "missing bucket":
        weights["bucket"] = "gs://gemmaserve-no-such-bucket"
    elif case == "revision not in the mirror":
        weights["revision"] = "f" * 40
    elif case == "corrupted object":
        weights["revision"] = _mirror_corrupted_revision(tmp_path, emulator)
    overrides = {**data, "gemmaserve_weights": weights}
    if case == "no credentials":
        overrides["gemmaserve_storage_emulator_host"] = None
    pid = _replica_pid(remote)
    result = deploy(up[1].name, overrides, tmp_path)
    assert result.returncode != 0
    assert expected in result.output, result.output[-3000:]
    assert _replica_pid(remote) == pid, "the replica was restarted"
    assert chat(up[1], host_plan.model.hf_id) in ("length", "stop")


def _mirror_corrupted_revision(tmp_path, emulator) -> str:
    """Another revision of the test model (one more file), mirrored, then its weights rotted in the store."""
    copy = tmp_path / "model"
    shutil.copytree(TINY_MODEL_DIR, copy)
    (copy / "NOTICE").write_text(f"revision for a corruption test {time.time_ns()}\n")
    source = LocalSource(copy)
    revision = source.resolve(None)
    host_plan = plan(
        spec_from_host_data({**sandbox_host_data(), **bucket_host_data(revision)}), available_kv_gib=None
    ).require_ok()
    mirror(host_plan.weights, source, progress=lambda _: None)
    name = f"{host_plan.weights.object_prefix}model.safetensors"
    [backing] = [
        p
        for p in (sandbox_bucket.STATE_DIR / "data" / SANDBOX_BUCKET).rglob("*")
        if p.is_file() and name in __import__("urllib.parse").parse.unquote(str(p))
    ]
    with open(backing, "r+b") as handle:
        handle.seek(4096)
        byte = handle.read(1)
        handle.seek(4096)
        handle.write(bytes([byte[0] ^ 0xFF]))
    assert json.loads(
        storage_client().bucket(SANDBOX_BUCKET).blob(host_plan.weights.manifest_object).download_as_bytes()
    )
    return revision
