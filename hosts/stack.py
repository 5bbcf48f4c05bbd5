"""pyinfra inventory from a Pulumi stack's `hosts` output, with the stack's spec as host data.

    GEMMASERVE_STACK=tpu-v6e4 pyinfra hosts/stack.py deploy.py

Host records (gemmaserve.records.HostRecord) come from `pulumi stack output hosts --json --stack STACK`,
or, offline, from the JSON file in GEMMASERVE_HOSTS_JSON (the same output saved earlier). Hosts have no
public IP: run from a machine on the VPC, or set GEMMASERVE_SSH_PROXY to an ssh ProxyCommand (for
example an IAP tunnel: `gcloud compute start-iap-tunnel %h 22 --listen-on-stdin --zone ZONE`).
"""

import json
import os
import subprocess
from pathlib import Path

from gemmaserve.records import parse_host_records
from gemmaserve.sources import stack_host_data

STACK = os.environ.get("GEMMASERVE_STACK")
if not STACK:
    raise SystemExit("hosts/stack.py: set GEMMASERVE_STACK to a stack name (e.g. tpu-v6e4)")

PROJECT = Path(__file__).resolve().parents[1]


def _records():
    saved = os.environ.get("GEMMASERVE_HOSTS_JSON")
    if saved:
        return parse_host_records(json.loads(Path(saved).read_text()), saved)
    output = subprocess.run(
        ["pulumi", "stack", "output", "hosts", "--json", "--stack", STACK],
        cwd=PROJECT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return parse_host_records(json.loads(output), f"stack {STACK} output hosts")


_spec_data = stack_host_data(STACK, PROJECT)
_proxy = os.environ.get("GEMMASERVE_SSH_PROXY")

serving = [
    (
        record.name,
        {
            "ssh_hostname": record.address,
            **({"ssh_user": record.ssh_user} if record.ssh_user else {}),
            **({"ssh_proxy_command": _proxy.replace("%h", record.name).replace("ZONE", record.zone)} if _proxy else {}),
            "_sudo": True,
            # Spot / flex-start hosts and TPU VMs get the preemption drain (roles/preemption).
            "gemmaserve_capacity": record.capacity.model_dump(),
            # A stack's hosts route as one behind its load balancer (docs/routing.md#across-hosts).
            "gemmaserve_fleet": STACK,
            **({"gemmaserve_private_address": record.internal_ip} if record.internal_ip else {}),
            **_spec_data,
        },
    )
    for record in _records()
]
