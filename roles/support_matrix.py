"""The support matrix of docs/support-matrix.md, from the engine pins and the driver roles' settings.

`python -m gemmaserve.ops.docs --write` writes it into the page with the other generated tables.
"""

from __future__ import annotations

from gemmaserve.engines import ENGINE_PINS, PYPI, PYTORCH_CPU_INDEX, index_urls, requirements
from roles import nvidia, rocm

COLUMNS = ("vendor", "driver", "GPU runtime", "vLLM wheel (indexes, first preferred)", "transformers", "Python", "OS")
INDEX_NAMES = {PYPI: "PyPI", PYTORCH_CPU_INDEX: "PyTorch's CPU index"}


def os_names(distros) -> str:
    """("ubuntu", "22.04") keys of a role's distribution table -> "Ubuntu 22.04, ..."."""
    return ", ".join(f"{name.capitalize()} {version}" for name, version in distros)


def rows(driver: nvidia.Settings, amd: rocm.Settings) -> list[tuple[str, ...]]:
    modules = "proprietary" if driver.driver_open is False else "open"
    host_side = {
        "nvidia": (
            f"branch {driver.driver_branch}, {modules} modules, held by `{nvidia.pinning_package(driver.driver_branch)}`",
            os_names(nvidia.CUDA_DISTROS),
        ),
        "amd": (
            "amdgpu DKMS from `amdgpu-install`" if amd.dkms else "the distribution kernel's amdgpu",
            os_names(rocm.CODENAMES),
        ),
        "google": ("the TPU VM image's", "TPU VM images"),
        "cpu": ("none", "Debian 12 (the sandbox)"),
    }
    table = []
    for vendor, pin in ENGINE_PINS.items():
        runtime = f"ROCm {amd.version}" if vendor == "amd" else pin.runtime or "none"
        if pin.torch_version:
            runtime += f" (torch {pin.torch_version})"
        wheel = requirements(vendor, pin.vllm_version, pin.transformers_version)[0]
        indexes = " + ".join(
            INDEX_NAMES.get(url, url.removeprefix("https://")) for url in index_urls(vendor, pin.vllm_version)
        )
        drivers, systems = host_side[vendor]
        table.append(
            (vendor, drivers, runtime, f"`{wheel}` ({indexes})", pin.transformers_version, pin.python, systems)
        )
    return table


def table(driver: nvidia.Settings | None = None, amd: rocm.Settings | None = None) -> str:
    """The Markdown table for these role settings (the roles' defaults unless given)."""
    lines = [COLUMNS, ("---",) * len(COLUMNS), *rows(driver or nvidia.Settings(), amd or rocm.Settings())]
    return "".join(f"| {' | '.join(cells)} |\n" for cells in lines)
