"""TpuSlice: one TPU slice bought through a queued resource, with the stack's network and identity."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pulumi
from config import CLOUD_PLATFORM_SCOPE
from tpu_queued_resource import TpuQueuedResource


@dataclass
class TpuSliceArgs:
    project: str
    zones: tuple[str, ...]
    accelerator_type: str
    runtime_version: str
    provisioning: str
    network: pulumi.Input[str]
    subnetworks: dict[str, pulumi.Input[str]]
    service_account: pulumi.Input[str]
    reservation: str | None = None
    max_run_seconds: int | None = None
    valid_until_seconds: int | None = None
    valid_after: str | None = None
    enable_external_ips: bool = False
    labels: dict[str, str] = field(default_factory=dict)
    tags: list[str] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)
    # Never destroy active queued resources by accident: a replacement can take hours to provision.
    protect: bool = True


class TpuSlice(pulumi.ComponentResource):
    """A queued resource (dynamic provider) and the node it yields: zone, internal IP, state."""

    def __init__(self, name: str, args: TpuSliceArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gemmaserve:gcp:TpuSlice", name, None, opts)
        props: dict[str, Any] = {
            "project": args.project,
            "zones": list(args.zones),
            "queued_resource_id": f"{name}-qr",
            "node_id": f"{name}-qr-node",
            "accelerator_type": args.accelerator_type,
            "runtime_version": args.runtime_version,
            "provisioning": args.provisioning,
            "reservation": args.reservation,
            "max_run_seconds": args.max_run_seconds,
            "valid_until_seconds": args.valid_until_seconds,
            "valid_after": args.valid_after,
            "network": args.network,
            "subnetworks": args.subnetworks,
            "service_account": args.service_account,
            "scopes": [CLOUD_PLATFORM_SCOPE],
            "labels": args.labels,
            "tags": args.tags,
            "metadata": args.metadata,
            "enable_external_ips": args.enable_external_ips,
            "wait_timeout_seconds": (args.valid_until_seconds or 3 * 3600) + 600,
        }
        self.queued_resource = TpuQueuedResource(
            f"{name}-qr", props, pulumi.ResourceOptions(parent=self, protect=args.protect)
        )
        self.node_name = pulumi.Output.from_input(props["node_id"])
        self.zone = self.queued_resource.zone
        self.internal_ip = self.queued_resource.internal_ip
        self.external_ip = self.queued_resource.external_ip
        self.register_outputs({"zone": self.zone, "internal_ip": self.internal_ip, "state": self.queued_resource.state})
