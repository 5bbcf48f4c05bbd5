"""docs/support-matrix.md's matrix is the one roles/support_matrix.py generates from the pins and role settings
(writing it between its markers: tests/ops/test_docs.py)."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from gemmaserve.engines import ENGINE_PINS
from gemmaserve.ops import docs
from roles import support_matrix
from roles.nvidia import Settings as NvidiaSettings
from roles.rocm import Settings as RocmSettings
from tests import ROOT

PAGE = ROOT / "docs" / "support-matrix.md"


def test_the_pages_matrix_is_the_code() -> None:
    assert docs.current(PAGE.read_text(), "support-matrix") == support_matrix.table()


def test_the_matrix_check_can_fail(monkeypatch) -> None:
    """A pin moved in the code without the page (the pair the issue found) is caught."""
    monkeypatch.setitem(ENGINE_PINS, "nvidia", replace(ENGINE_PINS["nvidia"], transformers_version="5.23.0"))
    assert docs.current(PAGE.read_text(), "support-matrix") != support_matrix.table()


@pytest.mark.parametrize(
    "settings, cell",
    [
        (
            {"driver": NvidiaSettings(driver_branch=595)},
            "branch 595, open modules, held by `nvidia-driver-pinning-595`",
        ),
        ({"driver": NvidiaSettings(driver_open=False)}, "branch 580, proprietary modules"),
        ({"amd": RocmSettings(version="7.3.0")}, "| ROCm 7.3.0 |"),
        ({"amd": RocmSettings(dkms=False)}, "| the distribution kernel's amdgpu |"),
    ],
)
def test_the_role_settings_make_the_driver_and_runtime_cells(settings, cell) -> None:
    """The cells follow the roles' settings, not a copy of them (the defaults give the page's table)."""
    assert cell in support_matrix.table(**settings)
    assert cell not in support_matrix.table()


def test_the_rocm_role_installs_the_release_the_rocm_wheel_is_built_on() -> None:
    """vLLM's ROCm wheel variant is "rocm" + the ROCm release without dots (setup.py at v0.32.0,
    rocm_version_to_variant); the host's ROCm, which the rocm role installs, must be that release."""
    assert ENGINE_PINS["amd"].local_version == "+rocm" + RocmSettings().version.replace(".", "")


@pytest.mark.network
def test_cuda_13_and_torch_facts_come_from_the_resolved_pin() -> None:
    """The CUDA column's torch pin is the one vLLM 0.32.0 requires (requirements/cuda.txt at the tag);
    the resolver test resolves it (nvidia-cuda-runtime 13.0.x)."""
    from tests.unit.pypi_release import sdist

    pin = ENGINE_PINS["nvidia"]
    cuda_txt = (sdist("vllm", pin.vllm_version) / "requirements" / "cuda.txt").read_text()
    assert re.search(rf"^torch=={re.escape(pin.torch_version)}$", cuda_txt, re.M)
