"""Compile caches on /dev/shm that survive reboots and preemption: restored from disk (optionally a GCS
bucket) before replicas start, saved at stop and periodically, keyed by the plan's cache key, bounded."""

from __future__ import annotations

from pathlib import Path

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.operations import server, systemd

from gemmaserve.plan import SHM_CACHE_ROOT, STATE_DIR, Plan
from roles.batch import Snapshot, render
from roles.vllm import LIB_DIR, PACKAGE_DIR

TEMPLATES = Path(__file__).parent / "templates"
DISK_ROOT = f"{STATE_DIR}/compile-cache"
RESTORE_UNIT = "gemmaserve-cache-restore.service"

DEFAULTS = {
    # /dev/shm is RAM: keep the caches well below what the model and KV cache need.
    "cache_max_gib": 8,
    "cache_save_interval": "30min",
    "cache_gcs_uri": None,  # gs://bucket/prefix to mirror saved caches to (needs gcloud on the host)
    "cache_save_timeout": 300,
}


def cache_args(serving: Plan) -> str:
    keys = sorted({r.cache_key for r in serving.replicas})
    args = f"--keys {' '.join(keys)} --shm {SHM_CACHE_ROOT} --disk {DISK_ROOT} --max-gib {host.data.cache_max_gib}"
    if host.data.cache_gcs_uri:
        args += f" --gcs {host.data.cache_gcs_uri}"
    return args


@deploy("Keep compile caches across restarts", data_defaults=DEFAULTS)
def caches(serving: Plan) -> None:
    tmpfiles_conf, script = "/etc/tmpfiles.d/gemmaserve.conf", f"{LIB_DIR}/compile_cache.py"
    units = (RESTORE_UNIT, "gemmaserve-cache-save.service", "gemmaserve-cache-save.timer")
    now = Snapshot(
        paths=[tmpfiles_conf, DISK_ROOT, script, *(f"/etc/systemd/system/{u}" for u in units)],
        units=[RESTORE_UNIT, "gemmaserve-cache-save.timer"],
    )
    tmpfiles = now.put(
        name="Create the /dev/shm cache root at every boot (tmpfiles.d)",
        dest=tmpfiles_conf,
        content=f"d {SHM_CACHE_ROOT} 0750 gemmaserve gemmaserve -\n",
    )
    server.shell(
        name="Create the /dev/shm cache root now",
        commands=[f"systemd-tmpfiles --create {tmpfiles_conf}"],
        _if=tmpfiles.did_change,
    )
    now.directory(name=f"Create {DISK_ROOT}", path=DISK_ROOT, user="root", group="root", mode="0750")
    now.put(name="Install the compile cache tool", content=PACKAGE_DIR / "compile_cache.py", dest=script)
    context = {
        "script": script,
        "args": cache_args(serving),
        "disk": DISK_ROOT,
        "shm": SHM_CACHE_ROOT,
        "save_timeout": host.data.cache_save_timeout,
        "interval": host.data.cache_save_interval,
    }
    rendered = [
        now.put(
            name=f"Install {unit}",
            content=render(TEMPLATES / f"{unit}.j2", **context),
            dest=f"/etc/systemd/system/{unit}",
        )
        for unit in units
    ]
    systemd.daemon_reload(
        name="Reload systemd units for the caches", _if=lambda: any(op.did_change() for op in rendered)
    )
    # Restarting the restore unit would save then restore: harmless, and it picks up new keys.
    now.service(name=f"Run {RESTORE_UNIT}", service=RESTORE_UNIT, enabled=True, running=True)
    now.service(name="Save caches periodically", service="gemmaserve-cache-save.timer", enabled=True, running=True)
