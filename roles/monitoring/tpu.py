"""TPU VM telemetry: libtpu's runtime metrics (HBM in use, duty cycle) served to Prometheus by a small
exporter built on Google's tpu-info library, pinned in its own venv."""

from __future__ import annotations

from pathlib import Path

from pyinfra import host
from pyinfra.api import operation
from pyinfra.facts.server import Command

from roles._lib.facts import HostState
from roles._lib.managed import install_programs, managed_unit
from roles._lib.programs import LIB_DIR, installed_path
from roles._lib.render import render

TEMPLATES = Path(__file__).parent / "templates"
PROGRAM = "tpu_metrics_exporter.py"
UNIT = "gemmaserve-tpu-exporter.service"
UNIT_PATH = f"/etc/systemd/system/{UNIT}"
VENV_ROOT = "/opt/gemmaserve/venvs"
# libtpu's runtime metrics service, where tpu-info reads it (tpu_info/metrics.py, tpu-info 0.14.2:
# get_chip_usage(addr="localhost:8431")); it answers only while a process (vLLM) holds the TPU.
LIBTPU_METRICS = "localhost:8431"
# tpu-info and everything it needs, exact: `uv pip compile` of these lines gives back the same set for
# Python 3.10 and 3.12 on x86_64 Linux (TPU VM images: Ubuntu 22.04 and 24.04), and the exporter's tests run
# against a venv built from them (tests/roles/files/test_tpu_metrics_exporter.py).
TPU_INFO_REQUIREMENTS = {
    "0.14.2": (
        "tpu-info==0.14.2",
        "grpcio==1.85.1",
        "immutabledict==4.3.1",
        "markdown-it-py==4.3.0",
        "mdurl==0.1.2",
        "packaging==26.3",
        "prometheus-client==0.26.0",
        "protobuf==7.36.2",
        "pygments==2.21.0",
        "rich==15.0.0",
        "typing-extensions==4.16.0",
    ),
}
# gemmaserve's accelerator -> tpu-info's chip name (TpuChip in tpu_info/device.py, tpu-info 0.14.2).
CHIP_TYPES = {"tpu-v5e": "v5e", "tpu-v6e": "v6e", "tpu-v7": "7x"}


def tpu_info_venv_path(version: str) -> str:
    return f"{VENV_ROOT}/tpu-info-{version}"


def chip_type(accelerator: str) -> str:
    if accelerator not in CHIP_TYPES:
        raise ValueError(f"{accelerator}: no tpu-info chip type (known: {', '.join(sorted(CHIP_TYPES))})")
    return CHIP_TYPES[accelerator]


def exporter_unit(accelerator: str, listen: str, tpu_info_version: str) -> str:
    return render(
        TEMPLATES / f"{UNIT}.j2",
        venv=tpu_info_venv_path(tpu_info_version),
        program=installed_path(PROGRAM),
        listen=listen,
        libtpu=LIBTPU_METRICS,
        chip_type=chip_type(accelerator),
        tpu_info_version=tpu_info_version,
    )


def installed_tpu_info(venv: str) -> str | None:
    probe = (
        f"test -x {venv}/bin/python && {venv}/bin/python -c "
        "'import importlib.metadata as m; print(m.version(\"tpu-info\"))' 2>/dev/null || true"
    )
    output = (host.get_fact(Command, probe) or "").strip()
    return output.splitlines()[-1] if output else None


@operation()
def tpu_info_venv(venv: str, version: str):
    """A venv holding the pinned tpu-info and its pinned dependencies (from PyPI); rebuilt when the pin moves."""
    installed = installed_tpu_info(venv)
    if installed == version:
        host.noop(f"{venv} has tpu-info {installed}")
        return
    requirements = " ".join(TPU_INFO_REQUIREMENTS[version])
    # Built in place: a failed install leaves no tpu-info version behind, so the next run rebuilds it.
    yield f"rm -rf {venv} && python3 -m venv {venv} && {venv}/bin/pip install --quiet --no-deps {requirements}"


def install_tpu_exporter(accelerator: str, listen: str, tpu_info_version: str) -> None:
    venv, program = tpu_info_venv_path(tpu_info_version), installed_path(PROGRAM)
    now = HostState(host, paths=[LIB_DIR, program, UNIT_PATH], units=[UNIT])
    tpu_info_venv(
        name=f"Install tpu-info {tpu_info_version} into {venv}",
        venv=venv,
        version=tpu_info_version,
    )
    code = install_programs("monitoring", now)[PROGRAM]
    managed_unit(UNIT, exporter_unit(accelerator, listen, tpu_info_version), now, restart_with=(code.did_change,))
