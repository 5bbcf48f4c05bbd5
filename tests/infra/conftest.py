"""Runs the real Pulumi program (infra/__main__.py) per stack under Pulumi's mocks, with preview=False.

Runtime state is global in Pulumi, so every run goes through `run_program`, which re-installs the
mocks, the stack's config and a monitor that records each registration (type, name, inputs, raw
request: for `protect` and for which inputs were sent as secrets).
"""

from __future__ import annotations

import json
import runpy
import sys
from dataclasses import dataclass, field
from typing import Any

import pulumi
import pytest
import yaml
from google.protobuf.json_format import MessageToDict
from pulumi.runtime import mocks as pulumi_mocks
from pulumi.runtime.settings import SETTINGS
from pulumi.runtime.stack import run_pulumi_func
from pulumi.runtime.sync_await import _sync_await

from tests import ROOT

INFRA = ROOT / "infra"
if str(INFRA) not in sys.path:
    # The program imports its components flat (`from network import Network`), as Pulumi runs it.
    sys.path.insert(0, str(INFRA))

STACKS = ("tpu-v6e4", "tpu-v6e1", "gpu8", "a100", "h100")
PROJECT = "gemmaserve-test"
HF_TOKEN = "hf_TESTtokenDoNotLeak0123456789abcdef"
SECRET_SIG = "4dabf18193072939515e22adb298388d"


@dataclass
class Registration:
    type: str
    name: str
    inputs: dict[str, Any]
    protect: bool
    secret_inputs: set[str]
    urn: str = ""
    dependencies: set[str] = field(default_factory=set)
    custom_timeouts: dict[str, str] = field(default_factory=dict)


@dataclass
class ProgramRun:
    resources: list[Registration] = field(default_factory=list)
    outputs: dict[str, Any] = field(default_factory=dict)

    def of_type(self, type_: str) -> list[Registration]:
        return [r for r in self.resources if r.type == type_]

    def one(self, type_: str) -> Registration:
        found = self.of_type(type_)
        assert len(found) == 1, f"expected one {type_}, got {[r.name for r in found]}"
        return found[0]

    @property
    def types(self) -> list[str]:
        return sorted(r.type for r in self.resources)


def pem(label: str, name: str) -> str:
    return f"-----BEGIN {label}-----\nMOCK{name}\n-----END {label}-----\n"


class CloudMocks(pulumi.runtime.Mocks):
    """Plausible provider outputs: what the program reads back (IPs, emails, names, self links)."""

    def __init__(self):
        self.instances = 0

    def new_resource(self, args: pulumi.runtime.MockResourceArgs):
        inputs, name, typ = dict(args.inputs), args.name, args.typ
        state: dict[str, Any] = dict(inputs)
        if typ == "gcp:serviceaccount/account:Account":
            state["email"] = f"{inputs['accountId']}@{PROJECT}.iam.gserviceaccount.com"
        elif typ == "gcp:compute/subnetwork:Subnetwork":
            return f"projects/{PROJECT}/regions/{inputs['region']}/subnetworks/{name}", state
        elif typ == "gcp:compute/network:Network":
            return f"projects/{PROJECT}/global/networks/{name}", state
        elif typ == "gcp:compute/instance:Instance":
            self.instances += 1
            nics = [dict(nic) for nic in inputs.get("networkInterfaces", [])]
            nics[0]["networkIp"] = f"10.42.0.{10 + self.instances}"
            for config in nics[0].get("accessConfigs", []):
                config["natIp"] = "34.1.2.3"
            state.update(
                networkInterfaces=nics,
                name=name,
                selfLink=f"https://www.googleapis.com/compute/v1/projects/{PROJECT}/zones/{inputs['zone']}/instances/{name}",
            )
        elif typ == "gcp:compute/instanceGroup:InstanceGroup":
            state["selfLink"] = (
                f"https://www.googleapis.com/compute/v1/projects/{PROJECT}/zones/{inputs['zone']}/instanceGroups/{name}"
            )
        elif typ == "gcp:compute/forwardingRule:ForwardingRule":
            state["ipAddress"] = "10.42.0.200"
        elif typ == "gcp:secretmanager/secret:Secret":
            state["name"] = f"projects/123456/secrets/{inputs['secretId']}"
        elif typ == "gcp:artifactregistry/repository:Repository":
            state["name"] = inputs["repositoryId"]
        elif typ == "pulumi-python:dynamic:Resource":
            zone = inputs["zones"][0]
            state.update(
                zone=zone,
                provisioning_model=inputs["provisioning"],
                state="ACTIVE",
                internal_ip="10.42.0.5",
                external_ip=None,
                queued_resource_name=f"projects/{PROJECT}/locations/{zone}/queuedResources/{inputs['queued_resource_id']}",
                node_name=f"projects/{PROJECT}/locations/{zone}/nodes/{inputs['node_id']}",
            )
        elif typ.startswith("tls:index/"):
            # pulumi-tls computes these locally; the mock returns PEM-shaped placeholders naming the resource.
            kind = typ.split(":")[-1]
            if kind == "PrivateKey":
                state["privateKeyPem"] = pem("PRIVATE KEY", name)
                state["publicKeyPem"] = pem("PUBLIC KEY", name)
            elif kind == "CertRequest":
                state["certRequestPem"] = pem("CERTIFICATE REQUEST", name)
            else:  # SelfSignedCert, LocallySignedCert
                state["certPem"] = pem("CERTIFICATE", name)
        elif typ == "gcp:compute/address:Address":
            state["address"] = "10.42.0.200"
        elif typ == "docker:index/image:Image":
            state["repoDigest"] = f"{inputs['imageName'].split(':')[0]}@sha256:{'0' * 64}"
        return f"{name}-id", state

    def call(self, args: pulumi.runtime.MockCallArgs):
        if args.token == "gcp:organizations/getClientConfig:getClientConfig":
            return {"accessToken": "ya29.fake", "project": PROJECT, "region": "us-east5", "zone": "", "id": "x"}
        return {}


class RecordingMonitor(pulumi_mocks.MockMonitor):
    def __init__(self, mocks: CloudMocks, run: ProgramRun):
        super().__init__(mocks)
        self.run = run

    def RegisterResource(self, request):
        response = super().RegisterResource(request)
        if request.custom:
            raw = MessageToDict(request.object)
            secret_inputs = {k for k, v in raw.items() if isinstance(v, dict) and SECRET_SIG in v}
            inputs = pulumi.runtime.rpc.deserialize_properties(request.object)
            timeouts = MessageToDict(request.customTimeouts) if request.HasField("customTimeouts") else {}
            self.run.resources.append(
                Registration(
                    request.type,
                    request.name,
                    inputs,
                    request.protect,
                    secret_inputs,
                    urn=response.urn,
                    dependencies=set(request.dependencies),
                    custom_timeouts=timeouts,
                )
            )
        return response


def stack_config(stack: str) -> dict[str, Any]:
    """The stack file's config with the project a user sets (`pulumi config set gcp:project`)."""
    document = yaml.safe_load((ROOT / f"Pulumi.{stack}.yaml").read_text())
    return {"gcp:project": PROJECT, **document["config"]}


def run_program(
    stack: str,
    config: dict[str, Any] | None = None,
    hf_token: str | None = HF_TOKEN,
    run: ProgramRun | None = None,
    mocks: CloudMocks | None = None,
) -> ProgramRun:
    """Run infra/__main__.py for `stack` (config defaults to its Pulumi.<stack>.yaml) and resolve its exports.

    Pass `run` to inspect what was registered when the program raises.
    """
    config = stack_config(stack) if config is None else config
    run = ProgramRun() if run is None else run
    mocks = mocks or CloudMocks()
    pulumi.runtime.set_mocks(
        mocks, project="gemmaserve", stack=stack, preview=False, monitor=RecordingMonitor(mocks, run)
    )
    values = {k: v if isinstance(v, str) else json.dumps(v) for k, v in config.items()}
    secret_keys = []
    if hf_token is not None:
        values["gemmaserve:hfToken"] = hf_token
        secret_keys.append("gemmaserve:hfToken")
    pulumi.runtime.set_all_config(values, secret_keys)
    exports: dict[str, Any] = {}
    original_export = pulumi.export
    pulumi.export = lambda key, value: exports.__setitem__(key, value)
    try:
        SETTINGS.rpc_manager.clear()
        SETTINGS.outputs.clear()

        def program():
            runpy.run_path(str(INFRA / "__main__.py"), run_name="__main__")
            return pulumi.Output.all(**exports) if exports else {}

        def resolve():
            run.outputs.update(_sync_await(pulumi.Output.from_input(program()).future()) or {})

        _sync_await(run_pulumi_func(resolve))
    finally:
        pulumi.export = original_export
    return run


@pytest.fixture(scope="session")
def stack_runs() -> dict[str, ProgramRun]:
    """Each stack once per session (the program is deterministic; mocks make it fast)."""
    return {stack: run_program(stack) for stack in STACKS}
