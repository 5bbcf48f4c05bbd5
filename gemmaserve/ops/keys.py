"""`gemmaserve keys add|revoke|list`: the API keys HAProxy accepts, in a stack's Secret Manager secret
(`--stack`: one new version per change, hosts follow the latest within seconds) or in the root-only key
store on every host of an inventory (`--inventory`: changed over ssh, swapped into HAProxy at once).

A key is shown once, when it is made; stores, secrets, hosts and logs only ever hold its SHA-256 digest.
The store format is the host program's (roles/access/files/api_keys.py), read and written by that same code.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

from gemmaserve.ops import fleet
from gemmaserve.plan import plan
from gemmaserve.sources import load_stack_spec, stack_file
from gemmaserve.spec import SpecError

PROGRAM = fleet.REPO / "roles" / "access" / "files" / "api_keys.py"
# Installed there by roles/access; the unit swaps the store into HAProxy's map.
HOST_PROGRAM = "/opt/gemmaserve/lib/api_keys.py"
SYNC_UNIT = "gemmaserve-api-keys.service"
# Tests point the client at a local server speaking Secret Manager's REST API (no emulator exists).
ENDPOINT_ENV = "GEMMASERVE_SECRETMANAGER_ENDPOINT"


class KeysError(Exception):
    pass


def store_format() -> ModuleType:
    """roles/access/files/api_keys.py as a module: the one reader and writer of the key store format."""
    name = "gemmaserve_api_keys_program"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, PROGRAM)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def new_key() -> tuple[str, str]:
    """(key, its digest "sha256:...")."""
    from gemmaserve.sandbox.credentials import key_digest, new_api_key

    key = new_api_key()
    return key, key_digest(key)


# --- off-cloud: the key store on each host of an inventory -----------------------------------------


@dataclass
class HostKeys:
    host: fleet.FleetHost
    target: Any
    store: str

    def run(self, command: str) -> tuple[int, str]:
        sudo = "sudo -n " if self.host.data.get("_sudo") else ""
        result = self.target.run(f"{sudo}{command}")
        return result.rc, (result.stdout + result.stderr).strip()

    def list(self) -> list[dict[str, str]]:
        rc, out = self.run(f"python3 {HOST_PROGRAM} list --store {shlex.quote(self.store)}")
        if rc != 0:
            raise KeysError(f"{self.host.name}: cannot read the key store {self.store}: {out[-300:]}")
        return json.loads(out.splitlines()[-1] if out else "[]")


def inventory_hosts(inventory: str) -> list[HostKeys]:
    hosts = []
    for host in fleet.load(inventory):
        access = host.plan.access
        if access.key_secret:
            raise KeysError(
                f"{host.name}: serving.api_keys.secret_manager = {access.key_secret!r}: its keys live in Secret "
                "Manager; use --stack"
            )
        hosts.append(HostKeys(host, host.connect(), access.key_store))
    if not hosts:
        raise KeysError(f"--inventory {inventory}: no hosts")
    return hosts


def inventory_list(inventory: str) -> dict[str, list[dict[str, str]]]:
    return {h.host.name: h.list() for h in inventory_hosts(inventory)}


def inventory_change(inventory: str, action: str, key_id: str, digest: str | None = None) -> list[str]:
    """Add or revoke on every host, after checking every host first: a key id taken (add) or missing
    (revoke) anywhere stops the change before any host is touched."""
    store_format().check_id(key_id)
    hosts = inventory_hosts(inventory)
    for each in hosts:
        ids = {entry["id"] for entry in each.list()}
        if action == "add" and key_id in ids:
            raise KeysError(f"{each.host.name}: key id {key_id!r} exists; revoke it first or choose another id")
        if action == "revoke" and key_id not in ids:
            raise KeysError(
                f"{each.host.name}: no key with id {key_id!r}; known ids: {', '.join(sorted(ids)) or 'none'}"
            )
    done = []
    for each in hosts:
        args = f"{action} {key_id}" + (f" {digest}" if digest else "")
        rc, out = each.run(
            f"python3 {HOST_PROGRAM} {args} --store {shlex.quote(each.store)} && systemctl start {SYNC_UNIT}"
        )
        if rc != 0:
            raise KeysError(f"{each.host.name}: {action} failed after {len(done)} host(s) changed: {out[-500:]}")
        done.append(each.host.name)
    return done


# --- on-cloud: one Secret Manager secret, one version per change ----------------------------------


def stack_secret(stack: str, project_dir: Path = Path(".")) -> str:
    """projects/P/secrets/NAME of a stack's key secret (serving.api_keys.secret_manager, named as the stack
    created it, + gcp:project)."""
    spec = load_stack_spec(stack, project_dir)
    secret = plan(spec).access.key_secret
    if secret is None:
        raise KeysError(
            f"stack {stack}: serving.api_keys.secret_manager is not set (its hosts keep keys in a file); "
            "use --inventory, or set gemmaserve:serving.api_keys.secret_manager"
        )
    if secret.startswith("projects/"):
        return secret
    document = yaml.safe_load(stack_file(stack, project_dir).read_text()) or {}
    project = (document.get("config") or {}).get("gcp:project") or os.environ.get("GOOGLE_CLOUD_PROJECT")
    if not project:
        raise KeysError(
            f"stack {stack}: gcp:project is not set in {stack_file(stack, project_dir)}; "
            f"run `pulumi config set gcp:project PROJECT --stack {stack}` (or set GOOGLE_CLOUD_PROJECT)"
        )
    return f"projects/{project}/secrets/{secret}"


def secret_manager_client():
    from google.cloud import secretmanager_v1

    endpoint = os.environ.get(ENDPOINT_ENV)
    if not endpoint:
        return secretmanager_v1.SecretManagerServiceClient()
    from google.api_core.client_options import ClientOptions
    from google.auth.credentials import AnonymousCredentials

    return secretmanager_v1.SecretManagerServiceClient(
        transport="rest", client_options=ClientOptions(api_endpoint=endpoint), credentials=AnonymousCredentials()
    )


class SecretKeys:
    """The key store held in a Secret Manager secret: the latest version is the store."""

    def __init__(self, secret: str, client=None):
        self.secret, self.client = secret, client or secret_manager_client()

    def read(self) -> list:
        from google.api_core import exceptions

        try:
            response = self.client.access_secret_version(name=f"{self.secret}/versions/latest")
        except exceptions.NotFound:
            try:
                self.client.get_secret(name=self.secret)
            except exceptions.NotFound:
                raise KeysError(f"{self.secret}: no such secret (run `pulumi up` for the stack first)") from None
            return []  # the stack made the secret; no key was added yet
        except exceptions.FailedPrecondition:
            return []  # the latest version is disabled or destroyed
        except exceptions.PermissionDenied as error:
            raise KeysError(f"{self.secret}: permission denied ({error.message})") from None
        return store_format().parse_store(response.payload.data.decode(), self.secret)

    def write(self, entries: list) -> str:
        """Add the store as a new version and disable the versions it supersedes; returns the new version's name."""
        text = store_format().format_store(entries)
        version = self.client.add_secret_version(parent=self.secret, payload={"data": text.encode()})
        for old in self.client.list_secret_versions(request={"parent": self.secret, "filter": "state:ENABLED"}):
            if old.name != version.name:
                self.client.disable_secret_version(name=old.name)
        return version.name


def secret_change(secret: str, action: str, key_id: str, digest: str | None = None, client=None) -> str:
    store = SecretKeys(secret, client)
    program = store_format()
    entries = store.read()
    changed = program.add_entry(entries, key_id, digest) if action == "add" else program.revoke_entry(entries, key_id)
    return store.write(changed)


def secret_list(secret: str, client=None) -> list[dict[str, str]]:
    return [{"id": e.id, "created": e.created} for e in SecretKeys(secret, client).read()]


def spec_errors() -> tuple[type[Exception], ...]:
    """What `gemmaserve keys` reports as a one-line error: bad input, and what Secret Manager refused."""
    errors: tuple[type[Exception], ...] = (KeysError, SpecError, fleet.InventoryError, FileNotFoundError)
    try:
        from google.api_core.exceptions import GoogleAPIError

        errors += (GoogleAPIError,)
    except ImportError:
        pass
    return (*errors, store_format().StoreError)
