"""The GPU preflight against a real 8 x H100 `nvidia-smi -q` (and copies with one field changed), and as
the program it is on hosts: a subprocess with a stub nvidia-smi and /proc version file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from roles._lib.programs import load_program, program_source

RECORDED = Path(__file__).resolve().parents[1] / "fixtures" / "recorded"
SMI_Q = (RECORDED / "h100_hgx_nvidia_smi_q.txt").read_text()
preflight = load_program("nvidia", "gpu_preflight")
DRIVER = "565.57.01"


def change(text: str, section: str, field: str, value: str, gpu: int = 0) -> str:
    """The real output with one field of one GPU's section changed."""
    blocks = text.split("\nGPU ")
    head, gpus = blocks[0], blocks[1:]
    lines = gpus[gpu].splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip() == section)
    for i in range(at + 1, len(lines)):
        if lines[i].strip().startswith(field):
            key = lines[i].split(":")[0]
            lines[i] = f"{key}: {value}"
            break
    gpus[gpu] = "\n".join(lines)
    return "\nGPU ".join([head, *gpus])


def test_parses_the_real_output() -> None:
    top, gpus = preflight.parse_smi_q(SMI_Q)
    assert top["Driver Version"] == DRIVER and len(gpus) == 8
    assert gpus[0]["Bus Id"] == "00000000:18:00.0"
    assert gpus[0]["Fabric"]["State"] == "Completed"
    assert gpus[0]["Remapped Rows"]["Pending"] == "No"
    assert gpus[0]["MIG Mode"]["Current"] == "Disabled"


def test_a_healthy_hgx_passes() -> None:
    problems, warnings = preflight.preflight(SMI_Q, DRIVER, "0,1", "PCI_BUS_ID", fabric=True)
    assert (problems, warnings) == ([], [])


@pytest.mark.parametrize(
    ("section", "field", "value", "expected"),
    [
        ("Remapped Rows", "Pending", "Yes", "Remapped Rows Pending = Yes"),
        ("Remapped Rows", "Remapping Failure Occurred", "Yes", "Remapping Failure Occurred = Yes"),
        ("MIG Mode", "Current", "Enabled", "MIG Mode Current = Enabled"),
        ("ECC Mode", "Current", "Disabled", "ECC Mode Current = Disabled"),
        ("Fabric", "State", "In Progress", "Fabric State = In Progress"),
    ],
)
def test_each_sick_field_fails_naming_gpu_and_field(section, field, value, expected) -> None:
    sick = change(SMI_Q, section, field, value, gpu=1)
    problems, _ = preflight.preflight(sick, DRIVER, "0,1", "PCI_BUS_ID", fabric=True)
    assert len(problems) == 1 and problems[0].startswith("GPU 1 (00000000:2A:00.0)") and expected in problems[0]
    # The same sick GPU outside this replica's devices does not fail it.
    assert preflight.preflight(sick, DRIVER, "2,3", "PCI_BUS_ID", fabric=True)[0] == []


def test_fabric_is_checked_wherever_nvidia_smi_reports_one() -> None:
    """No flag needed on NVSwitch systems: a fabric state other than N/A is checked; PCIe GPUs report N/A."""
    training = change(SMI_Q, "Fabric", "State", "In Progress", gpu=0)
    assert "Fabric State = In Progress" in preflight.preflight(training, DRIVER, "0", "PCI_BUS_ID", fabric=False)[0][0]
    pcie = change(change(SMI_Q, "Fabric", "State", "N/A", gpu=0), "Fabric", "Status", "N/A", gpu=0)
    assert preflight.preflight(pcie, DRIVER, "0", "PCI_BUS_ID", fabric=False)[0] == []
    assert preflight.preflight(pcie, DRIVER, "0", "PCI_BUS_ID", fabric=True)[0] != []


def test_host_level_failures() -> None:
    assert "differs from the driver" in preflight.preflight(SMI_Q, "580.95.05", "0", "PCI_BUS_ID", False)[0][0]
    assert "no NVIDIA kernel module" in preflight.preflight(SMI_Q, None, "0", "PCI_BUS_ID", False)[0][0]
    assert "CUDA_DEVICE_ORDER = None" in preflight.preflight(SMI_Q, DRIVER, "0", None, False)[0][0]
    assert "GPU 9: not present" in preflight.preflight(SMI_Q, DRIVER, "9", "PCI_BUS_ID", False)[0][0]


def test_persistence_off_is_a_warning_only() -> None:
    off = SMI_Q.replace(
        "Persistence Mode                      : Enabled", "Persistence Mode                      : Disabled", 1
    )
    problems, warnings = preflight.preflight(off, DRIVER, "0", "PCI_BUS_ID", fabric=True)
    assert problems == [] and warnings == [
        "GPU 0 (00000000:18:00.0): Persistence Mode = Disabled (every start re-initialises the GPU)"
    ]


def test_as_a_program(tmp_path: Path) -> None:
    smi = tmp_path / "nvidia-smi"
    (tmp_path / "q.txt").write_text(change(SMI_Q, "Remapped Rows", "Pending", "Yes", gpu=3))
    smi.write_text(f'#!/bin/sh\n[ "$1" = -q ] && exec cat {tmp_path / "q.txt"}\nexit 2\n')
    smi.chmod(0o755)
    version = tmp_path / "version"
    version.write_text(
        f"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {DRIVER}  Release Build  (dvs-builder@U16-I3-B08-1-1)\n"
    )
    args = [sys.executable, str(program_source("nvidia", "gpu_preflight.py")), "--fabric"]
    args += ["--nvidia-smi", str(smi), "--proc-version", str(version)]
    env = {**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    ok = subprocess.run(args, env={**env, "CUDA_VISIBLE_DEVICES": "0,1"}, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    sick = subprocess.run(args, env={**env, "CUDA_VISIBLE_DEVICES": "2,3"}, capture_output=True, text=True)
    assert sick.returncode == 1
    assert "GPU 3 (00000000:5D:00.0): Remapped Rows Pending = Yes" in sick.stderr
    # A container replica: the unit's environment names the host's GPUs 2,3 (the container's are 0,1).
    in_container = subprocess.run(args, env={**env, "GEMMASERVE_HOST_GPUS": "2,3"}, capture_output=True, text=True)
    assert in_container.returncode == 1 and "GPU 3 (00000000:5D:00.0)" in in_container.stderr
