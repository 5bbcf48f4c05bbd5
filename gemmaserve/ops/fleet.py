"""The fleet as an operator sees it: the hosts of a pyinfra inventory, each with its validated plan and an ssh
connection, and the one way every command and test runs pyinfra against them."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatch
from functools import cache, cached_property
from pathlib import Path
from typing import Any

from pydantic import field_validator

from gemmaserve.plan import Plan, plan
from gemmaserve.sources import spec_from_host_data
from gemmaserve.spec import Strict, validate_model

# Relative to the project directory (project_dir).
DEFAULT_INVENTORY = "hosts/sandbox.py"
DEPLOY = "deploy.py"


def project_dir(start: Path | None = None) -> Path:
    """The project pyinfra runs in, as pyinfra's own CLI does in its working directory: the nearest directory
    from the working directory up that holds deploy.py (the checkout, run from any folder in it, as git finds
    its repository), else the working directory itself."""
    here = (start or Path.cwd()).resolve()
    return next((folder for folder in (here, *here.parents) if (folder / DEPLOY).is_file()), here)


# Host data naming an endpoint's client credentials, for inventories whose hosts have their own (the sandbox's).
CLIENT_CREDENTIALS_KEY = "gemmaserve_client_credentials"


class ClientCredentials(Strict):
    """Where a client of a host finds its credentials: files on the operator's machine, never the key itself
    (host data is printed and logged)."""

    ca_cert: str  # PEM of the CA that signs the host's certificate
    api_key_file: str  # one API key on its first line, readable by the operator only

    @field_validator("ca_cert", "api_key_file")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not Path(value).is_absolute():
            raise ValueError(f"{value!r}: must be an absolute path")
        return value

    def api_key(self) -> str | None:
        """The key in api_key_file; None while the file is absent (as with no key set at all)."""
        try:
            return Path(self.api_key_file).read_text().strip() or None
        except FileNotFoundError:
            return None


@dataclass(frozen=True)
class FleetHost:
    """One host of an inventory: its name, its host data (group data merged, as pyinfra sees it) and its plan."""

    name: str
    data: Mapping[str, Any] = field(repr=False)

    @cached_property
    def plan(self) -> Plan:
        """The plan its host data produces; bad host data raises SpecError naming host, field and value."""
        return plan(spec_from_host_data(self.data, self.name)).require_ok()

    @property
    def address(self) -> str:
        """The name or address the operator reaches this host by (ssh_hostname, else the inventory name)."""
        return str(self.data.get("ssh_hostname") or self.name)

    def endpoint(self, environ: Mapping[str, str] = os.environ):
        """This host's load balancer as a client calls it: https://ADDRESS:ROUTER_PORT/v1 with the API key and CA
        from GEMMASERVE_API_KEY / GEMMASERVE_CA_CERT; a sandbox host falls back to the sandbox's own."""
        from gemmaserve.ops.endpoint import Credentials, Endpoint

        credentials = Credentials.from_env(environ)
        client = self.client_credentials
        if credentials.api_key is None and client is not None:
            credentials = Credentials(client.api_key(), client.ca_cert)
        return Endpoint(f"https://{self.address}:{self.plan.router_port}/v1", credentials)

    @cached_property
    def client_credentials(self) -> ClientCredentials | None:
        """Host data `gemmaserve_client_credentials`, validated: the key and CA a client of this host uses when
        the operator names none (the sandbox's inventory sets them to the sandbox's own); None where unset."""
        value = self.data.get(CLIENT_CREDENTIALS_KEY)
        if value is None:
            return None
        return validate_model(
            ClientCredentials,
            value,
            f"host data of {self.name}",
            prefix=(CLIENT_CREDENTIALS_KEY,),
            expected="with ca_cert and api_key_file",
        )

    def connect(self):
        """A testinfra host over ssh (paramiko), with the address, user, port and key pyinfra would use."""
        import testinfra

        user = self.data.get("ssh_user")
        target = f"{user}@{self.address}" if user else self.address
        if self.data.get("ssh_port"):
            target += f":{self.data['ssh_port']}"
        options: dict[str, Any] = {"ssh_identity_file": self.data["ssh_key"]} if self.data.get("ssh_key") else {}
        if str(self.data.get("ssh_strict_host_key_checking", "")).lower() in ("off", "no", "false"):
            # Inventories that turn host-key checking off (the sandbox regenerates keys on every boot).
            options["ssh_config"] = _no_host_key_checking_config()
        return testinfra.get_host(f"paramiko://{target}", **options)


@cache
def _no_host_key_checking_config() -> str:
    """The ssh config paramiko reads for such hosts: one file per process, removed when the process exits
    (one per connection once left a directory in /tmp for every host every command reached)."""
    directory = tempfile.mkdtemp(prefix="gemmaserve-ssh-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    config = Path(directory) / "config"
    config.write_text("Host *\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n")
    return str(config)


def run_with_secret(target, command: str, secret: str, timeout: float = 3600) -> tuple[int, str, str]:
    """Run `command` on a testinfra host (paramiko) with `secret` on its standard input, so the secret
    never appears in a command line, an environment the host's ssh daemon logs, or a file; the command
    reads it (e.g. `IFS= read -r OPENAI_API_KEY`). Returns (exit status, stdout, stderr)."""
    transport = target.backend.client.get_transport()
    channel = transport.open_session(timeout=60)
    channel.settimeout(timeout)
    channel.exec_command(command)
    channel.sendall((secret + "\n").encode())
    channel.shutdown_write()
    stdout = b"".join(channel.makefile("rb"))
    stderr = b"".join(channel.makefile_stderr("rb"))
    return channel.recv_exit_status(), stdout.decode(errors="replace"), stderr.decode(errors="replace")


def load(inventory: str | Path = DEFAULT_INVENTORY, limit: Iterable[str] = ()) -> list[FleetHost]:
    """Every host of a pyinfra inventory file, read by pyinfra's own inventory loader; with `limit`, the hosts
    pyinfra's `--limit` would pick (each pattern a group name, else a glob on host names), in inventory order.
    A pattern that picks no host is an error: a command that checks nothing must not look like a pass.

    The loader runs in a child interpreter: importing pyinfra's CLI package monkey-patches the whole
    process for gevent, which must not happen to a process that already runs threads (pytest, paramiko).
    """
    path, project = Path(inventory), project_dir()
    if not path.is_absolute():
        path = (Path.cwd() / path) if (Path.cwd() / path).exists() else project / path
    if not path.is_file():
        raise FileNotFoundError(f"--inventory {inventory}: no such inventory file")
    limit = list(limit)
    result = subprocess.run(
        [sys.executable, "-m", "gemmaserve.ops.fleet", str(path), *limit], cwd=project, capture_output=True, text=True
    )
    if result.returncode == NO_MATCH_EXIT:
        raise InventoryError(f"{inventory}: {result.stderr.strip()}")
    if result.returncode:
        raise InventoryError(f"{inventory}: pyinfra could not load it:\n{result.stderr.strip()[-2000:]}")
    return [FleetHost(name, data) for name, data in json.loads(result.stdout)]


class InventoryError(Exception):
    pass


# The loader's exit status when a --limit pattern picks no host (its stderr says which).
NO_MATCH_EXIT = 3


def _dump_inventory(path: str, limit: list[str]) -> None:
    """`python -m gemmaserve.ops.fleet INVENTORY [PATTERN...]`: [[name, host data], ...] as JSON, as pyinfra
    loads them; with patterns, only the hosts they pick (as pyinfra's `--limit` does: a group's hosts, else
    host names matching the glob)."""
    from pyinfra.api import State
    from pyinfra.api.exceptions import NoGroupError
    from pyinfra.context import ctx_state
    from pyinfra_cli.inventory import make_inventory

    ctx_state.set(State())  # the loader records which file it executes on the current state
    inventory = make_inventory(path, cwd=os.getcwd())  # the project directory: load() runs this there
    picked = set()
    for pattern in limit:
        try:
            matches = set(inventory.get_group(pattern))
        except NoGroupError:
            matches = {host for host in inventory if fnmatch(host.name, pattern)}
        if not matches:
            names = ", ".join(host.name for host in inventory) or "none"
            print(f"--limit {pattern!r}: no group or host of that name; its hosts: {names}", file=sys.stderr)
            raise SystemExit(NO_MATCH_EXIT)
        picked |= matches
    hosts = [host for host in inventory if not limit or host in picked]
    print(json.dumps([[host.name, host.data.dict()] for host in hosts], default=str))


@dataclass(frozen=True)
class PyinfraRun:
    """One pyinfra run: exit status, what it printed, wall seconds, and the report it printed with --json (None when
    it printed none: a deploy that raised, a run killed at its timeout)."""

    returncode: int
    # Its log (stderr) as a terminal shows it, then the --json report it printed on stdout.
    output: str
    seconds: float
    # {"plan": [operation, ...], "results": {"operations": [...], "totals": {...}} or None for a dry run}: pyinfra
    # 3.10's pyinfra_cli/prints.py, print_run_json (build_plan_json, build_results_json).
    report: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def proposed_changes(self) -> list[str]:
        """A dry run's operations with a detected change (hosts_with_change: pyinfra's "Change" column);
        conditional ones, which depend on earlier operations, are not counted."""
        if not self.report or not isinstance(self.report.get("plan"), list):
            raise ValueError("no plan in pyinfra's --json report:\n" + self.output[-2000:])
        return [operation["name"] for operation in self.report["plan"] if operation["hosts_with_change"]]

    def totals(self) -> tuple[int, int]:
        """(operations, changed) from pyinfra's results: operations run on a host, summed over the hosts, and
        those that changed it (its "Success" count, as its results table's Grand total row)."""
        results = (self.report or {}).get("results")
        if not results:
            raise ValueError("no results in pyinfra's --json report:\n" + self.output[-2000:])
        return results["totals"]["hosts"], results["totals"]["success"]


def run_pyinfra(
    inventory: str | Path = DEFAULT_INVENTORY,
    deploy: str | Path = DEPLOY,
    *,
    limit: Iterable[str] = (),
    env: Mapping[str, str | None] | None = None,
    dry: bool = False,
    verbose: bool = False,
    on_line: Callable[[str], None] | None = None,
    timeout: float | None = None,
) -> PyinfraRun:
    """Run the pyinfra CLI in the project directory (project_dir), as a user would; `env` adds (or, with None,
    removes) variables.

    `dry` prints every decision (`--dry`, with noop reasons) and changes nothing; otherwise the run applies
    without asking (`-y`). `on_line` sees each line of its log as it comes (progress for long deploys). With
    --json, pyinfra logs to stderr and prints its plan and results as one JSON document on stdout at the end.
    """
    command = [sys.executable, "-m", "pyinfra", "--json", "--dry" if dry else "-y"]
    if verbose or dry:
        command.append("-v")
    for name in limit:
        command += ["--limit", name]
    command += [str(inventory), str(deploy)]
    environment = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for key, value in (env or {}).items():
        if value is None:
            environment.pop(key, None)
        else:
            environment[key] = value
    started = time.monotonic()
    lines: list[str] = []
    # stdout to a file: the report comes at the end, and a pipe nobody reads while the log is read could fill.
    with (
        tempfile.TemporaryFile("w+") as stdout,
        subprocess.Popen(
            command,
            cwd=project_dir(),
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
            env=environment,
        ) as process,
    ):
        watchdog = threading.Timer(timeout, process.kill) if timeout else None
        if watchdog:
            watchdog.start()
        try:
            assert process.stderr is not None
            for line in process.stderr:
                lines.append(line)
                if on_line:
                    on_line(line.rstrip("\n"))
        finally:
            if watchdog:
                watchdog.cancel()
        returncode = process.wait()
        stdout.seek(0)
        printed = stdout.read()
    if returncode < 0 and timeout:
        lines.append(f"\n(gemmaserve: pyinfra stopped after the {timeout:.0f} s timeout)\n")
    return PyinfraRun(returncode, "".join(lines) + printed, time.monotonic() - started, _report(printed))


def _report(printed: str) -> dict[str, Any] | None:
    """The JSON document pyinfra printed last on stdout (one line: click.echo of json.dumps), if any."""
    last = next((line for line in reversed(printed.splitlines()) if line.strip()), "")
    try:
        report = json.loads(last)
    except ValueError:
        return None
    return report if isinstance(report, dict) else None


if __name__ == "__main__":
    _dump_inventory(sys.argv[1], sys.argv[2:])
