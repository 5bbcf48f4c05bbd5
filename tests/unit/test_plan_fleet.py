"""The fleet a host routes in (gemmaserve.plan.plan_fleet, gemmaserve.sources.fleet_from_host_data): which hosts, at
which addresses, with which ring ids, and the errors that name host, field, value and what is allowed."""

from __future__ import annotations

import pytest

from gemmaserve.plan import FLEET_ID_LIMIT, ROUTE_KEY_HEADER, fleet_host_id, plan, plan_fleet
from gemmaserve.sources import fleet_from_host_data, fleet_membership, spec_from_host_data
from gemmaserve.spec import SpecError, parse_spec


def spec(routing: str = "prefix-affinity", router_port: int = 8080, count: int = 2):
    return parse_spec(
        {
            "model": "tiny",
            "accelerator": {"kind": "cpu", "count": count},
            "workload": {"cpu_threads_bind": "nobind"},
            "serving": {"routing": routing, "router_port": router_port},
        }
    )


def problems(raised: pytest.ExceptionInfo) -> str:
    return "\n".join(raised.value.problems)


def test_a_fleet_lists_every_host_sorted_with_its_address_and_the_peer_port():
    fleet = plan_fleet("b", [("b", "10.0.0.3", spec()), ("a", "10.0.0.2", spec()), ("c", "10.0.0.4", spec())])
    assert [(m.name, m.address) for m in fleet.members] == [("a", "10.0.0.2"), ("b", "10.0.0.3"), ("c", "10.0.0.4")]
    assert fleet.own.name == "b" and fleet.own.address == "10.0.0.3"
    assert fleet.peer_port == 8081
    assert fleet.addresses == ["10.0.0.2", "10.0.0.3", "10.0.0.4"]
    assert fleet.to_json()["hosts"][0] == {"name": "a", "address": "10.0.0.2", "id": fleet_host_id("a")}


def test_every_host_computes_the_same_ring():
    members = [("a", "10.0.0.2", spec()), ("b", "10.0.0.3", spec()), ("c", "10.0.0.4", spec())]
    seen = {plan_fleet(name, list(reversed(members)) if name == "b" else members).members for name, _, _ in members}
    assert len(seen) == 1


def test_a_hosts_id_depends_on_its_name_alone():
    """A host that joins or leaves moves no other host's points on the ring."""
    three = plan_fleet("a", [("a", "10.0.0.2", spec()), ("b", "10.0.0.3", spec()), ("c", "10.0.0.4", spec())])
    two = plan_fleet("a", [("a", "10.0.0.2", spec()), ("c", "10.0.0.4", spec())])
    ids = {m.name: m.id for m in three.members}
    assert {m.name: m.id for m in two.members} == {"a": ids["a"], "c": ids["c"]}
    assert all(0 < m.id < FLEET_ID_LIMIT for m in three.members)


def test_two_names_on_one_id_get_distinct_ids(monkeypatch):
    monkeypatch.setattr("gemmaserve.plan.fleet_host_id", lambda name: 7)
    fleet = plan_fleet("a", [("a", "10.0.0.2", spec()), ("b", "10.0.0.3", spec())])
    assert [m.id for m in fleet.members] == [7, 8]


def test_one_host_or_least_outstanding_is_no_fleet():
    assert plan_fleet("a", [("a", "10.0.0.2", spec())]) is None
    assert plan_fleet("a", [("a", None, spec())]) is None
    least = spec("least-outstanding")
    assert plan_fleet("a", [("a", "10.0.0.2", least), ("b", "10.0.0.3", least)]) is None


def test_server_names_are_haproxy_names():
    fleet = plan_fleet("a b", [("a b", "10.0.0.2", spec()), ("c/d", "10.0.0.3", spec())])
    assert [m.server_name for m in fleet.members] == ["a_b", "c_d"]


@pytest.mark.parametrize(
    "address, expected",
    [
        (None, "b: gemmaserve_private_address = None: not an IPv4 address; allowed: the host's private IPv4 address"),
        ("gpu-b.internal", "b: gemmaserve_private_address = 'gpu-b.internal': not an IPv4 address"),
        ("fd00::3", "b: gemmaserve_private_address = 'fd00::3': not an IPv4 address"),
        ("10.0.0.2", "b: gemmaserve_private_address = '10.0.0.2': also a's; allowed: one address per host"),
    ],
)
def test_a_bad_or_shared_address_is_named(address, expected):
    with pytest.raises(SpecError) as raised:
        plan_fleet("a", [("a", "10.0.0.2", spec()), ("b", address, spec())])
    assert expected in problems(raised)
    assert raised.value.source == "fleet of a"


@pytest.mark.parametrize(
    "other, expected",
    [
        (spec(router_port=9090), "b: serving.router_port = 9090: differs from a's in one fleet; allowed: 8080"),
        (
            spec("least-outstanding"),
            "b: serving.routing = 'least-outstanding': differs from a's in one fleet; allowed: 'prefix-affinity'",
        ),
    ],
)
def test_hosts_of_one_fleet_share_the_serving_port_and_policy(other, expected):
    with pytest.raises(SpecError) as raised:
        plan_fleet("a", [("a", "10.0.0.2", spec()), ("b", "10.0.0.3", other)])
    assert expected in problems(raised)


def test_a_peer_port_on_a_replica_port_or_past_65535_is_refused():
    # router_port 7999 with replicas from 8000: the peer port 8000 is replica 0's.
    crowded = spec(router_port=7999)
    with pytest.raises(SpecError) as raised:
        plan_fleet("a", [("a", "10.0.0.2", crowded), ("b", "10.0.0.3", crowded)])
    assert "a: serving.router_port = 7999: its fleet peer port 8000 (router_port + 1)" in problems(raised)
    assert "allowed: a router_port whose next port is free" in problems(raised)
    top = spec(router_port=65535)
    with pytest.raises(SpecError) as raised:
        plan_fleet("a", [("a", "10.0.0.2", top), ("b", "10.0.0.3", top)])
    assert "its fleet peer port 65536" in problems(raised)


def test_the_plan_shows_the_peer_port():
    routing = plan(spec()).routing
    assert routing.peer_port == 8081
    assert "hosts of one fleet (host data gemmaserve_fleet) send each conversation to its host's port 8081" in (
        routing.describe()
    )
    assert "peer_port" not in routing.to_json()
    assert ROUTE_KEY_HEADER == "X-Gemmaserve-Route-Key"


# --- from host data -----------------------------------------------------------------------------------------------


def host_data(fleet: str | None = "prod", **more) -> dict:
    data = {
        "gemmaserve_model": "tiny",
        "gemmaserve_accelerator": {"kind": "cpu", "count": 2},
        "gemmaserve_workload": {"cpu_threads_bind": "nobind"},
        **more,
    }
    if fleet is not None:
        data["gemmaserve_fleet"] = fleet
    return data


def test_the_fleet_is_the_runs_hosts_with_the_same_fleet_name():
    hosts = [
        ("a", host_data(ssh_hostname="10.0.0.2")),
        ("b", host_data(gemmaserve_private_address="10.0.1.3", ssh_hostname="b.example")),
        ("c", host_data("staging", ssh_hostname="10.0.0.4")),
        ("d", host_data(None, ssh_hostname="10.0.0.5")),
    ]
    fleet = fleet_from_host_data("a", hosts)
    assert [(m.name, m.address) for m in fleet.members] == [("a", "10.0.0.2"), ("b", "10.0.1.3")]
    assert fleet_from_host_data("c", hosts) is None  # alone in its fleet
    assert fleet_from_host_data("d", hosts) is None  # in none
    # The host data parses as a spec (the new keys are known ones).
    spec_from_host_data(hosts[1][1], "b")


def test_the_address_defaults_to_an_ssh_hostname_that_is_an_address():
    assert fleet_membership(host_data(ssh_hostname="10.0.0.2"), "a") == ("prod", "10.0.0.2")
    assert fleet_membership(host_data(), "10.0.0.9") == ("prod", "10.0.0.9")
    assert fleet_membership(host_data(ssh_hostname="gpu-a.example"), "a") == ("prod", None)
    hosts = [("a", host_data(ssh_hostname="10.0.0.2")), ("b", host_data(ssh_hostname="gpu-b.example"))]
    with pytest.raises(SpecError) as raised:
        fleet_from_host_data("a", hosts)
    assert "b: gemmaserve_private_address = None: not an IPv4 address" in problems(raised)


@pytest.mark.parametrize(
    "data, expected",
    [
        (host_data(""), "gemmaserve_fleet = '': not a fleet name; allowed: a non-empty string"),
        (host_data(3), "gemmaserve_fleet = 3: not a fleet name"),
        (
            host_data(gemmaserve_private_address=167772162),
            "gemmaserve_private_address = 167772162: not a string; allowed: the host's private IPv4 address",
        ),
    ],
)
def test_bad_fleet_host_data_is_named(data, expected):
    with pytest.raises(SpecError) as raised:
        fleet_membership(data, "a")
    assert expected in problems(raised)
    assert raised.value.source == "host data of a"
