"""Each CrossGuard rule fires on a bad resource and stays quiet on the good ones every stack declares."""

from __future__ import annotations

import pytest
import rules
from pulumi_policy import (
    PolicyCustomTimeouts,
    PolicyResource,
    PolicyResourceOptions,
    ResourceValidationArgs,
    StackValidationArgs,
)

from tests.infra.conftest import HF_TOKEN, STACKS, run_program
from tests.infra.test_stacks import with_cloud

INSTANCE, FIREWALL, DYNAMIC = rules.INSTANCE, rules.FIREWALL, rules.DYNAMIC
LABELS = {"app": "gemmaserve", "managed-by": "pulumi", "stack": "gpu8"}


def options(protect: bool = False) -> PolicyResourceOptions:
    return PolicyResourceOptions(
        protect=protect,
        ignore_changes=[],
        delete_before_replace=None,
        aliases=[],
        custom_timeouts=PolicyCustomTimeouts(0, 0, 0),
        additional_secret_outputs=[],
    )


def validate(fn, resource_type: str, props: dict, protect: bool = False, config: dict | None = None) -> list[str]:
    found: list[str] = []
    args = ResourceValidationArgs(
        resource_type, props, f"urn:pulumi:s::p::{resource_type}::r", "r", options(protect), None, config or {}
    )
    fn(args, lambda message, urn=None: found.append(message))
    return found


def instance(**changes) -> dict:
    props = {
        "machineType": "a3-highgpu-8g",
        "labels": dict(LABELS),
        "networkInterfaces": [{"subnetwork": "s", "accessConfigs": []}],
        "scheduling": {"provisioningModel": "STANDARD", "onHostMaintenance": "TERMINATE"},
    }
    return {**props, **changes}


def queued(**changes) -> dict:
    return {
        "queued_resource_id": "q",
        "provisioning": "spot",
        "create_wait_seconds": 600,
        "enable_external_ips": False,
        "labels": dict(LABELS),
        **changes,
    }


def firewall(ranges, ports=("8080",), protocol="tcp") -> dict:
    allow = {"protocol": protocol, **({"ports": list(ports)} if ports is not None else {})}
    return {"direction": "INGRESS", "sourceRanges": list(ranges), "allows": [allow]}


# --- fires on bad inputs ------------------------------------------------------------------------


def test_external_ip_on_instance():
    bad = instance(networkInterfaces=[{"subnetwork": "s", "accessConfigs": [{}]}])
    assert validate(rules.validate_external_ip, INSTANCE, bad)
    assert not validate(rules.validate_external_ip, INSTANCE, bad, config={"allowExternalIp": True})


def test_external_ip_on_tpu():
    assert validate(rules.validate_external_ip, DYNAMIC, queued(enable_external_ips=True))


@pytest.mark.parametrize(
    "props",
    [
        firewall(["0.0.0.0/0"]),
        firewall(["10.0.0.0/8", "0.0.0.0/0"], ports=("8000-8100",)),
        firewall(["0.0.0.0/0"], ports=None),
        firewall(["::/0"], ports=("8080",)),
        firewall(["0.0.0.0/0"], ports=None, protocol="all"),
    ],
)
def test_world_serving_port(props):
    assert validate(rules.validate_world_serving_port, FIREWALL, props)


@pytest.mark.parametrize(
    "props",
    [
        firewall(["0.0.0.0/1", "128.0.0.0/1"]),  # the internet, in two halves
        firewall(["0.0.0.0/2", "64.0.0.0/2", "128.0.0.0/1"]),
        firewall(["8.0.0.0/5"]),  # 134 million public addresses
        firewall(["2000::/3"]),  # every global IPv6 unicast address
        {"direction": "INGRESS", "allows": [{"protocol": "tcp", "ports": ["8080"]}]},  # no source: 0.0.0.0/0
        {"allows": [{"protocol": "tcp", "ports": ["8080"]}]},  # direction defaults to INGRESS too
        firewall(["0.0.0.0/0"], protocol="6"),  # tcp by its IANA number
        firewall(["0.0.0.0/0"], protocol="TCP"),
        firewall(["0.0.0.0/0"], ports=("9000",)),  # a serving port other than the default
        firewall(["0.0.0.0/0"], ports=("443",)),
        firewall(["0.0.0.0/0"], ports=("22",)),
        firewall(["0.0.0.0/0"], ports=("8000",), protocol="udp"),
    ],
)
def test_every_way_of_opening_a_port_to_the_internet(props):
    assert validate(rules.validate_world_serving_port, FIREWALL, props)


def test_a_port_opened_to_the_internet_on_purpose_is_named_in_the_config():
    props = firewall(["0.0.0.0/1", "128.0.0.0/1"], ports=("443",))
    assert validate(rules.validate_world_serving_port, FIREWALL, props)
    assert not validate(rules.validate_world_serving_port, FIREWALL, props, config={"publicPorts": [443]})
    assert validate(
        rules.validate_world_serving_port, FIREWALL, firewall(["0.0.0.0/0"], ports=None), config={"publicPorts": [443]}
    )


def across(*named_props, public=()):
    return rules.check_world_port_across_rules(list(named_props), public)


def test_the_internet_split_over_several_rules_is_the_internet():
    """Each half of a /8 alone is below the bound (1/256 of the internet) and passes no-world-serving-port; together
    the two rules open the port to the whole /8."""
    low, high = firewall(["8.0.0.0/9"]), firewall(["8.128.0.0/9"])
    assert not validate(rules.validate_world_serving_port, FIREWALL, low)
    assert not validate(rules.validate_world_serving_port, FIREWALL, high)
    (problem,) = across(("low", low), ("high", high))
    assert "rules low, high together open tcp port 8080 to 8.0.0.0/9, 8.128.0.0/9" in problem
    # A rule opening every port counts on each port another rule opens.
    (problem,) = across(("all", firewall(["8.0.0.0/9"], ports=None)), ("high", high))
    assert "port 8080" in problem
    # Overlapping ranges meet where they overlap.
    assert across(("a", firewall(["8.0.0.0/9"], ports=("8000-8100",))), ("b", high))
    # Rules reaching different instances, other ports, a port opened on purpose: nothing to report.
    assert not across(("low", low), ("high", {**high, "targetTags": ["other"]}))
    assert not across(("low", low), ("high", firewall(["8.128.0.0/9"], ports=("9000",))))
    assert not across(("low", low), ("high", high), public=[8080])


def test_tagged_or_narrow_sources_are_not_the_internet():
    tagged = {"direction": "INGRESS", "sourceTags": ["lb"], "allows": [{"protocol": "tcp", "ports": ["8080"]}]}
    assert not validate(rules.validate_world_serving_port, FIREWALL, tagged)
    assert not validate(rules.validate_world_serving_port, FIREWALL, firewall(["10.0.0.0/8", "203.0.113.0/24"]))
    egress = {**firewall(["0.0.0.0/0"]), "direction": "EGRESS"}
    assert not validate(rules.validate_world_serving_port, FIREWALL, egress)


@pytest.mark.parametrize(
    "resource_type, props",
    [
        (INSTANCE, instance(scheduling={"provisioningModel": "FLEX_START"})),
        (INSTANCE, instance(scheduling={"provisioningModel": "FLEX_START", "maxRunDuration": {"seconds": 8 * 86400}})),
        (DYNAMIC, queued(provisioning="flex-start")),
        (DYNAMIC, queued(provisioning="flex-start", max_run_seconds=8 * 86400)),
        (DYNAMIC, queued(fallback_provisioning=["flex-start"])),
    ],
)
def test_flex_start_without_bounded_duration(resource_type, props):
    assert validate(rules.validate_flex_start_duration, resource_type, props)


@pytest.mark.parametrize("wait", [None, 6 * 3600 + 600])
def test_queued_resource_create_that_would_block_for_hours(wait):
    assert validate(rules.validate_bounded_create_wait, DYNAMIC, queued(create_wait_seconds=wait))


def test_api_disabled_on_destroy():
    service = "gcp:projects/service:Service"
    assert validate(rules.validate_api_kept_on_destroy, service, {"service": "tpu.googleapis.com"})
    assert not validate(
        rules.validate_api_kept_on_destroy, service, {"service": "tpu.googleapis.com", "disableOnDestroy": False}
    )


def test_unprotected_queued_resource():
    assert validate(rules.validate_queued_resource_protected, DYNAMIC, queued(), protect=False)
    assert not validate(rules.validate_queued_resource_protected, DYNAMIC, queued(), protect=True)


@pytest.mark.parametrize(
    "resource_type, props",
    [
        (INSTANCE, instance(labels={})),
        ("gcp:secretmanager/secret:Secret", {"secretId": "hf-token", "labels": {"app": "gemmaserve"}}),
        (DYNAMIC, queued(labels=None)),
        (
            "gcp:storage/bucket:Bucket",
            {"name": "team-weights", "labels": {"app": "gemmaserve", "managed-by": "pulumi"}},
        ),
    ],
)
def test_missing_labels(resource_type, props):
    assert validate(rules.validate_labels, resource_type, props)


def stack_outputs(outputs: dict) -> list[str]:
    found: list[str] = []
    stack = PolicyResource(
        "pulumi:pulumi:Stack", outputs, "urn:stack", "gemmaserve-gpu8", options(), None, None, [], {}
    )
    rules.validate_stack_outputs(StackValidationArgs([stack]), lambda message, urn=None: found.append(message))
    return found


@pytest.mark.parametrize(
    "outputs",
    [
        {"hf": HF_TOKEN},
        {"hosts": [{"name": "h", "env": {"HF_TOKEN": HF_TOKEN}}]},
        {"hfToken": "anything-at-all"},
        {"nested": {"secret_data": "value"}},
        {"tls": "-----BEGIN EC PRIVATE KEY-----\nMHc...\n-----END EC PRIVATE KEY-----\n"},
    ],
)
def test_plaintext_secret_in_outputs(outputs):
    assert stack_outputs(outputs)


@pytest.mark.parametrize(
    "resource_type",
    ["gcp:compute/regionTargetHttpProxy:RegionTargetHttpProxy", "gcp:compute/targetHttpProxy:TargetHttpProxy"],
)
def test_plaintext_endpoint_proxy(resource_type):
    assert validate(rules.validate_plaintext_proxy, resource_type, {"urlMap": "m"})


def test_multi_host_stack_passes_the_plaintext_endpoint_rule():
    run = run_program("gpu8", with_cloud("gpu8", hosts=2))
    assert run.of_type("gcp:compute/regionTargetHttpsProxy:RegionTargetHttpsProxy")
    assert not [r.name for r in run.resources if validate(rules.validate_plaintext_proxy, r.type, r.inputs)]


# --- quiet on good ------------------------------------------------------------------------------


def test_quiet_on_good_examples():
    assert not validate(rules.validate_external_ip, INSTANCE, instance())
    assert not validate(rules.validate_world_serving_port, FIREWALL, firewall(["35.235.240.0/20"], ports=("22",)))
    assert not validate(
        rules.validate_flex_start_duration, DYNAMIC, queued(provisioning="flex-start", max_run_seconds=3600)
    )
    assert not validate(rules.validate_labels, "gcp:compute/network:Network", {})
    assert not stack_outputs({"endpoint": "https://10.42.0.5:8080/v1", "secret_name": ""})
    assert not stack_outputs({"ca_cert": "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"})


def bucket_stack_config() -> dict:
    """gpu8 with its weights from a bucket the stack creates (issue 15)."""
    from tests.infra.conftest import stack_config

    config = stack_config("gpu8")
    config["gemmaserve:weights"] = {"source": "bucket", "bucket": "gs://team-weights", "revision": "0" * 40}
    return config


@pytest.mark.parametrize("stack", [*STACKS, "gpu8-with-bucket"])
def test_every_stack_passes_every_rule(stack):
    run = run_program("gpu8", bucket_stack_config()) if stack == "gpu8-with-bucket" else run_program(stack)
    if stack == "gpu8-with-bucket":
        assert run.of_type("gcp:storage/bucket:Bucket")
    resource_rules = [
        rules.validate_external_ip,
        rules.validate_world_serving_port,
        rules.validate_flex_start_duration,
        rules.validate_queued_resource_protected,
        rules.validate_bounded_create_wait,
        rules.validate_api_kept_on_destroy,
        rules.validate_labels,
        rules.validate_plaintext_proxy,
    ]
    for resource in run.resources:
        for rule in resource_rules:
            assert not validate(rule, resource.type, resource.inputs, protect=resource.protect), (resource.name, rule)
    assert not stack_outputs(run.outputs)
    firewalls = [(r.name, r.inputs) for r in run.of_type(FIREWALL)]
    assert firewalls and not rules.check_world_port_across_rules(firewalls)


def test_pack_lists_every_rule():
    names = {p.name for p in rules.POLICIES}
    assert names == {
        "no-external-ip",
        "no-world-serving-port",
        "flex-start-max-run-duration",
        "tpu-queued-resource-protected",
        "tpu-create-wait-bounded",
        "apis-kept-on-destroy",
        "labels-present",
        "no-plaintext-endpoint",
        "no-plaintext-secret-outputs",
        "no-world-port-across-rules",
    }
