"""Typed host records: what the Pulumi program exports as `hosts` and what inventories read back.

Modelled on SkyPilot's InstanceInfo: enough to reach a host and know what it serves; the full argv
and environment stay in the plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import Field

from gemmaserve.plan import Plan
from gemmaserve.spec import SpecError, Strict, validate_model

Provisioning = Literal["standard", "guaranteed", "reserved", "spot", "flex-start"]


class HostCapacity(Strict):
    """How a host was bought (host data `gemmaserve_capacity`): can the cloud take it back, with a notice?"""

    kind: Literal["tpu-vm", "gce-vm", "static"] = "static"
    provisioning: Provisioning = "standard"

    @property
    def preemptible(self) -> bool:
        """Spot and flex-start capacity can be reclaimed; TPU VMs do not live-migrate, so maintenance ends
        them (cloud.google.com/tpu/docs/maintenance-events): all get a notice on the metadata server."""
        return self.provisioning in ("spot", "flex-start") or self.kind == "tpu-vm"


class ReplicaRecord(Strict):
    index: int = Field(ge=0)
    devices: list[int]
    tensor_parallel_size: int = Field(ge=1)
    port: int = Field(ge=1, le=65535)


class AcceleratorRecord(Strict):
    kind: str
    count: int = Field(ge=1)


class HostRecord(Strict):
    """One serving host as a stack exports it."""

    name: str = Field(min_length=1)
    internal_ip: str | None
    external_ip: str | None = None
    zone: str
    ssh_user: str | None = None
    # tpu-vm (reach with `gcloud compute tpus tpu-vm ssh --tunnel-through-iap`) or gce-vm (IAP SSH).
    kind: Literal["tpu-vm", "gce-vm"]
    instance_type: str
    # What the capacity is: spot and flex-start hosts (and TPU VMs) get the preemption drain.
    provisioning: Provisioning = "standard"
    accelerator: AcceleratorRecord
    router_port: int = Field(ge=1, le=65535)
    replicas: list[ReplicaRecord]

    @classmethod
    def for_plan(
        cls,
        plan: Plan,
        *,
        name: str,
        internal_ip: str | None,
        external_ip: str | None,
        zone: str,
        ssh_user: str | None,
        kind: str,
        instance_type: str,
        provisioning: str = "standard",
    ) -> HostRecord:
        return cls(
            name=name,
            internal_ip=internal_ip,
            external_ip=external_ip,
            zone=zone,
            ssh_user=ssh_user,
            kind=kind,
            instance_type=instance_type,
            provisioning=provisioning,
            accelerator=AcceleratorRecord(kind=plan.accelerator.name, count=plan.spec.accelerator.count),
            router_port=plan.router_port,
            replicas=[
                ReplicaRecord(
                    index=r.index, devices=r.devices, tensor_parallel_size=r.tensor_parallel_size, port=r.port
                )
                for r in plan.replicas
            ],
        )

    @property
    def capacity(self) -> HostCapacity:
        return HostCapacity(kind=self.kind, provisioning=self.provisioning)

    @property
    def address(self) -> str:
        """Where ssh reaches the host: its private address (hosts have no public IP by default)."""
        return self.internal_ip or self.name


def parse_host_records(data: Any, source: str) -> list[HostRecord]:
    """A stack's `hosts` output -> records; a malformed record is a SpecError naming its index and field."""
    if not isinstance(data, Sequence) or isinstance(data, str | bytes):
        raise SpecError([f"hosts = {data!r:.80}: must be a list of host records"], source)
    records, problems = [], []
    for index, item in enumerate(data):
        try:
            records.append(validate_model(HostRecord, item, source, prefix=(f"hosts[{index}]",)))
        except SpecError as error:
            problems += error.problems
    if problems:
        raise SpecError(problems, source)
    return records
