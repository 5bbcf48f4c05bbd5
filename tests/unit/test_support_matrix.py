"""The README's support matrix is the code's: every cell is rebuilt from the pins and role settings."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from gemmaserve.engines import ENGINE_PINS, index_urls, requirements
from roles.nvidia import CUDA_DISTROS, pinning_package
from roles.nvidia import Settings as NvidiaSettings
from roles.rocm import CODENAMES
from roles.rocm import Settings as RocmSettings

README = Path(__file__).resolve().parents[2] / "README.md"
OS_NAMES = {("ubuntu", "22.04"): "Ubuntu 22.04", ("ubuntu", "24.04"): "Ubuntu 24.04", ("debian", "12"): "Debian 12"}


def readme_matrix() -> dict[str, list[str]]:
    text = README.read_text()
    table = text.split("<!-- support-matrix", 1)[1].split("<!-- /support-matrix -->", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| vendor")]
    return {cells[0]: cells[1:] for cells in ([c.strip() for c in row.strip("|").split("|")] for row in rows)}


def expected() -> dict[str, list[str]]:
    branch = NvidiaSettings().driver_branch
    rocm = RocmSettings().version
    rows = {}
    for vendor, pin in ENGINE_PINS.items():
        line = requirements(vendor, pin.vllm_version, pin.transformers_version)[0]
        where = {"nvidia": "PyPI", "google": "PyPI", "cpu": "PyPI + PyTorch's CPU index"}.get(vendor)
        if vendor == "amd":
            where = index_urls(vendor, pin.vllm_version)[0].removeprefix("https://")
        wheel = f"`{line}` ({where})"
        rows[vendor] = [wheel, pin.transformers_version, pin.python]
    rows["nvidia"] = [
        f"branch {branch}, open modules, held by `{pinning_package(branch)}`",
        "CUDA 13.0 (torch 2.13.0)",
        *rows["nvidia"],
        ", ".join(OS_NAMES[k] for k in CUDA_DISTROS),
    ]
    rows["amd"] = [
        "amdgpu DKMS from `amdgpu-install`",
        f"ROCm {rocm}",
        *rows["amd"],
        ", ".join(OS_NAMES[k] for k in CODENAMES),
    ]
    rows["google"] = ["the TPU VM image's", "libtpu 0.0.48 (in the wheel)", *rows["google"], "TPU VM images"]
    rows["cpu"] = ["none", "none", *rows["cpu"], "Debian 12 (the sandbox)"]
    return rows


def test_readme_matrix_is_the_code() -> None:
    assert readme_matrix() == expected()


def test_the_matrix_check_can_fail(monkeypatch) -> None:
    """A pin moved in the code without the README (the pair the issue found) is caught."""
    monkeypatch.setitem(ENGINE_PINS, "nvidia", replace(ENGINE_PINS["nvidia"], transformers_version="5.23.0"))
    assert readme_matrix()["nvidia"] != expected()["nvidia"]


@pytest.mark.network
def test_cuda_13_and_torch_facts_come_from_the_resolved_pin() -> None:
    """The CUDA column's torch pin is the one vLLM 0.32.0 requires (requirements/cuda.txt at the tag);
    the resolver test resolves it (nvidia-cuda-runtime 13.0.x)."""
    from tests.unit.pypi_release import sdist

    cuda_txt = (sdist("vllm", ENGINE_PINS["nvidia"].vllm_version) / "requirements" / "cuda.txt").read_text()
    assert re.search(r"^torch==2\.13\.0$", cuda_txt, re.M)
