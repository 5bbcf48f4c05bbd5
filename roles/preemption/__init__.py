"""Preemption: on hosts the cloud can take back with a notice (spot, flex-start, TPU VMs), a unit that
watches the metadata server and drains the replicas in HAProxy before the host goes (files/preemption_drain.py).

Which hosts: host data `gemmaserve_capacity` (the stack inventory sets it from the host record); on any
other host the unit is removed if an earlier deploy installed it.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pyinfra import host
from pyinfra.api import deploy
from pyinfra.operations import systemd

from gemmaserve.plan import Plan
from gemmaserve.sources import capacity_from_host_data
from roles._lib.facts import HostState
from roles._lib.managed import base_programs_changed, install_programs, managed_absent, managed_service, managed_unit
from roles._lib.programs import HAPROXY_ADMIN, LIB_DIR, installed_path
from roles._lib.render import render
from roles._lib.settings import RoleSettings, Url

TEMPLATES = Path(__file__).parent / "templates"
UNIT = "gemmaserve-preemption.service"
UNIT_PATH = f"/etc/systemd/system/{UNIT}"
SCRIPT = installed_path("preemption_drain.py")
# The router's HAProxy backend (roles/router/templates/haproxy.cfg.j2).
BACKEND = "vllm"


class Settings(RoleSettings):
    prefix = "preemption_"
    metadata_url: Url = "http://metadata.google.internal/computeMetadata/v1"
    # A spot VM has 30 s from the notice to its shutdown (cloud.google.com/compute/docs/instances/spot#preemption-process);
    # leave a few for HAProxy and systemd.
    grace_seconds: int = Field(25, ge=1, le=3600)


def unit_text(settings: Settings) -> str:
    return render(
        TEMPLATES / f"{UNIT}.j2",
        script=SCRIPT,
        grace=settings.grace_seconds,
        haproxy_admin=HAPROXY_ADMIN,
        backend=BACKEND,
        metadata_url=settings.metadata_url,
    )


@deploy("Drain replicas on preemption notices", data_defaults=Settings.defaults())
def preemption(plan: Plan) -> None:
    capacity = capacity_from_host_data(host.data.dict(), host.name)
    settings = Settings.from_host(host)
    now = HostState(host, paths=[LIB_DIR, SCRIPT, UNIT_PATH], units=[UNIT])
    if not capacity.preemptible:
        managed_service(
            name=f"Stop {UNIT} ({capacity.provisioning} {capacity.kind}: no preemption notices)",
            service=UNIT,
            current=now.unit(UNIT),
            running=False,
            enabled=False,
        )
        removed = [
            managed_absent(name=f"Remove {path}", path=path, current=now.path(path)) for path in (UNIT_PATH, SCRIPT)
        ]
        systemd.daemon_reload(name="Reload systemd units", _if=lambda: any(op.did_change() for op in removed))
        return
    script = install_programs("preemption", now)["preemption_drain.py"]
    # A new program, settings, or hostlib.py it imports (the base role's).
    managed_unit(UNIT, unit_text(settings), now, restart_with=(script.did_change, base_programs_changed()))
