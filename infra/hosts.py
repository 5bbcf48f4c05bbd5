"""The `hosts` output: plain records (like SkyPilot's InstanceInfo) that the inventories in hosts/ read."""

from __future__ import annotations

from typing import Any

import pulumi

from gemmaserve.plan import Plan


def replica_plan(serving_plan: Plan) -> list[dict[str, Any]]:
    """Which devices and port each replica gets: enough for an inventory; the full argv is in `plan`."""
    return [
        {"index": r.index, "devices": r.devices, "tensor_parallel_size": r.tensor_parallel_size, "port": r.port}
        for r in serving_plan.replicas
    ]


def host_record(
    name: pulumi.Input[str],
    internal_ip: pulumi.Input[str],
    external_ip: pulumi.Input[str | None],
    zone: pulumi.Input[str],
    ssh_user: str,
    kind: str,
    instance_type: str,
    serving_plan: Plan,
) -> pulumi.Output[dict[str, Any]]:
    accelerator = {"kind": serving_plan.accelerator.name, "count": serving_plan.spec.accelerator.count}
    return pulumi.Output.all(name, internal_ip, external_ip, zone).apply(
        lambda v: {
            "name": v[0],
            "internal_ip": v[1],
            "external_ip": v[2],
            "zone": v[3],
            "ssh_user": ssh_user,
            # tpu-vm (reach over `gcloud compute tpus tpu-vm ssh --tunnel-through-iap`) or gce-vm (IAP SSH).
            "kind": kind,
            "instance_type": instance_type,
            "accelerator": accelerator,
            "router_port": serving_plan.router_port,
            "replicas": replica_plan(serving_plan),
        }
    )
