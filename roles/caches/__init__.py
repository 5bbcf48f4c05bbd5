"""Compile caches on /dev/shm that survive reboots and preemption: restored from disk (optionally a GCS
bucket) before replicas start, saved at stop and periodically, keyed by the plan's cache key, bounded."""

from __future__ import annotations

from io import StringIO
from pathlib import Path

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.operations import files, server, systemd

from roles import jinja_options

from gemmaserve.plan import SHM_CACHE_ROOT, STATE_DIR, Plan
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
    tmpfiles = files.put(
        name="Create the /dev/shm cache root at every boot (tmpfiles.d)",
        src=StringIO(f"d {SHM_CACHE_ROOT} 0750 gemmaserve gemmaserve -\n"),
        dest="/etc/tmpfiles.d/gemmaserve.conf", mode="0644",
    )
    server.shell(name="Create the /dev/shm cache root now", commands=["systemd-tmpfiles --create /etc/tmpfiles.d/gemmaserve.conf"],
                 _if=tmpfiles.did_change)
    files.directory(name=f"Create {DISK_ROOT}", path=DISK_ROOT, user="root", group="root", mode="0750")
    script = f"{LIB_DIR}/compile_cache.py"
    files.put(name="Install the compile cache tool", src=str(PACKAGE_DIR / "compile_cache.py"), dest=script, mode="0644")
    context = {"script": script, "args": cache_args(serving), "disk": DISK_ROOT, "shm": SHM_CACHE_ROOT,
               "save_timeout": host.data.cache_save_timeout, "interval": host.data.cache_save_interval}
    rendered = [
        files.template(jinja_env_kwargs=jinja_options(), name=f"Install {unit}", src=str(TEMPLATES / f"{unit}.j2"),
                       dest=f"/etc/systemd/system/{unit}", mode="0644", **context)
        for unit in (RESTORE_UNIT, "gemmaserve-cache-save.service", "gemmaserve-cache-save.timer")
    ]
    systemd.daemon_reload(name="Reload systemd units for the caches", _if=lambda: any(op.did_change() for op in rendered))
    # Restarting the restore unit would save then restore: harmless, and it picks up new keys.
    systemd.service(name=f"Run {RESTORE_UNIT}", service=RESTORE_UNIT, enabled=True, running=True)
    systemd.service(name="Save caches periodically", service="gemmaserve-cache-save.timer", enabled=True, running=True)
