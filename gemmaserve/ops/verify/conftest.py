"""The verification suite's hosts: every host of --inventory, with the plan its host data produces.

Expectations come from the plan, so the same tests check the sandbox in CI and a production host.
"""

from __future__ import annotations

import pytest

from gemmaserve.ops import fleet
from gemmaserve.ops.endpoint import API_KEY_ENV, CA_CERT_ENV


def pytest_addoption(parser) -> None:
    parser.addoption("--inventory", default=None, help="pyinfra inventory of the hosts to verify (e.g. hosts/gpu8.py)")
    parser.addoption(
        "--limit",
        action="append",
        default=[],
        help="only these hosts: a group name or a glob on host names, as pyinfra's --limit (repeatable)",
    )


def _hosts(config):
    inventory = config.getoption("--inventory")
    if not inventory:
        raise pytest.UsageError("give --inventory: the pyinfra inventory of the hosts to verify")
    try:
        hosts = fleet.load(inventory, config.getoption("--limit"))
    except fleet.InventoryError as error:
        raise pytest.UsageError(str(error)) from None
    return [(host.name, host, host.plan) for host in hosts]


def pytest_generate_tests(metafunc) -> None:
    """Parametrize per host, and per replica where a test asks for `replica`."""
    if "target" not in metafunc.fixturenames:
        return
    hosts = _hosts(metafunc.config)
    if not hosts:
        raise pytest.UsageError(f"{metafunc.config.getoption('--inventory')}: the inventory has no hosts")
    if "replica" in metafunc.fixturenames:
        cases = [((name, data, plan), r) for name, data, plan in hosts for r in plan.replicas]
        metafunc.parametrize(
            "target,replica", cases, ids=[f"{c[0][0]}-replica{c[1].index}" for c in cases], indirect=["target"]
        )
    else:
        metafunc.parametrize("target", hosts, ids=[h[0] for h in hosts], indirect=True)


class Target:
    def __init__(self, name, fleet_host, plan):
        self.name, self.data, self.plan = name, fleet_host.data, plan
        self.host = fleet_host.connect()
        # The endpoint is checked from here, as a client calls it: TLS verified against GEMMASERVE_CA_CERT
        # (else the system's store), with the key in GEMMASERVE_API_KEY (a sandbox host has its own).
        self.endpoint = fleet_host.endpoint()

    def call(self, path: str, payload: dict | None = None, **options) -> tuple[int, str]:
        """(status, body) through the host's load balancer; fails clearly without a key to call it with."""
        if self.endpoint.credentials.api_key is None and options.get("key", "") == "":
            pytest.fail(f"set {API_KEY_ENV} (and {CA_CERT_ENV}) to check the endpoint of {self.name}", pytrace=False)
        return self.endpoint.request(path, payload, **options)

    def replica_get(self, replica, path: str) -> tuple[int, str]:
        """GET a replica's own route on the host (loopback), where Prometheus scrapes it."""
        out = self.host.run(f"curl -s -m 30 -w '\\n%{{http_code}}' {replica.url}{path}").stdout
        body, _, code = out.rpartition("\n")
        return int(code or 0), body


_TARGETS: dict[str, Target] = {}


@pytest.fixture
def target(request) -> Target:
    name, data, plan = request.param
    if name not in _TARGETS:
        _TARGETS[name] = Target(name, data, plan)
    return _TARGETS[name]
