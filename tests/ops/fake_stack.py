"""Test doubles for `gemmaserve capacity`: a Pulumi stack whose `up` runs the real TPU provider, and Compute.

`FakeStack` is Pulumi's engine reduced to what `pulumi up --refresh` does to this program's capacity:
refresh (provider.read; a vanished request leaves the state), then create or diff + update with the
inputs last applied (a provider that raises leaves the resource as the refresh left it), then the `hosts`
output recomputed from the resources. It keeps a deployment in the shape `pulumi stack export` writes
(type, urn, id, inputs, outputs). The TPU API behind it is the stateful fake of tests/infra/fake_tpu.py.

A GPU VM is the Instance the real program declares (`program_vm`: infra/ under Pulumi's mocks), made by
`FakeCompute` as Compute Engine makes it (with the Local SSDs its machine type comes with), read back and
diffed as the gcp provider does: a replacement deletes the VM and makes it again, and shows in
`FakeCompute.creations`. `gemmaserve capacity` itself only ever gets `read_only(...)` views of the clouds,
so a test fails if it tries to change anything except through `up`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from gemmaserve.cloud.tpu_api import ApiError
from gemmaserve.ops.capacity import INSTANCE, QUEUED, STACK, Clouds
from tests.infra.compute_facts import GOOGLE_ATTACHES
from tests.infra.conftest import run_program
from tests.infra.discovery import COMPUTE

LOCAL_SSD_GB = 375


def program_vm(stack: str) -> tuple[str, dict[str, Any]]:
    """The GPU VM the Pulumi program declares for `stack`: its name and inputs, as infra/gpu_vm.py builds them
    from the stack's config (the program run under Pulumi's mocks, tests/infra/conftest.py)."""
    vm = run_program(stack).one(INSTANCE)
    return vm.name, vm.inputs


@dataclass
class FakeCompute:
    """compute.instances insert and get over a dict; tests set status (TERMINATED after a preemption, say)."""

    instances: dict[tuple[str, str, str], dict] = field(default_factory=dict)
    # How many times each VM was created: a replacement shows here.
    creations: dict[tuple[str, str, str], int] = field(default_factory=dict)

    def insert(self, project: str, name: str, inputs: dict[str, Any], status: str = "RUNNING") -> None:
        """The VM the Instance's inputs declare, as Compute Engine makes it: an A2 Ultra, A3 or A4 machine type
        gets its fixed number of 375 GB NVMe Local SSDs whatever the request says (compute_facts.GOOGLE_ATTACHES,
        https://cloud.google.com/compute/docs/disks/local-ssd#lssd_disks_fixed); others get what is declared."""
        zone, machine = inputs["zone"], inputs["machineType"]
        bundled = GOOGLE_ATTACHES[machine]  # a machine type the fake does not know is a KeyError, not a guess
        declared = [
            (d.get("interface") or "SCSI", int(d.get("size") or LOCAL_SSD_GB)) for d in inputs.get("scratchDisks") or []
        ]
        scratch = [("NVME", LOCAL_SSD_GB)] * bundled if bundled else declared
        nic = (inputs.get("networkInterfaces") or [{}])[0]
        key = (project, zone, name)
        self.creations[key] = self.creations.get(key, 0) + 1
        instance = {
            "kind": "compute#instance",
            "name": name,
            "zone": f"https://www.googleapis.com/compute/v1/projects/{project}/zones/{zone}",
            "machineType": f"https://www.googleapis.com/compute/v1/projects/{project}/zones/{zone}/machineTypes/{machine}",
            "status": status,
            "scheduling": dict(inputs.get("scheduling") or {}),
            "networkInterfaces": [
                {
                    "networkIP": "10.42.0.11",
                    "subnetwork": nic.get("subnetwork"),
                    **({"nicType": nic["nicType"]} if nic.get("nicType") else {}),
                }
            ],
            "disks": [{"boot": True, "type": "PERSISTENT", "deviceName": "persistent-disk-0", "interface": "SCSI"}]
            + [
                {"type": "SCRATCH", "deviceName": f"local-ssd-{i}", "interface": interface, "diskSizeGb": str(size)}
                for i, (interface, size) in enumerate(scratch)
            ],
        }
        COMPUTE.assert_response("Instance", instance)
        self.instances[key] = instance

    def get_instance(self, project: str, zone: str, name: str) -> dict:
        try:
            return json.loads(json.dumps(self.instances[(project, zone, name)]))
        except KeyError:
            raise ApiError(
                404, "NOT_FOUND", f"The resource 'projects/{project}/zones/{zone}/instances/{name}' was not found"
            ) from None


def instance_state(project: str, instance: dict[str, Any]) -> dict[str, Any]:
    """The gcp provider's outputs read from a VM (what refresh stores), the fields capacity and the diff use.

    scratch_disk: every disk of type SCRATCH, as device_name, interface and size (terraform-provider-google
    google/services/compute/resource_compute_instance.go at e03b762, resourceComputeInstanceRead and
    flattenScratchDisk).
    """
    nic = instance["networkInterfaces"][0]
    return {
        "name": instance["name"],
        "project": project,
        "zone": instance["zone"].rsplit("/", 1)[-1],
        "machineType": instance["machineType"].rsplit("/", 1)[-1],
        "scheduling": dict(instance.get("scheduling") or {}),
        "currentStatus": instance["status"],
        "networkInterfaces": [{"networkIp": nic["networkIP"], "subnetwork": nic.get("subnetwork")}],
        "scratchDisks": [
            {"deviceName": d["deviceName"], "interface": d["interface"], "size": int(d["diskSizeGb"])}
            for d in instance["disks"]
            if d.get("type") == "SCRATCH"
        ],
    }


def instance_replaces(inputs: dict[str, Any], state: dict[str, Any]) -> list[str]:
    """What the gcp provider's diff of the program's inputs against the refreshed state replaces.

    terraform-provider-google resource_compute_instance.go (e03b762): `scratch_disk` is a ForceNew list and its
    `size` ForceNew (`device_name` is Optional+Computed: left out, it takes the state's); a ForceNew list
    whose count changes requires a new resource (terraform-plugin-sdk v2.40.0 helper/schema/schema.go,
    diffList: the count's diff takes the list's ForceNew). `zone` is ForceNew too. Only these are modelled:
    the fake reads every other field back as declared (Local SSDs are what Compute Engine adds on its own).
    """
    declared = [int(d.get("size") or LOCAL_SSD_GB) for d in inputs.get("scratchDisks") or []]
    held = [int(d["size"]) for d in state.get("scratchDisks") or []]
    return [
        key
        for key, differs in (("scratchDisks", declared != held), ("zone", inputs["zone"] != state["zone"]))
        if differs
    ]


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

    def add_vm(self, name: str, inputs: dict[str, Any], status: str = "RUNNING") -> dict[str, Any]:
        """The GPU VM `inputs` declare (program_vm), as the first `up` made it: its outputs are what was read back."""
        self.compute.insert(self.project, name, inputs, status=status)
        resource = {"type": INSTANCE, "urn": f"urn:{name}", "id": name, "inputs": dict(inputs)}
        resource["outputs"] = instance_state(
            self.project, self.compute.get_instance(self.project, inputs["zone"], name)
        )
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
                self._up_vm(resource, log)
        return self._hosts()

    def _up_vm(self, resource: dict[str, Any], log) -> None:
        """Refresh, then diff the program's inputs against what was read: a replacement deletes the VM (a spot or
        flex-start VM loses its capacity) and makes it again; else a stopped VM is started (desired_status)."""
        inputs, name = resource["inputs"], resource["id"]
        key = (self.project, inputs["zone"], name)
        log(f"refreshing {resource['urn']}")
        if key not in self.compute.instances:
            self.compute.insert(self.project, name, inputs)  # deleted (flex-start DELETE): up creates it again
        else:
            resource["outputs"] = instance_state(self.project, self.compute.get_instance(*key))
            replaces = instance_replaces(inputs, resource["outputs"])
            if replaces:
                self.replacements.append((resource["urn"], replaces))
                log(f"replacing {resource['urn']}: {', '.join(replaces)}")
                del self.compute.instances[key]
                self.compute.insert(self.project, name, inputs)
            elif self.compute.instances[key]["status"] != "RUNNING":
                self.compute.instances[key]["status"] = "RUNNING"  # desired_status RUNNING starts it
        resource["outputs"] = instance_state(self.project, self.compute.get_instance(*key))

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
