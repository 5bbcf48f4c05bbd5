"""Test doubles for `gemmaserve capacity`: a Pulumi stack whose `up` runs the real TPU provider, and Compute.

`FakeStack` is Pulumi's engine reduced to what `pulumi up --refresh` does to this program's capacity:
refresh (provider.read; a vanished request leaves the state), then create or diff + update with the
inputs last applied (a provider that raises leaves the resource as the refresh left it), then the `hosts` output recomputed from the resources. It keeps a deployment in
the shape `pulumi stack export` writes (type, urn, id, inputs, outputs). The TPU API behind it is the
stateful fake of tests/infra/fake_tpu.py; `gemmaserve capacity` itself only ever gets `read_only(...)`
views of the clouds, so a test fails if it tries to change anything except through `up`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gemmaserve.cloud.tpu_api import ApiError
from gemmaserve.ops.capacity import INSTANCE, QUEUED, STACK, Clouds


@dataclass
class FakeCompute:
    """compute.instances.get over a dict; tests set status (TERMINATED after a preemption, say)."""

    instances: dict[tuple[str, str, str], dict] = field(default_factory=dict)
    # How many times each VM was created: a replacement shows here.
    creations: dict[tuple[str, str, str], int] = field(default_factory=dict)

    def add(self, project: str, zone: str, name: str, status: str = "RUNNING", ip: str = "10.42.0.11", **extra) -> None:
        self.creations[(project, zone, name)] = self.creations.get((project, zone, name), 0) + 1
        self.instances[(project, zone, name)] = {
            "name": name,
            "zone": zone,
            "status": status,
            "networkInterfaces": [{"networkIP": ip}],
            **extra,
        }

    def get_instance(self, project: str, zone: str, name: str) -> dict:
        try:
            return dict(self.instances[(project, zone, name)])
        except KeyError:
            raise ApiError(
                404, "NOT_FOUND", f"The resource 'projects/{project}/zones/{zone}/instances/{name}' was not found"
            ) from None


class ReadOnly:
    """Only the read calls of an API; anything else is an AttributeError."""

    def __init__(self, api: Any, *calls: str):
        for call in calls:
            setattr(self, call, getattr(api, call))


def read_only(tpu, compute) -> Clouds:
    return Clouds(tpu=ReadOnly(tpu, "get_queued_resource", "get_node"), compute=ReadOnly(compute, "get_instance"))


class UpKilled(BaseException):
    """`pulumi up` killed mid-step (SIGKILL, a CI job's timeout): nothing the provider does catches it, and
    the engine records nothing of the step it was in. A BaseException, as KeyboardInterrupt is."""


class FakeStack:
    def __init__(self, name: str, provider, compute: FakeCompute | None = None, project: str = "gemmaserve-test"):
        self.name, self.provider, self.compute, self.project = name, provider, compute or FakeCompute(), project
        self.deployment: list[dict[str, Any]] = [
            {
                "type": STACK,
                "urn": f"urn:pulumi:{name}::gemmaserve::pulumi:pulumi:Stack::gemmaserve-{name}",
                "outputs": {},
            }
        ]
        self.ups = 0
        self.fail_next_up: Exception | None = None
        # Every replacement an `up` was about to make (urn, keys): the engine would delete the slice first.
        self.replacements: list[tuple[str, list[str]]] = []
        self.log: list[str] = []

    # --- what a first `pulumi up` made -------------------------------------------------------------

    def create_queued_resource(self, inputs: dict[str, Any]) -> dict[str, Any]:
        result = self.provider.create(inputs)
        resource = {"type": QUEUED, "urn": f"urn:{inputs['queued_resource_id']}", "id": result.id}
        resource.update(inputs=dict(inputs), outputs=result.outs)
        self.deployment.append(resource)
        self._hosts()
        return resource

    def add_vm(self, name: str, zone: str, provisioning: str = "SPOT", status: str = "RUNNING") -> dict[str, Any]:
        self.compute.add(self.project, zone, name, status=status)
        outputs = {
            "name": name,
            "zone": zone,
            "project": self.project,
            "scheduling": {"provisioningModel": provisioning},
            "currentStatus": status,
            "networkInterfaces": [{"networkIp": "10.42.0.11"}],
        }
        resource = {"type": INSTANCE, "urn": f"urn:{name}", "id": name, "inputs": {}, "outputs": outputs}
        self.deployment.append(resource)
        self._hosts()
        return resource

    # --- PulumiStack ---------------------------------------------------------------------------------

    def resources(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self.deployment]

    def config(self) -> dict[str, Any]:
        return {"gcp:project": self.project}

    def up(self, log) -> dict[str, Any]:
        self.ups += 1
        if self.fail_next_up is not None:
            error, self.fail_next_up = self.fail_next_up, None
            raise error
        try:
            return self._up(log)
        except UpKilled as killed:
            raise RuntimeError(f"pulumi up was killed: {killed}") from None

    def _up(self, log) -> dict[str, Any]:
        for resource in self.deployment:
            if resource["type"] == QUEUED:
                if resource["id"]:
                    log(f"refreshing {resource['urn']}")
                    read = self.provider.read(resource["id"], resource["outputs"])
                    if not read.id:
                        # The refresh drops a request that is gone from the state; a create that then fails
                        # leaves the stack without it until an `up` creates it.
                        resource.update(id="", outputs={})
                if not resource["id"]:
                    created = self.provider.create(resource["inputs"])
                    resource.update(id=created.id, outputs=created.outs)
                    continue
                resource["outputs"] = read.outs
                diff = self.provider.diff(resource["id"], resource["outputs"], resource["inputs"])
                if diff.replaces:
                    # Recorded as well as raised: `gemmaserve capacity` reports a failed `up` and carries on.
                    self.replacements.append((resource["urn"], list(diff.replaces)))
                    raise AssertionError(f"up would replace {resource['urn']}: {diff.replaces}")
                if diff.changes:
                    resource["outputs"] = self.provider.update(
                        resource["id"], resource["outputs"], resource["inputs"]
                    ).outs
            elif resource["type"] == INSTANCE:
                outs = resource["outputs"]
                key = (self.project, outs["zone"], outs["name"])
                if key not in self.compute.instances:
                    self.compute.add(*key)  # deleted (flex-start DELETE): up creates it again
                elif self.compute.instances[key]["status"] != "RUNNING":
                    self.compute.instances[key]["status"] = "RUNNING"  # desired_status RUNNING starts it
                outs["currentStatus"] = "RUNNING"
        return self._hosts()

    def _hosts(self) -> dict[str, Any]:
        hosts = []
        for resource in self.deployment:
            outs = resource.get("outputs") or {}
            if resource["type"] == QUEUED and outs:
                hosts.append(
                    {
                        "name": outs["node_name"].rsplit("/", 1)[-1],
                        "internal_ip": outs["internal_ip"],
                        "zone": outs["zone"],
                    }
                )
            elif resource["type"] == INSTANCE:
                hosts.append(
                    {
                        "name": outs["name"],
                        "internal_ip": outs["networkInterfaces"][0]["networkIp"],
                        "zone": outs["zone"],
                    }
                )
        self.deployment[0]["outputs"] = {"hosts": hosts}
        return dict(self.deployment[0]["outputs"])
