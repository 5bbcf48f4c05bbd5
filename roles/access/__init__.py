"""Access: who may call the router port. The API key store (Secret Manager, followed by a timer, or a
root-only file changed by `gemmaserve keys`) synced into HAProxy's key map by files/api_keys.py, and the TLS
certificate HAProxy serves (Secret Manager, fetched into tmpfs before HAProxy starts, or a root-only file).
The router role renders the HAProxy side (roles/router/templates/haproxy-access.cfg.j2)."""

from __future__ import annotations

import posixpath
import shlex
from pathlib import Path

from pydantic import Field
from pyinfra import host
from pyinfra.api import deploy, operation
from pyinfra.operations import files, server, systemd

from gemmaserve.plan import AccessPlan, Plan
from roles._lib.facts import HostState, PathState
from roles._lib.managed import install_programs, managed_file, managed_secret, managed_service
from roles._lib.programs import LIB_DIR, installed_path
from roles._lib.render import render
from roles._lib.settings import LocalFile, RoleSettings

TEMPLATES = Path(__file__).parent / "templates"
API_KEYS = installed_path("api_keys.py")
# Installed by the base role.
FETCHER = installed_path("secret_fetch.py")
KEYS_UNIT = "gemmaserve-api-keys.service"
KEYS_TIMER = "gemmaserve-api-keys.timer"
TLS_UNIT = "gemmaserve-tls.service"


class Settings(RoleSettings):
    prefix = "access_"
    # A PEM bundle (certificate chain + private key) on the control machine, installed at serving.tls.file.
    tls_src: LocalFile | None = None
    # A key store (`ID sha256:DIGEST CREATED` lines) on the control machine that seeds serving.api_keys.file
    # on a host that has none yet; afterwards `gemmaserve keys` owns the store and deploys leave it alone.
    api_keys_src: LocalFile | None = None
    # Seconds between fetches of the key secret from Secret Manager: how soon an added or revoked key is live.
    key_refresh: int = Field(10, ge=1, le=3600)


class MissingCertificate(Exception):
    pass


def api_keys_unit(access: AccessPlan, settings: Settings = Settings()) -> str:
    return render(
        TEMPLATES / f"{KEYS_UNIT}.j2",
        secret=access.key_secret,
        refresh=settings.key_refresh,
        fetcher=FETCHER,
        program=API_KEYS,
        store=access.key_store,
        map=access.key_map,
        map_dir=posixpath.dirname(access.key_map),
    )


def api_keys_timer(settings: Settings = Settings()) -> str:
    return render(TEMPLATES / f"{KEYS_TIMER}.j2", refresh=settings.key_refresh)


def tls_unit(access: AccessPlan) -> str:
    return render(TEMPLATES / f"{TLS_UNIT}.j2", fetcher=FETCHER, secret=access.tls_secret, out=access.tls_cert)


@deploy("Control access to the endpoint", data_defaults=Settings.defaults())
def access(plan: Plan) -> None:
    settings, access_plan = Settings.from_host(host), plan.access
    unit_paths = {unit: f"/etc/systemd/system/{unit}" for unit in (KEYS_UNIT, KEYS_TIMER, TLS_UNIT)}
    paths = [LIB_DIR, API_KEYS, access_plan.key_store, access_plan.tls_cert, *unit_paths.values()]
    now = HostState(host, paths=paths, units=[KEYS_TIMER])
    if access_plan.tls_secret is None and settings.tls_src is None and now.path(access_plan.tls_cert).kind == "absent":
        # Before any operation runs: a host without its certificate would serve nothing.
        raise MissingCertificate(
            f"{host.name}: serving.tls.file = {access_plan.tls_cert!r}: no such file on the host; place a PEM bundle "
            "(certificate chain and private key) there, mode 0400, or set access_tls_src to a local file to upload"
        )
    # Beside hostlib.py and the Secret Manager fetcher (secret_fetch.py) the base role installed.
    program = install_programs("access", now)["api_keys.py"]
    store = _key_store(access_plan, settings, now)
    cert = _certificate(access_plan, settings, now, unit_paths[TLS_UNIT])
    keys_unit = managed_file(
        name=f"Install {KEYS_UNIT}",
        dest=unit_paths[KEYS_UNIT],
        content=api_keys_unit(access_plan, settings),
        current=now.path(unit_paths[KEYS_UNIT]),
    )
    timer = None
    if access_plan.key_secret:
        timer = managed_file(
            name=f"Install {KEYS_TIMER}",
            dest=unit_paths[KEYS_TIMER],
            content=api_keys_timer(settings),
            current=now.path(unit_paths[KEYS_TIMER]),
        )

    def keys_changed() -> bool:
        return any(op is not None and op.did_change() for op in (program, store, keys_unit, timer))

    systemd.daemon_reload(name="Reload systemd for the access units", _if=lambda: keys_changed() or cert())
    systemd.service(name=f"Enable {KEYS_UNIT}", service=KEYS_UNIT, enabled=True, running=None, _if=keys_unit.did_change)
    server.shell(
        name="Sync the API keys into HAProxy's key map",
        commands=[f"systemctl start {KEYS_UNIT}"],
        _if=keys_changed,
    )
    if timer is not None:
        managed_service(name=f"Follow the key secret ({KEYS_TIMER})", service=KEYS_TIMER, current=now.unit(KEYS_TIMER))
    _remove_unused_units(access_plan, now, unit_paths)


@operation()
def key_store(dest: str, current: PathState, seed: str | None = None):
    """The file source's store exists: seeded from `seed` (or empty) once, then owned by `gemmaserve keys`."""
    if current.kind == "file":
        host.noop(f"{dest} exists; keys are added and revoked with `gemmaserve keys`")
        return
    if seed:
        yield from managed_secret._inner(dest=dest, content=Path(seed), current=current, mode="0600")
        return
    # No key yet: every request but /health is refused until `gemmaserve keys add`.
    yield key_store_init_command(dest)


def key_store_init_command(dest: str) -> str:
    return f"python3 {API_KEYS} init --store {shlex.quote(dest)}"


def _key_store(plan: AccessPlan, settings: Settings, now: HostState):
    if plan.key_secret:
        return None
    return key_store(
        name=f"Create the API key store {plan.key_store} (keys are managed with `gemmaserve keys`)",
        dest=plan.key_store,
        current=now.path(plan.key_store),
        seed=settings.api_keys_src,
    )


def _certificate(plan: AccessPlan, settings: Settings, now: HostState, unit_path: str):
    """A callable: did this deploy change the certificate (or the unit that fetches it)?"""
    if plan.tls_secret:
        unit = managed_file(
            name=f"Install {TLS_UNIT}",
            dest=unit_path,
            content=tls_unit(plan),
            current=now.path(unit_path),
        )
        systemd.service(
            name=f"Fetch the TLS certificate ({TLS_UNIT})",
            service=TLS_UNIT,
            enabled=True,
            running=True,
            restarted=True,
            daemon_reload=True,
            _if=unit.did_change,
        )
        return unit.did_change
    if settings.tls_src:
        put = managed_secret(
            name=f"Install the TLS certificate {plan.tls_cert}",
            dest=plan.tls_cert,
            content=Path(settings.tls_src),
            current=now.path(plan.tls_cert),
        )
        return put.did_change
    return lambda: False


def _remove_unused_units(plan: AccessPlan, now: HostState, unit_paths: dict[str, str]) -> None:
    """Units a Secret Manager source needed, left from an earlier deploy that used one."""
    unused = ([] if plan.key_secret else [KEYS_TIMER]) + ([] if plan.tls_secret else [TLS_UNIT])
    for unit in unused:
        if now.path(unit_paths[unit]).kind == "file":
            systemd.service(name=f"Stop {unit}", service=unit, running=False, enabled=False)
            files.file(name=f"Remove {unit}", path=unit_paths[unit], present=False)
