"""`gemmaserve keys add|revoke|list`: the API keys HAProxy accepts, in a stack's Secret Manager secret
(`--stack`: one new version per change, hosts follow the latest within seconds) or in the root-only key
store on every host of an inventory (`--inventory`: changed over ssh, swapped into HAProxy at once).

A key is shown once, when it is made; stores, secrets, hosts and logs only ever hold its SHA-256 digest.
The store format is the host program's (roles/access/files/api_keys.py), read and written by that same code.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from gemmaserve.ops import fleet
from gemmaserve.plan import plan
from gemmaserve.sources import load_stack_spec, read_stack_document, stack_file
from gemmaserve.spec import SpecError
from roles._lib.programs import load_program

# The access role's program (store_format loads it from the installed roles package) where roles/access installs
# it on hosts; the unit swaps the store into HAProxy's map.
HOST_PROGRAM = "/opt/gemmaserve/lib/api_keys.py"
SYNC_UNIT = "gemmaserve-api-keys.service"
# Tests point the client at a local server speaking Secret Manager's REST API (no emulator exists).
ENDPOINT_ENV = "GEMMASERVE_SECRETMANAGER_ENDPOINT"


class KeysError(Exception):
    pass


def store_format() -> ModuleType:
    """roles/access/files/api_keys.py as a module: the one reader and writer of the key store format."""
    return load_program("access", "api_keys")


# A key from standard input must be hard to guess: at least this many bits, estimated as its length times
# the Shannon entropy of its characters (a lower bound for most generators; `openssl rand -base64 32` gives
# about 220, a 40-character run of one letter 0).
MIN_KEY_BITS = 128


def key_bits(key: str) -> float:
    counts = {c: key.count(c) for c in set(key)}
    return abs(sum(n * math.log2(n / len(key)) for n in counts.values())) if key else 0.0


def weak_key(key: str) -> str | None:
    """Why `key` is too weak to accept, never quoting it; None when it is strong enough."""
    bits = key_bits(key)
    if len(key) >= 20 and not any(c.isspace() for c in key) and bits >= MIN_KEY_BITS:
        return None
    return (
        f"this key has {len(key)} characters and about {bits:.0f} bits of entropy; allowed: at least 20 characters, "
        f"no whitespace and at least {MIN_KEY_BITS} bits (length x the entropy of its characters), e.g. "
        "`openssl rand -base64 32`"
    )


def new_api_key() -> str:
    """A random bearer key (256 bits); gemmaserve keys look like `gsk-...`."""
    return "gsk-" + secrets.token_urlsafe(32)


def key_digest(key: str) -> str:
    """What stores, secrets and hosts hold instead of the key: "sha256:" + its hex SHA-256."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def new_key() -> tuple[str, str]:
    """(key, its digest "sha256:...")."""
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
    document = read_stack_document(stack, project_dir)
    project = (document.get("config") or {}).get("gcp:project") or os.environ.get("GOOGLE_CLOUD_PROJECT")
    if not project:
        raise KeysError(
            f"stack {stack}: gcp:project is not set in {stack_file(stack, project_dir)}; "
            f"run `pulumi config set gcp:project PROJECT --stack {stack}` (or set GOOGLE_CLOUD_PROJECT)"
        )
    return f"projects/{project}/secrets/{secret}"


def secret_manager_client():
    from google.auth.exceptions import DefaultCredentialsError
    from google.cloud import secretmanager_v1

    endpoint = os.environ.get(ENDPOINT_ENV)
    if not endpoint:
        try:
            return secretmanager_v1.SecretManagerServiceClient()
        except DefaultCredentialsError:
            raise KeysError(
                "no Google credentials for Secret Manager (Application Default Credentials: "
                "https://cloud.google.com/docs/authentication/application-default-credentials); run "
                "`gcloud auth application-default login`, or set GOOGLE_APPLICATION_CREDENTIALS"
            ) from None
    from google.api_core.client_options import ClientOptions
    from google.auth.credentials import AnonymousCredentials

    return secretmanager_v1.SecretManagerServiceClient(
        transport="rest", client_options=ClientOptions(api_endpoint=endpoint), credentials=AnonymousCredentials()
    )


# How long a reader or writer waits for another writer's change to finish (its claim is a disabled latest
# version for one addVersion round trip) before it reports the version as stuck.
CLAIM_WAIT_S = 20.0
# How many times a writer re-reads and retries after another writer claimed the version it read.
WRITE_ATTEMPTS = 50
# Marks a version built on no earlier version (the secret had none). Version 1 is the first; a marked
# version numbered higher lost a race with another first writer: every reader and writer passes over it,
# and its own writer applies its change again on the store below it (it has printed no key yet).
FIRST_VERSION = "# gemmaserve keys: built on no earlier version\n"


@dataclass(frozen=True)
class SecretVersion:
    number: int
    state: str  # ENABLED, DISABLED or DESTROYED
    etag: str

    @classmethod
    def of(cls, version) -> SecretVersion:
        # Answers name the project by number where requests named it by id: compare version numbers only.
        return cls(
            int(version.name.rsplit("/", 1)[1]), getattr(version.state, "name", str(version.state)), version.etag
        )


@dataclass(frozen=True)
class Base:
    """What a change builds on: the store held in `version` (None: the secret has no version yet)."""

    version: SecretVersion | None
    entries: list


def _refused(error: Exception) -> bool:
    """Did Secret Manager refuse a precondition: an etag that is no longer current, or a version that is not
    ENABLED? FAILED_PRECONDITION, HTTP 400 (https://cloud.google.com/secret-manager/docs/etags); AIP-154 lets
    services answer ABORTED. Over gRPC the exception's class says so; over REST it is a BadRequest whose body
    does."""
    from google.api_core import exceptions

    if isinstance(error, exceptions.FailedPrecondition | exceptions.Aborted):
        return True
    try:
        status = error.response.json()["error"]["status"]
    except Exception:  # noqa: BLE001 - not a REST answer carrying a status
        return False
    return status in ("FAILED_PRECONDITION", "ABORTED")


class SecretKeys:
    """The key store held in a Secret Manager secret, one version per change.

    Hosts fetch `versions/latest` (their service account may access versions, nothing more), so the newest
    version is the store they serve. Writers are serialised by the etags Secret Manager keeps on each version
    (https://cloud.google.com/secret-manager/docs/etags): a writer first *claims* the version its change
    builds on by disabling it with the etag it read, which succeeds for exactly one writer; only then does it
    add the new version. A writer whose claim is refused reads again and applies its change again, so a
    revoke and a concurrent add both hold. While a claim is held the latest version is disabled: hosts keep
    the keys they fetched last, other writers and readers wait for the new version. A latest version that
    stays disabled, or is destroyed, is reported, never read as an empty store.
    """

    def __init__(self, secret: str, client=None, sleep=time.sleep, clock=time.monotonic):
        self.secret, self.client = secret, client or secret_manager_client()
        self.sleep, self.clock = sleep, clock

    def _name(self, number: int | str) -> str:
        return f"{self.secret}/versions/{number}"

    def _get(self, number: int | str) -> SecretVersion | None:
        from google.api_core import exceptions

        try:
            return SecretVersion.of(self.client.get_secret_version(name=self._name(number)))
        except exceptions.NotFound:
            try:
                self.client.get_secret(name=self.secret)
            except exceptions.NotFound:
                raise KeysError(f"{self.secret}: no such secret (run `pulumi up` for the stack first)") from None
            return None
        except exceptions.PermissionDenied as error:
            raise KeysError(f"{self.secret}: permission denied ({error.message})") from None

    def _text(self, version: SecretVersion) -> str | None:
        """The store text of an ENABLED version; None when it was disabled meanwhile."""
        try:
            response = self.client.access_secret_version(name=self._name(version.number))
        except Exception as error:
            if _refused(error):
                return None
            raise
        return response.payload.data.decode()

    def _stuck(self, version: SecretVersion) -> KeysError:
        project, _, secret = self.secret.removeprefix("projects/").partition("/secrets/")
        if version.state == "DESTROYED":
            fix = (
                "its keys cannot be read back; add a version holding the keys you want by hand "
                f"(`gcloud secrets versions add {secret} --project {project} --data-file STORE`)"
            )
        else:
            fix = (
                f"no `gemmaserve keys` change finished it within {CLAIM_WAIT_S:g} s, so one was interrupted (or "
                "someone disabled it): check it, then "
                f"`gcloud secrets versions enable {version.number} --secret {secret} --project {project}`"
            )
        return KeysError(
            f"{self._name(version.number)} is {version.state}: hosts keep the keys they fetched last, and the "
            f"store cannot be read, so nothing was listed or changed (it is not an empty store); {fix}"
        )

    def base(self) -> Base:
        """The store the next change builds on: the latest version (passing over first versions that lost
        a race), once no other writer's claim is held on it."""
        deadline, delay = self.clock() + CLAIM_WAIT_S, 0.05
        while True:
            version = self._get("latest")
            while version is not None:
                if version.state == "DESTROYED":
                    raise self._stuck(version)
                if version.state != "ENABLED":
                    break  # a claim is held: wait for the version its writer adds
                text = self._text(version)
                if text is None:
                    version = self._get(version.number)  # claimed while we read it
                    break
                if not (version.number > 1 and FIRST_VERSION in text):
                    return Base(version, store_format().parse_store(text, self._name(version.number)))
                version = self._get(version.number - 1)
            if version is None:
                return Base(None, [])
            if self.clock() >= deadline:
                raise self._stuck(version)
            self.sleep(delay)
            delay = min(delay * 2, 1.0)

    def read(self) -> list:
        return self.base().entries

    def _add(self, entries: list, first: bool) -> SecretVersion:
        text = store_format().format_store(entries) + (FIRST_VERSION if first else "")
        return SecretVersion.of(self.client.add_secret_version(parent=self.secret, payload={"data": text.encode()}))

    def _set_state(self, verb: str, version: SecretVersion) -> SecretVersion | None:
        """disable/enable `version` if its etag is still the one read; None when it is not."""
        call = getattr(self.client, f"{verb}_secret_version")
        try:
            return SecretVersion.of(call(request={"name": self._name(version.number), "etag": version.etag}))
        except Exception as error:
            if _refused(error):
                return None
            raise

    def change(self, apply) -> str:
        """Apply `apply(entries) -> entries` to the store as one new version; returns the version's name."""
        for _ in range(WRITE_ATTEMPTS):
            base = self.base()
            entries = apply(base.entries)
            if base.version is None:
                new = self._add(entries, first=True)
                if new.number == 1:
                    return self._name(new.number)
                continue  # another first writer made version 1: build on it (base() passes over ours)
            claim = self._set_state("disable", base.version)
            if claim is None:
                continue  # another writer claimed it first: read what that writer adds
            try:
                new = self._add(entries, first=False)
            except BaseException:
                self._set_state("enable", claim)  # give the claim back: hosts follow the old store again
                raise
            self._disable_older(new)
            return self._name(new.number)
        raise KeysError(f"{self.secret}: other writers kept changing the keys; gave up after {WRITE_ATTEMPTS} tries")

    def _disable_older(self, new: SecretVersion) -> None:
        """Versions an earlier gemmaserve left enabled, and first versions that lost a race: only older ones,
        never a newer one (another writer's)."""
        for old in self.client.list_secret_versions(request={"parent": self.secret, "filter": "state:ENABLED"}):
            if SecretVersion.of(old).number < new.number:
                self.client.disable_secret_version(name=old.name)


def secret_change(secret: str, action: str, key_id: str, digest: str | None = None, client=None) -> str:
    program = store_format()
    store = SecretKeys(secret, client)

    def apply(entries: list) -> list:
        return program.add_entry(entries, key_id, digest) if action == "add" else program.revoke_entry(entries, key_id)

    version = store.change(apply)
    # Read back what hosts will fetch: the change holds there (or a later writer built on it).
    now = {e.id: e.digest for e in store.read()}
    held = now.get(key_id) == digest if action == "add" else key_id not in now
    if not held:
        raise KeysError(
            f"{version} was written, but the store read back does not show the change: "
            "another writer changed the same key id; run `gemmaserve keys list`"
        )
    return version


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
