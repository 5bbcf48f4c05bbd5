"""TpuSlice: one TPU slice bought through a queued resource, with the stack's network and identity."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pulumi

from gemmaserve.cloud.config import CLOUD_PLATFORM_SCOPE
from gemmaserve.cloud.tpu_queued_resource import TpuQueuedResource


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
    # Tried after every zone failed with `provisioning` (e.g. reserved -> spot -> flex-start).
    fallback_provisioning: tuple[str, ...] = ()
    # The zones that sell flex-start for this TPU; flex-start is asked for only there (None: every zone).
    flex_start_zones: tuple[str, ...] | None = None
    reservation: str | None = None
    max_run_seconds: int | None = None
    valid_until_seconds: int | None = None
    valid_after: str | None = None
    enable_external_ips: bool = False
    # The node's data disk for weights, engine and caches, {type, size_gb} (Settings.tpu_data_disk); None: none.
    data_disk: dict[str, Any] | None = None
    labels: dict[str, str] = field(default_factory=dict)
    tags: list[str] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)
    # `pulumi up` returns after this with the request's state; the queue goes on (gemmaserve capacity wait).
    create_wait_seconds: int = 600
    # Flex-start: re-queue this long before the run duration ends.
    recycle_before_seconds: int = 1800
    # Never destroy or replace a slice by accident: a new one can take hours to provision. In-place
    # changes (labels, re-queueing a dead request) are updates, which protection allows.
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
            "fallback_provisioning": list(args.fallback_provisioning),
            "flex_start_zones": None if args.flex_start_zones is None else list(args.flex_start_zones),
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
            "data_disk": args.data_disk,
            "create_wait_seconds": args.create_wait_seconds,
            "recycle_before_seconds": args.recycle_before_seconds,
        }
        self.queued_resource = TpuQueuedResource(
            f"{name}-qr",
            props,
            pulumi.ResourceOptions(parent=self, protect=args.protect, depends_on=opts.depends_on if opts else None),
        )
        self.node_name = self.queued_resource.node_name.apply(lambda n: n.rsplit("/", 1)[-1] if n else props["node_id"])
        self.zone = self.queued_resource.zone
        self.provisioning = self.queued_resource.provisioning_model
        self.state = self.queued_resource.state
        self.internal_ip = self.queued_resource.internal_ip
        self.external_ip = self.queued_resource.external_ip
        self.register_outputs({"zone": self.zone, "internal_ip": self.internal_ip, "state": self.state})
