"""The verification suite's hosts: every host of --inventory, with the plan its host data produces.

Expectations come from the plan, so the same tests check the sandbox in CI and a production host.
"""

from __future__ import annotations

import pytest

from gemmaserve.hostdata import spec_from_host_data
from gemmaserve.plan import plan
from gemmaserve.status import _connection, inventory_hosts


def _hosts(config):
    return [
        (name, data, plan(spec_from_host_data(data, name)).require_ok())
        for name, data in inventory_hosts(config.getoption("--inventory"))
    ]


def pytest_generate_tests(metafunc) -> None:
    """Parametrize per host, and per replica where a test asks for `replica`."""
    if "target" not in metafunc.fixturenames:
        return
    hosts = _hosts(metafunc.config)
    if not hosts:
        raise pytest.UsageError(f"{metafunc.config.getoption('--inventory')}: the inventory has no hosts")
    if "replica" in metafunc.fixturenames:
        cases = [((name, data, serving), r) for name, data, serving in hosts for r in serving.replicas]
        metafunc.parametrize(
            "target,replica", cases, ids=[f"{c[0][0]}-replica{c[1].index}" for c in cases], indirect=["target"]
        )
    else:
        metafunc.parametrize("target", hosts, ids=[h[0] for h in hosts], indirect=True)


class Target:
    def __init__(self, name, data, serving):
        self.name, self.data, self.plan = name, data, serving
        self.host = _connection(name, data)

    @property
    def router(self) -> str:
        return f"http://127.0.0.1:{self.plan.router_port}"

    def curl(self, path: str, payload: str | None = None) -> tuple[int, str]:
        data = f" -H 'Content-Type: application/json' --data @- <<'EOF'\n{payload}\nEOF" if payload else ""
        out = self.host.run(f"curl -s -m 120 -w '\\n%{{http_code}}' {self.router}{path}{data}").stdout
        body, _, code = out.rpartition("\n")
        return int(code or 0), body


_TARGETS: dict[str, Target] = {}


@pytest.fixture
def target(request) -> Target:
    name, data, serving = request.param
    if name not in _TARGETS:
        _TARGETS[name] = Target(name, data, serving)
    return _TARGETS[name]
