"""The real resolver (`uv pip compile` against the real index) judges every engine pin and the serving
image's requirements, for the platform and Python each is installed on. Needs network to PyPI.

uv caches index pages and wheel metadata (its own cache directory), so a warm run takes seconds.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gemmaserve import engines
from gemmaserve.engines import ENGINE_PINS, PYPI, PYTORCH_CPU_INDEX
from tests import ROOT
from tests.unit.pypi_release import sdist

pytestmark = pytest.mark.network

DOCKERFILE = ROOT / "infra" / "serving_image" / "Dockerfile"
UV = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")


def compile_requirements(
    lines: list[str], python: str, platform: str, indexes: tuple[str, ...] = (PYPI,), find_links: str | None = None
) -> subprocess.CompletedProcess:
    """`uv pip compile` of `lines` for `python` on `platform`, indexes in priority order."""
    if UV is None:
        pytest.fail("uv is missing: pip install -e '.[test]' installs the pinned release")
    *preferred, fallback = indexes
    args = [UV, "pip", "compile", "-", "--no-header", "--no-annotate", "--no-python-downloads", "--quiet"]
    args += ["--python-version", python, "--python-platform", platform, "--index-url", fallback]
    for url in preferred:
        args += ["--extra-index-url", url]
    if find_links:
        args += ["--find-links", find_links]
    # Only what we pass: not this machine's pip/uv configuration.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UV_INDEX", "UV_EXTRA", "PIP_"))}
    return subprocess.run(
        args,
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "UV_NO_CONFIG": "1"},
    )


def resolved(result: subprocess.CompletedProcess) -> dict[str, str]:
    assert result.returncode == 0, result.stderr
    return dict(line.split("==", 1) for line in result.stdout.splitlines() if "==" in line and not line.startswith("#"))


def local_torch_cpu_wheels() -> str:
    """PyTorch's CPU index is unreachable from CI; the machine's pip find-links holds the real torch+cpu
    wheel the sandbox's vLLM CPU venv is built from, and stands in for that index."""
    for candidate in (os.environ.get("PIP_FIND_LINKS", ""), "/opt/wheels"):
        for folder in candidate.split():
            if folder and list(Path(folder).glob("torch-2.13.0+cpu-*.whl")):
                return folder
    pytest.fail(f"no torch 2.13.0+cpu wheel: {PYTORCH_CPU_INDEX} is unreachable and no local copy exists")


@pytest.mark.parametrize("vendor", ["nvidia", "google", "cpu"])
def test_every_engine_pin_resolves_on_its_platform(vendor: str) -> None:
    pin = ENGINE_PINS[vendor]
    lines = list(engines.requirements(vendor, pin.vllm_version, pin.transformers_version))
    indexes, links = pin.index_urls, None
    if vendor == "cpu":
        indexes, links = (PYPI,), local_torch_cpu_wheels()
    pins = resolved(compile_requirements(lines, pin.python, pin.platform, indexes, links))
    assert pins[pin.package] == pin.vllm_version
    assert pins["transformers"] == pin.transformers_version


def test_rocm_pin_satisfies_the_releases_own_rocm_requirements() -> None:
    """wheels.vllm.ai is unreachable from CI, so the ROCm pin is judged against what the release itself
    declares for ROCm (requirements/rocm.txt, with common.txt, in vLLM's sdist on PyPI) plus our pin."""
    pin = ENGINE_PINS["amd"]
    rocm_txt = sdist("vllm", pin.vllm_version) / "requirements" / "rocm.txt"
    lines = [f"-r {rocm_txt}", f"transformers=={pin.transformers_version}"]
    assert resolved(compile_requirements(lines, pin.python, pin.platform))["transformers"] == pin.transformers_version


def test_an_unresolvable_pin_fails() -> None:
    """The oracle can fail: the pair the issue found (vllm 0.32.0's range excludes transformers 5.23.0)."""
    pin = ENGINE_PINS["nvidia"]
    result = compile_requirements([pin.requirement, "transformers==5.23.0"], pin.python, pin.platform)
    assert result.returncode != 0
    assert "transformers>=5.16.1,<5.20.0" in result.stderr


@pytest.mark.parametrize("vendor", ["nvidia", "google", "amd"])
def test_recorded_transformers_range_is_the_releases(vendor: str) -> None:
    """The range the spec enforces (engines.transformers_range) is the one the resolver applies: its upper
    bound itself does not resolve."""
    pin = ENGINE_PINS[vendor]
    if vendor == "amd":
        rocm_txt = sdist("vllm", pin.vllm_version) / "requirements" / "rocm.txt"
        lines = [f"-r {rocm_txt}"]
    else:
        lines = [f"{pin.package}=={pin.vllm_version}"]
    low, high = pin.transformers_range
    result = compile_requirements([*lines, f"transformers=={high}"], pin.python, pin.platform)
    assert result.returncode != 0
    assert f"transformers>={low},<{high}" in result.stderr


def test_a_users_vllm_0_33_0_with_a_transformers_pin_in_its_range_resolves() -> None:
    """0.33.0 is not the default pin (the nvidia and amd pins move together with their torch, CUDA and ROCm
    facts), but a user may choose it with engine.transformers_version. Until PyPI published certifi
    2026.10.19.post1 (seen 2026-11-24) it could not be installed at all: its metadata requires
    certifi>=2026.10.19. The resolver judges the lines the plan writes for that choice, and the range's upper
    bound: transformers 5.21.0 is refused."""
    pin = ENGINE_PINS["nvidia"]
    lines = list(engines.requirements("nvidia", "0.33.0", "5.20.2"))
    pins = resolved(compile_requirements(lines, pin.python, pin.platform))
    assert (pins["vllm"], pins["transformers"]) == ("0.33.0", "5.20.2")
    refused = compile_requirements([lines[0], "transformers==5.21.0"], pin.python, pin.platform)
    assert refused.returncode != 0
    assert "transformers>=5.16.1,<5.21.0" in refused.stderr


def dockerfile_requirements(build_args: dict[str, str]) -> list[str]:
    """The requirement arguments of the Dockerfile's `pip install`, with its build args filled in."""
    text = DOCKERFILE.read_text()
    install = re.search(r"pip install --no-cache-dir (.+?) \\", text).group(1)
    quoted = re.findall(r'"([^"]+)"', install)
    return [re.sub(r"\$\{(\w+)\}", lambda m: build_args[m.group(1)], q) for q in quoted]


def test_serving_image_requirements_resolve() -> None:
    """What infra/image.py builds for the gpu8 stack (vLLM's release image, Python 3.12, CUDA wheels)."""
    pin = ENGINE_PINS["nvidia"]
    args = {
        "VLLM_PACKAGE": pin.package,
        "VLLM_VERSION": pin.vllm_version,
        "TRANSFORMERS_VERSION": pin.transformers_version,
    }
    lines = dockerfile_requirements(args)
    assert lines == [f"vllm=={pin.vllm_version}", f"transformers=={pin.transformers_version}"]
    assert resolved(compile_requirements(lines, pin.python, pin.platform))["transformers"] == pin.transformers_version
    broken = dockerfile_requirements({**args, "TRANSFORMERS_VERSION": "5.23.0"})
    assert compile_requirements(broken, pin.python, pin.platform).returncode != 0


def test_chat_template_checksum_is_the_releases() -> None:
    """The sha256 the vllm role and the image build check is that of examples/tool_chat_template_gemma4.jinja
    in the release's sdist on PyPI (built from the v<version> tag the role downloads from)."""
    for pin in ENGINE_PINS.values():
        template = sdist("vllm", pin.vllm_version) / "examples" / "tool_chat_template_gemma4.jinja"
        assert hashlib.sha256(template.read_bytes()).hexdigest() == pin.chat_template_sha256
