"""The TPU provider inside the SDK's real dynamic-provider server, started as `pulumi up` starts it.

The engine runs Python dynamic providers through the CLI's `pulumi-resource-pulumi-python` script
(pulumi/pulumi v3.259.0 sdk/python/dist/pulumi-resource-pulumi-python; the CLI ships it, the SDK wheel
does not), and what decides whether our provider loads is how it is started:

- working directory: the program's directory, i.e. Pulumi.yaml's `main` when that is a directory
  (pkg/engine/project.go getPwdMain -> plugin context Pwd; sdk/go/common/resource/plugin/provider_plugin.go
  newPlugin(ctx, ctx.Pwd, ...); plugin.go `cmd.Dir = pwd`);
- arguments: the engine's address, one argument (provider_plugin.go: []string{host.ServerAddr()});
- environment: the CLI's own, plus each Pulumi.yaml runtime option as PULUMI_RUNTIME_<OPTION>,
  PULUMI_PROJECT and PULUMI_CONFIG (provider_plugin.go);
- interpreter: the script makes a relative PULUMI_RUNTIME_VIRTUALENV absolute against $PWD (the main
  directory, not the project root: pulumi/pulumi#7061, open), puts its bin/ first on PATH and runs
  `$VIRTUALENV/bin/python -u -m pulumi.dynamic "$@"`, which prints its port on stdout;
- configuration: Configure gets the whole stack config, keys with their namespace
  (pkg/resource/deploy/target.go GetPackageConfig).

The TPU provider is pickled by reference to its module (`gemmaserve.cloud.tpu_queued_resource`), an installed
package, so the server imports it from any working directory; infra/'s own providers (project_apis) are
imported from the server's working directory (`python -m` puts the cwd first on sys.path). The test
starts the server exactly so (the script's steps, without the script), drives it over gRPC with the
SDK's own stubs through Configure, Check, Diff, Create, Read, Update and Delete against the fake TPU
and Compute APIs served over HTTP on 127.0.0.1, and shows that the same server started from the project
root loads it too, and that a provider pickled under its old name (infra/'s flat tpu_queued_resource, in
the state of stacks deployed before the move) still loads in infra/. Every process it starts is stopped by
its PID.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
import yaml
from google.protobuf import struct_pb2
from pulumi.dynamic.dynamic import serialize_provider
from pulumi.runtime import rpc
from pulumi.runtime.proto import provider_pb2, provider_pb2_grpc
from pulumi.runtime.sync_await import _sync_await

from gemmaserve.cloud.tpu_queued_resource import QueuedResourceProvider
from tests.infra.conftest import ROOT
from tests.infra.fake_tpu import FakeTpu, Zone, serve_http
from tests.infra.test_tpu_queued_resource import DATA_DISK, PROJECT, ZONES, props

PROVIDER_KEY = "__provider"
URN = "urn:pulumi:tpu-v6e1::gemmaserve::gemmaserve:gcp:TpuSlice$pulumi-python:dynamic:Resource::gs-tpu-v6e1-tpu-qr"
START_TIMEOUT = 30
CALL_TIMEOUT = 60


def engine_launch() -> tuple[Path, dict[str, str], Path]:
    """(working directory, environment, interpreter) as the engine and its script would start the server."""
    project = yaml.safe_load((ROOT / "Pulumi.yaml").read_text())
    main = ROOT / project.get("main", ".")
    pwd = main if main.is_dir() else main.parent
    options = project["runtime"].get("options") or {}
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update({f"PULUMI_RUNTIME_{k.upper()}": str(v) for k, v in options.items()})
    env["PULUMI_PROJECT"] = project["name"]
    env["PULUMI_CONFIG"] = json.dumps({"gcp:project": PROJECT})
    virtualenv = Path(options["virtualenv"])
    virtualenv = virtualenv if virtualenv.is_absolute() else pwd / virtualenv
    env["PATH"] = f"{virtualenv}/bin:{env.get('PATH', '')}"
    return pwd, env, virtualenv / "bin" / "python"


@contextmanager
def dynamic_provider_server(cwd: Path, env: dict[str, str], python: Path, log: Path):
    """`python -u -m pulumi.dynamic ENGINE` in `cwd`; yields a ResourceProvider stub; stops it by PID."""
    with log.open("wb") as stderr:
        process = subprocess.Popen(
            [str(python), "-u", "-m", "pulumi.dynamic", "127.0.0.1:1"],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=stderr,
            start_new_session=True,
        )
    try:
        port = _read_port(process)
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        grpc.channel_ready_future(channel).result(timeout=START_TIMEOUT)
        try:
            yield provider_pb2_grpc.ResourceProviderStub(channel)
        finally:
            channel.close()
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
        process.stdout.close()


def _read_port(process: subprocess.Popen) -> int:
    import selectors

    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    if not selector.select(timeout=START_TIMEOUT):
        raise AssertionError(f"the dynamic provider server printed no port in {START_TIMEOUT} s")
    line = process.stdout.readline().decode().strip()
    assert line.isdigit(), f"expected the server's port on stdout, got {line!r} (exit {process.poll()})"
    return int(line)


def struct(values: dict) -> struct_pb2.Struct:
    return _sync_await(rpc.serialize_properties(values, {}))


def plain(message: struct_pb2.Struct) -> dict:
    return rpc.deserialize_properties(message)


@pytest.fixture
def served_fake():
    fake = FakeTpu(delete_seconds=0)
    server = serve_http(fake)
    yield fake, f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()


def stack_config(endpoint: str) -> dict:
    """What Configure carries: the whole stack config, namespaced (an access token: no credentials lookup)."""
    return {
        "gcp:project": PROJECT,
        "gcp:accessToken": "test-token",
        "gcp:tpuV2CustomEndpoint": endpoint + "v2/",
        "gcp:computeCustomEndpoint": endpoint + "compute/v1/",
        "gemmaserve:model": "e2b",
    }


def test_the_interpreter_the_engine_runs_exists():
    # The script resolves Pulumi.yaml's virtualenv against the main directory (pulumi/pulumi#7061): with
    # `main: infra/` that is infra/.venv, which must lead to the project's .venv.
    pwd, _, python = engine_launch()
    assert python.exists(), f"{python} (virtualenv resolved against {pwd}, as the engine's script does)"


def test_the_provider_loads_and_runs_in_the_sdk_dynamic_provider_server(served_fake, tmp_path):
    fake, endpoint = served_fake
    fake.zones[ZONES[0]] = Zone(capacity_at=fake.clock(), provisioning=0)
    pwd, env, python = engine_launch()
    assert python.exists(), f"{python}: see test_the_interpreter_the_engine_runs_exists"
    inputs = {
        **props(data_disk=DATA_DISK, create_wait_seconds=0, zones=ZONES[:1]),
        PROVIDER_KEY: serialize_provider(QueuedResourceProvider()),
    }
    with dynamic_provider_server(pwd, env, python, tmp_path / "server.log") as server:
        server.Configure(provider_pb2.ConfigureRequest(args=struct(stack_config(endpoint))), timeout=CALL_TIMEOUT)
        checked = server.Check(
            provider_pb2.CheckRequest(urn=URN, olds=struct({}), news=struct(inputs)), timeout=CALL_TIMEOUT
        )
        assert not checked.failures
        created = server.Create(provider_pb2.CreateRequest(urn=URN, properties=checked.inputs), timeout=CALL_TIMEOUT)
        outs = plain(created.properties)
        assert (created.id, outs["state"], outs["zone"]) == (inputs["queued_resource_id"], "ACTIVE", ZONES[0])
        assert outs["internal_ip"] == "10.42.0.7"
        assert [r.name for r in fake.live()] == [outs["queued_resource_name"]]
        assert list(fake.disks) == [f"projects/{PROJECT}/zones/{ZONES[0]}/disks/{inputs['node_id']}-data"]

        read = server.Read(
            provider_pb2.ReadRequest(id=created.id, urn=URN, properties=created.properties), timeout=CALL_TIMEOUT
        )
        assert plain(read.properties)["state"] == "ACTIVE"

        news = {**inputs, "labels": {"app": "gemmaserve", "team": "serving"}}
        diff = server.Diff(
            provider_pb2.DiffRequest(id=created.id, urn=URN, olds=created.properties, news=struct(news)),
            timeout=CALL_TIMEOUT,
        )
        assert diff.changes == provider_pb2.DiffResponse.DIFF_SOME and not diff.replaces
        updated = server.Update(
            provider_pb2.UpdateRequest(id=created.id, urn=URN, olds=created.properties, news=struct(news)),
            timeout=CALL_TIMEOUT,
        )
        assert plain(updated.properties)["labels"] == news["labels"]
        assert fake.get_node(outs["node_name"])["labels"]["team"] == "serving"

        server.Delete(
            provider_pb2.DeleteRequest(id=created.id, urn=URN, properties=updated.properties), timeout=CALL_TIMEOUT
        )
        assert fake.live() == [] and fake.disks == {}
    assert [c[0] for c in fake.calls if c[0] in ("create", "create_disk", "patch_node", "delete", "delete_disk")] == [
        "create_disk",
        "create",
        "patch_node",
        "delete",
        "delete_disk",
    ]


def create_through_the_server(cwd: Path, provider_blob: str, endpoint: str, log: Path) -> dict:
    """Configure, Check and Create one queued resource through a server started in `cwd`; its outputs."""
    _, env, python = engine_launch()
    inputs = {**props(create_wait_seconds=0, zones=ZONES[:1]), PROVIDER_KEY: provider_blob}
    with dynamic_provider_server(cwd, env, python, log) as server:
        server.Configure(provider_pb2.ConfigureRequest(args=struct(stack_config(endpoint))), timeout=CALL_TIMEOUT)
        checked = server.Check(
            provider_pb2.CheckRequest(urn=URN, olds=struct({}), news=struct(inputs)), timeout=CALL_TIMEOUT
        )
        created = server.Create(provider_pb2.CreateRequest(urn=URN, properties=checked.inputs), timeout=CALL_TIMEOUT)
    return plain(created.properties)


def test_started_from_the_project_root_the_provider_loads_too(served_fake, tmp_path):
    # The provider is pickled by reference to gemmaserve.cloud.tpu_queued_resource, an installed package: the
    # server finds it whatever its working directory (it was infra/'s flat module, found only from there).
    fake, endpoint = served_fake
    fake.zones[ZONES[0]] = Zone(capacity_at=fake.clock(), provisioning=0)
    blob = serialize_provider(QueuedResourceProvider())
    assert b"gemmaserve.cloud.tpu_queued_resource" in base64.b64decode(blob)
    outs = create_through_the_server(ROOT, blob, endpoint, tmp_path / "server.log")
    assert outs["state"] == "ACTIVE" and [r.name for r in fake.live()] == [outs["queued_resource_name"]]


def test_a_provider_pickled_before_the_move_still_loads_in_infra(served_fake, tmp_path, monkeypatch):
    # Stacks deployed earlier hold `tpu_queued_resource.QueuedResourceProvider` in their state, and Pulumi reads
    # and deletes with the stored provider: infra/tpu_queued_resource.py keeps that name resolving.
    fake, endpoint = served_fake
    fake.zones[ZONES[0]] = Zone(capacity_at=fake.clock(), provisioning=0)
    import tpu_queued_resource  # infra/'s old name, as the server in infra/ imports it

    assert tpu_queued_resource.QueuedResourceProvider is QueuedResourceProvider
    monkeypatch.setattr(QueuedResourceProvider, "__module__", "tpu_queued_resource")
    blob = serialize_provider(QueuedResourceProvider())
    monkeypatch.undo()
    assert b"gemmaserve.cloud" not in base64.b64decode(blob)
    pwd, _, _ = engine_launch()
    outs = create_through_the_server(pwd, blob, endpoint, tmp_path / "server.log")
    assert outs["state"] == "ACTIVE"


def test_the_enablement_wait_loads_and_runs_there_too(tmp_path):
    from project_apis import EnablementWaitProvider

    pwd, env, python = engine_launch()
    inputs = {"apis": ["tpu.googleapis.com"], "seconds": 0, PROVIDER_KEY: serialize_provider(EnablementWaitProvider())}
    with dynamic_provider_server(pwd, env, python, tmp_path / "server.log") as server:
        server.Configure(provider_pb2.ConfigureRequest(args=struct({"gcp:project": PROJECT})), timeout=CALL_TIMEOUT)
        created = server.Create(provider_pb2.CreateRequest(urn=URN, properties=struct(inputs)), timeout=CALL_TIMEOUT)
        assert plain(created.properties)["apis"] == ["tpu.googleapis.com"]
