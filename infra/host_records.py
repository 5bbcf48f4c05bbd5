"""The `hosts` output: one typed HostRecord per serving host (gemmaserve.records), read back by hosts/stack.py."""

from __future__ import annotations

from typing import Any

import pulumi

from gemmaserve.plan import Plan
from gemmaserve.records import HostRecord


def host_record(
    name: pulumi.Input[str],
    internal_ip: pulumi.Input[str],
    external_ip: pulumi.Input[str | None],
    zone: pulumi.Input[str],
    ssh_user: str,
    kind: str,
    instance_type: str,
    serving_plan: Plan,
    provisioning: pulumi.Input[str] = "standard",
) -> pulumi.Output[dict[str, Any]]:
    """The record as the stack exports it (JSON); validated by the same model that reads it back."""
    return pulumi.Output.all(name, internal_ip, external_ip, zone, provisioning).apply(
        lambda v: HostRecord.for_plan(
            serving_plan,
            name=v[0],
            internal_ip=v[1],
            external_ip=v[2],
            zone=v[3],
            ssh_user=ssh_user,
            kind=kind,
            instance_type=instance_type,
            provisioning=v[4],
        ).model_dump(mode="json")
    )
