"""Compile caches on /dev/shm that survive reboots and preemption: restored from disk (optionally a GCS
bucket: the host's own saves, or a promoted cache) before replicas start, saved at stop and periodically
(to the bucket under the host's own prefix), keyed by the plan's cache key, bounded."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.operations import server, systemd

from gemmaserve.plan import SHM_CACHE_ROOT, STATE_DIR, Plan
from roles._lib.facts import HostState
from roles._lib.managed import install_programs, managed_directory, managed_file, managed_service
from roles._lib.programs import LIB_DIR, STORAGE_EMULATOR_KEY, installed_path
from roles._lib.render import render
from roles._lib.settings import GcsUri, RoleSettings, SystemdTimespan

TEMPLATES = Path(__file__).parent / "templates"
DISK_ROOT = f"{STATE_DIR}/compile-cache"
RESTORE_UNIT = "gemmaserve-cache-restore.service"
UNITS = (RESTORE_UNIT, "gemmaserve-cache-save.service", "gemmaserve-cache-save.timer")
TMPFILES_CONF = "/etc/tmpfiles.d/gemmaserve.conf"


class Settings(RoleSettings):
    prefix = "cache_"
    # /dev/shm is RAM: keep the caches well below what the model and KV cache need.
    max_gib: float = 8
    save_interval: SystemdTimespan = "30min"
    # gs://bucket/prefix that keeps each host's caches and the promoted ones every host restores; default: the
    # spec's weights.bucket (PREFIX/compile-cache/). "none" keeps caches on each host's own disk.
    gcs_uri: Literal["none"] | GcsUri | None = None
    save_timeout: int = 300


def cache_bucket(plan: Plan, settings: Settings) -> tuple[str, str] | None:
    """(bucket, prefix) the caches travel through, or None."""
    if settings.gcs_uri == "none":
        return None
    if settings.gcs_uri:
        bucket, _, prefix = settings.gcs_uri.removeprefix("gs://").partition("/")
        return bucket, prefix.strip("/") + "/" if prefix.strip("/") else ""
    weights = plan.weights
    return (weights.bucket, weights.compile_cache_prefix) if weights.bucket else None


def cache_args(plan: Plan, settings: Settings) -> str:
    keys = sorted({r.cache_key for r in plan.replicas})
    args = f"--keys {' '.join(keys)} --shm {SHM_CACHE_ROOT} --disk {DISK_ROOT} --max-gib {settings.max_gib:g}"
    remote = cache_bucket(plan, settings)
    if remote:
        args += f" --bucket {remote[0]} --bucket-prefix {remote[1] or '/'}"
    return args


@deploy("Keep compile caches across restarts", data_defaults=Settings.defaults())
def caches(plan: Plan) -> None:
    settings = Settings.from_host(host)
    script = installed_path("compile_cache.py")
    unit_paths = {unit: f"/etc/systemd/system/{unit}" for unit in UNITS}
    remote = cache_bucket(plan, settings)
    now = HostState(
        host,
        paths=[TMPFILES_CONF, DISK_ROOT, LIB_DIR, script, *unit_paths.values()],
        units=[RESTORE_UNIT, "gemmaserve-cache-save.timer"],
    )
    tmpfiles = managed_file(
        name="Create the /dev/shm cache root at every boot (tmpfiles.d)",
        dest=TMPFILES_CONF,
        content=f"d {SHM_CACHE_ROOT} 0750 gemmaserve gemmaserve -\n",
        current=now.path(TMPFILES_CONF),
    )
    server.shell(
        name="Create the /dev/shm cache root now",
        commands=[f"systemd-tmpfiles --create {TMPFILES_CONF}"],
        _if=tmpfiles.did_change,
    )
    managed_directory(name=f"Create {DISK_ROOT}", path=DISK_ROOT, current=now.path(DISK_ROOT), mode="0750")
    # Beside the Cloud Storage client (gcs_json.py) the base role installed.
    install_programs("caches", now)
    emulator = host.data.get(STORAGE_EMULATOR_KEY)
    context = {
        "environment": {"STORAGE_EMULATOR_HOST": emulator} if remote and emulator else {},
        "network": remote is not None,
        "script": script,
        "args": cache_args(plan, settings),
        "disk": DISK_ROOT,
        "shm": SHM_CACHE_ROOT,
        "save_timeout": settings.save_timeout,
        "interval": settings.save_interval,
    }
    rendered = [
        managed_file(
            name=f"Install {unit}",
            dest=path,
            content=render(TEMPLATES / f"{unit}.j2", **context),
            current=now.path(path),
        )
        for unit, path in unit_paths.items()
    ]
    systemd.daemon_reload(
        name="Reload systemd units for the caches", _if=lambda: any(op.did_change() for op in rendered)
    )
    # Restarting the restore unit would save then restore: harmless, and it picks up new keys.
    managed_service(name=f"Run {RESTORE_UNIT}", service=RESTORE_UNIT, current=now.unit(RESTORE_UNIT))
    managed_service(
        name="Save caches periodically",
        service="gemmaserve-cache-save.timer",
        current=now.unit("gemmaserve-cache-save.timer"),
    )
