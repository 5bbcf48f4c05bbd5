"""The firewall of a multi-host stack opens each host's fleet peer port to the stack's hosts only
(docs/routing.md#across-hosts); a single-host stack opens none."""

from __future__ import annotations

from gemmaserve.plan import fleet_peer_port
from tests.infra.conftest import run_program, stack_config

FIREWALL = "gcp:compute/firewall:Firewall"


def with_hosts(stack: str, hosts: int) -> dict:
    config = stack_config(stack)
    config["gemmaserve:cloud"] = {**config["gemmaserve:cloud"], "hosts": hosts}
    return config


def test_a_multi_host_stack_opens_the_peer_port_between_its_hosts_only():
    run = run_program("gpu8", with_hosts("gpu8", 2))
    rules = [r.inputs for r in run.of_type(FIREWALL) if r.name.endswith("-fleet-peers")]
    assert len(rules) == 1
    rule = rules[0]
    assert rule["allows"] == [{"protocol": "tcp", "ports": [str(fleet_peer_port(8080))]}]
    assert rule["sourceTags"] == rule["targetTags"] == ["gemmaserve-host"]
    assert not rule.get("sourceRanges")
    # No other rule opens the peer port.
    others = [r.inputs for r in run.of_type(FIREWALL) if not r.name.endswith("-fleet-peers")]
    assert all("8081" not in allow["ports"] for r in others for allow in r["allows"])


def test_a_single_host_stack_opens_no_peer_port():
    run = run_program("gpu8", stack_config("gpu8"))
    assert not [r for r in run.of_type(FIREWALL) if r.name.endswith("-fleet-peers")]
