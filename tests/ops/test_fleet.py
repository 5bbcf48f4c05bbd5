"""ops.fleet reads pyinfra's own report of a run (--json): the results of a run and the changes a dry run detects,
from the real pyinfra CLI deploying to this machine (@local) inside a scratch folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gemmaserve.ops import fleet
from gemmaserve.ops.fleet import PyinfraRun
from tests import ROOT

# Three operations: one that changes the host on a first run, one that runs only if that one changed (a
# conditional change in a dry run), one that never changes anything.
SCRATCH_DEPLOY = """
from pyinfra import host
from pyinfra.operations import files, server

made = files.directory(name="Make the scratch folder", path=host.data.folder)
server.shell(name="Announce the new folder", commands=["true"], _if=made.did_change)
files.directory(name="Keep /tmp", path="/tmp")
"""


@pytest.fixture
def scratch(tmp_path):
    """(inventory, deploy): this machine as @local, with a folder under tmp_path to make."""
    inventory, deploy = tmp_path / "local.py", tmp_path / "scratch_deploy.py"
    inventory.write_text(f"local = [('@local', {{'folder': {str(tmp_path / 'made')!r}}})]\n")
    deploy.write_text(SCRATCH_DEPLOY)
    return inventory, deploy


def test_a_dry_run_proposes_only_unconditional_changes_and_has_no_results(scratch) -> None:
    dry = fleet.run_pyinfra(*scratch, dry=True, timeout=120)
    assert dry.ok, dry.output[-2000:]
    assert dry.proposed_changes() == ["Make the scratch folder"]
    with pytest.raises(ValueError, match="no results in pyinfra's --json report"):
        dry.totals()
    assert "Make the scratch folder" in dry.output  # the log and the report, as pyinfra printed them


def test_totals_count_operations_and_changes_of_a_run_and_its_rerun(scratch, tmp_path) -> None:
    first = fleet.run_pyinfra(*scratch, timeout=120)
    assert first.ok and (tmp_path / "made").is_dir(), first.output[-2000:]
    assert first.totals() == (3, 2)
    second = fleet.run_pyinfra(*scratch, timeout=120)
    assert second.ok and second.totals() == (3, 0), second.output[-2000:]


def test_a_run_without_a_report_is_an_error_not_zeros(scratch) -> None:
    inventory, deploy = scratch
    deploy.write_text("raise RuntimeError('a deploy that raises')\n")
    run = fleet.run_pyinfra(inventory, deploy, timeout=120)
    assert not run.ok and run.report is None and "a deploy that raises" in run.output
    with pytest.raises(ValueError, match="no results in pyinfra's --json report"):
        run.totals()
    with pytest.raises(ValueError, match="no plan in pyinfra's --json report"):
        run.proposed_changes()
    with pytest.raises(ValueError, match="no results"):
        PyinfraRun(0, "", 1.0, {"plan": [], "results": None}).totals()


INVENTORY = """
web = [("gpu-1", {"ssh_port": 2201}), ("gpu-10", {}), ("gpu-101", {})]
db = [("db-1", {})]
"""


LIMITS = [["gpu-1"], ["gpu-10"], ["gpu-1*"], ["db"], ["gpu-1", "db"], ["*-1"]]

# pyinfra's own `--limit` matcher (its CLI's), the oracle; in a child interpreter, as fleet.load reads
# inventories, because importing pyinfra_cli monkey-patches the whole process for gevent. One child answers
# every limit (a JSON list of pattern lists in argv[3]): each import of pyinfra costs about a second.
ORACLE = """
import json, sys
from pyinfra.api import State
from pyinfra.context import ctx_state
from pyinfra_cli.cli import _get_inventory_pattern_matches
from pyinfra_cli.inventory import make_inventory

ctx_state.set(State())
inventory = make_inventory(sys.argv[1], cwd=sys.argv[2])
picks = []
for patterns in json.loads(sys.argv[3]):
    picked = set(_get_inventory_pattern_matches(inventory, patterns, "--limit"))
    picks.append([host.name for host in inventory if host in picked])
print(json.dumps(picks))
"""


@pytest.fixture(scope="module")
def inventory(tmp_path_factory):
    path = tmp_path_factory.mktemp("inventory") / "inventory.py"
    path.write_text(INVENTORY)
    return path


@pytest.fixture(scope="module")
def pyinfra_limits(inventory) -> dict[tuple[str, ...], list[str]]:
    """The hosts pyinfra's `--limit` picks for each of LIMITS, in inventory order."""
    command = [sys.executable, "-c", ORACLE, str(inventory), str(ROOT), json.dumps(LIMITS)]
    picks = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
    return {tuple(patterns): hosts for patterns, hosts in zip(LIMITS, picks, strict=True)}


@pytest.fixture(scope="module")
def every_host(inventory) -> list[str]:
    return [h.name for h in fleet.load(inventory)]


@pytest.mark.parametrize("patterns", LIMITS)
def test_limit_picks_what_pyinfras_limit_picks(inventory, pyinfra_limits, every_host, patterns) -> None:
    """`--limit sandbox-1` once ran the verify suite on sandbox-101 and -102 too (pytest's -k matched a
    substring); a limit picks exactly the hosts pyinfra would deploy to, with their host data."""
    hosts = fleet.load(inventory, patterns)
    assert [h.name for h in hosts] == pyinfra_limits[tuple(patterns)]
    if patterns == ["gpu-1"]:
        assert [(h.name, h.data["ssh_port"]) for h in hosts] == [("gpu-1", 2201)]
    assert every_host == ["gpu-1", "gpu-10", "gpu-101", "db-1"]


def test_a_limit_that_picks_nothing_is_an_error_naming_the_hosts(tmp_path) -> None:
    path = tmp_path / "inventory.py"
    path.write_text(INVENTORY)
    with pytest.raises(fleet.InventoryError) as caught:
        fleet.load(path, ["gpu-1", "gpu-2"])
    assert "--limit 'gpu-2'" in str(caught.value) and "gpu-1, gpu-10, gpu-101, db-1" in str(caught.value)


CONNECT_TWICE = """
import json, sys
from gemmaserve.ops.fleet import FleetHost

data = {"ssh_hostname": "10.231.9.2", "ssh_user": "root", "ssh_strict_host_key_checking": "off"}
configs = [FleetHost(name, data).connect().backend.ssh_config for name in ("a", "b")]
print(json.dumps([configs, open(configs[0]).read()]))
"""


def test_hosts_without_host_key_checking_share_one_ssh_config_removed_at_exit(tmp_path) -> None:
    """Connections to hosts that turn host-key checking off (the sandbox) read one ssh config file per
    process, and the process removes it when it exits (no connection is made: paramiko connects lazily)."""
    environ = {**os.environ, "TMPDIR": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-c", CONNECT_TWICE], capture_output=True, text=True, env=environ, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-2000:]
    (first, second), text = json.loads(result.stdout)
    assert first == second and first.startswith(str(tmp_path)) and "StrictHostKeyChecking no" in text
    assert list(tmp_path.iterdir()) == []


# --- an endpoint's client credentials ---------------------------------------------------------------

GPU8_DATA = {"gemmaserve_model": "e2b", "gemmaserve_accelerator": {"kind": "cpu"}}


def client_host(tmp_path, **credentials) -> fleet.FleetHost:
    data = {**GPU8_DATA, "ssh_hostname": "10.0.0.5", fleet.CLIENT_CREDENTIALS_KEY: credentials}
    return fleet.FleetHost("h1", data)


def test_a_hosts_client_credentials_are_used_when_the_operator_names_none(tmp_path) -> None:
    key_file = tmp_path / "api-key"
    key_file.write_text("gsk-from-the-file\n")
    host = client_host(tmp_path, ca_cert="/etc/ca.pem", api_key_file=str(key_file))
    endpoint = host.endpoint(environ={})
    assert endpoint.base_url == f"https://10.0.0.5:{host.plan.router_port}/v1"
    assert (endpoint.credentials.api_key, endpoint.credentials.ca_cert) == ("gsk-from-the-file", "/etc/ca.pem")
    # The operator's key and CA win; a key file not there (yet) is no key, as with none named.
    named = host.endpoint(environ={"GEMMASERVE_API_KEY": "gsk-mine", "GEMMASERVE_CA_CERT": "/mine.pem"})
    assert (named.credentials.api_key, named.credentials.ca_cert) == ("gsk-mine", "/mine.pem")
    key_file.unlink()
    assert fleet.FleetHost("h1", dict(host.data)).endpoint(environ={}).credentials.api_key is None
    assert fleet.FleetHost("h1", GPU8_DATA).endpoint(environ={}).credentials.ca_cert is None


def test_a_hosts_client_credentials_are_validated(tmp_path) -> None:
    from gemmaserve.sources import spec_from_host_data
    from gemmaserve.spec import SpecError

    good = client_host(tmp_path, ca_cert="/ca.pem", api_key_file="/key")
    assert spec_from_host_data(good.data, "h1").accelerator.kind == "cpu"  # an allowed host data key
    for credentials, problem in (
        ({"ca_cert": "ca.pem", "api_key_file": "/key"}, "must be an absolute path"),
        ({"ca_cert": "/ca.pem"}, "api_key_file"),
        ({"ca_cert": "/ca.pem", "api_key_file": "/key", "api_key": "gsk-x"}, "api_key"),
    ):
        with pytest.raises(SpecError) as caught:
            client_host(tmp_path, **credentials).endpoint(environ={})
        assert "host data of h1" in str(caught.value) and problem in str(caught.value), caught.value


def test_the_project_is_the_nearest_directory_holding_deploy_py(tmp_path):
    """pyinfra runs in the project directory, found from the working directory up (not from where the package is
    installed); outside any project it is the working directory itself."""
    assert fleet.project_dir(ROOT / "docs") == ROOT == fleet.project_dir(ROOT)
    (tmp_path / "deploy.py").write_text("")
    (tmp_path / "hosts").mkdir()
    assert fleet.project_dir(tmp_path / "hosts") == tmp_path.resolve()
    (tmp_path / "deploy.py").unlink()
    assert fleet.project_dir(tmp_path / "hosts") == (tmp_path / "hosts").resolve()
