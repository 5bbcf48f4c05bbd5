"""vLLM engine: a pinned wheel venv (or pinned image), the Gemma 4 tool chat template, and the flag
checker (files/vllm_argcheck.py) that the replicas role runs before any restart."""

from __future__ import annotations

from pathlib import Path

from pyinfra import host
from pyinfra.api import deploy, operation
from pyinfra.facts.server import Command
from pyinfra.operations import files

from gemmaserve.plan import CHAT_TEMPLATE_PATH, VENV_ROOT, EnginePlan, Plan
from roles._lib.apt import install_packages
from roles._lib.facts import HostState, PathState
from roles._lib.managed import managed_directory, managed_file
from roles._lib.programs import LIB_DIR, installed_path, program_source
from roles._lib.settings import RoleSettings

PROGRAMS = ("vllm_cpu.py", "vllm_argcheck.py")
# Where each vendor's vLLM wheels come from besides PyPI (PyPI's `vllm` is the CUDA build and
# `vllm-tpu` the TPU build; ROCm builds are on vLLM's own index: https://docs.vllm.ai/en/latest/getting_started/installation/gpu/).
EXTRA_INDEX = {"amd": "https://wheels.vllm.ai/rocm/"}
# Python for GPU/TPU venvs (vLLM's ROCm wheels are built for 3.12); uv fetches it when the host lacks it.
VENV_PYTHON = {"nvidia": "3.12", "amd": "3.12", "google": "3.12"}
UV_VENV = "/opt/gemmaserve/uv"


class Settings(RoleSettings):
    prefix = "vllm_"
    # A local file to upload as the tool chat template instead of vLLM's at the pinned release tag
    # (the sandbox's test model brings its own; air-gapped hosts point this at a vetted copy).
    chat_template_src: str | None = None
    # uv builds the wheel venvs; pinned like everything installed on hosts.
    uv_version: str = "0.13.9"


def installed_vllm_version(venv: str) -> str | None:
    """`vllm` distribution version inside `venv`, or None when the venv is absent or broken."""
    probe = (
        f"test -x {venv}/bin/python && {venv}/bin/python -c "
        "'import importlib.metadata as m; print(m.version(\"vllm\"))' 2>/dev/null || true"
    )
    output = (host.get_fact(Command, probe) or "").strip()
    return output.splitlines()[-1] if output else None


@deploy("Install vLLM", data_defaults=Settings.defaults())
def vllm(serving: Plan) -> None:
    settings = Settings.from_host(host)
    engine = serving.engine
    programs = {name: installed_path(name) for name in PROGRAMS}
    now = HostState(host, paths=[LIB_DIR, *programs.values(), CHAT_TEMPLATE_PATH])
    managed_directory(name="Create the gemmaserve library directory", path=LIB_DIR, current=now.path(LIB_DIR))
    for name, dest in programs.items():
        managed_file(name=f"Install {name}", dest=dest, content=program_source("vllm", name), current=now.path(dest))
    if engine.package == "vllm-cpu" and any("--enforce-eager" not in r.argv for r in serving.replicas):
        # torch.compile's CPU backend (inductor) builds C++ kernels that include Python.h.
        install_packages("Install g++ and Python headers for torch.compile on CPU", ["g++", "python3-dev"])
    if engine.kind == "wheel":
        wheel_venv(
            name=f"Install {engine.package}=={engine.version} into {engine.venv}",
            engine=engine,
            vendor=serving.accelerator.vendor,
            installed=installed_vllm_version(engine.venv),
            uv_version=settings.uv_version,
        )
    else:
        present = (
            host.get_fact(Command, f"docker image inspect --format '{{{{.Id}}}}' {engine.image} 2>/dev/null || true")
            or ""
        ).strip()
        pulled_image(name=f"Pull {engine.image}", image=engine.image, present=bool(present))
    if any("--chat-template" in r.argv for r in serving.replicas):
        _install_chat_template(serving, settings, now.path(CHAT_TEMPLATE_PATH))


def _install_chat_template(serving: Plan, settings: Settings, current: PathState) -> None:
    if settings.chat_template_src:
        managed_file(
            name="Install the Gemma 4 tool chat template",
            dest=CHAT_TEMPLATE_PATH,
            content=Path(settings.chat_template_src),
            current=current,
        )
    else:
        files.download(
            name=f"Install vLLM {serving.engine.version}'s Gemma 4 tool chat template",
            src=serving.engine.chat_template_url,
            dest=CHAT_TEMPLATE_PATH,
            mode="0644",
        )


@operation()
def pulled_image(image: str, present: bool):
    """The pinned image, pulled once; never `pip install git+...` at container start."""
    if present:
        host.noop(f"{image} is present")
        return
    yield f"docker pull --quiet {image}"


@operation()
def wheel_venv(engine: EnginePlan, vendor: str, installed: str | None, uv_version: str):
    """A venv holding exactly the pinned vLLM (and transformers), built next to its path then moved in."""
    if installed and installed.split("+")[0] == engine.version:
        # Pinned version present (in the sandbox: a prebuilt venv bound read-only).
        host.noop(f"{engine.venv} has vLLM {installed}")
        return
    if engine.package == "vllm-cpu":
        # The CPU build needs surgery uv cannot express (see files/vllm_cpu.py).
        yield f"python3 {installed_path('vllm_cpu.py')} build --version {engine.version} --prefix {VENV_ROOT}"
        return
    uv = f"{UV_VENV}/bin/uv"
    yield (
        f"test -x {uv} && {uv} --version | grep -qx 'uv {uv_version}' || "
        f"(python3 -m venv {UV_VENV} && {UV_VENV}/bin/pip install --quiet uv=={uv_version})"
    )
    staging = f"{engine.venv}.partial"
    index = f" --extra-index-url {EXTRA_INDEX[vendor]}" if vendor in EXTRA_INDEX else ""
    yield f"rm -rf {staging}"
    yield f"{uv} venv --relocatable --python {VENV_PYTHON[vendor]} {staging}"
    yield (
        f"VIRTUAL_ENV={staging} {uv} pip install{index} --index-strategy unsafe-best-match "
        f"'{engine.requirement}' transformers=={engine.transformers_version}"
    )
    # Built next to its final path, then moved: a failed install never leaves a half venv.
    yield f"rm -rf {engine.venv} && mv {staging} {engine.venv}"
