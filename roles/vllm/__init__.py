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
UV_VENV = "/opt/gemmaserve/uv"
# vLLM's ROCm docs warn that the installer "will silently fall back to the CUDA wheel from PyPI"
# (gpu.rocm.inc.md at v0.32.0): the staged venv must hold a HIP build of torch before it is moved in.
CHECK_HIP = (
    "import sys, torch; sys.exit(0 if torch.version.hip else 'torch ' + torch.__version__ + ' is not a ROCm build')"
)


class Settings(RoleSettings):
    prefix = "vllm_"
    # A local file to upload as the tool chat template instead of vLLM's at the pinned release tag
    # (the sandbox's test model brings its own; air-gapped hosts point this at a vetted copy).
    chat_template_src: str | None = None
    # sha256 of the downloaded template, for a vLLM release gemmaserve.engines has not recorded.
    chat_template_sha256: str | None = None
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


def chat_template_sha256(serving: Plan, settings: Settings) -> str:
    """The checksum the downloaded template must have, or a clear refusal before anything changes."""
    sha256 = settings.chat_template_sha256 or serving.engine.chat_template_sha256
    if not sha256:
        raise ValueError(
            f"vllm_chat_template_sha256: no checksum recorded for vLLM {serving.engine.version}'s "
            "tool_chat_template_gemma4.jinja; set vllm_chat_template_sha256 or vllm_chat_template_src"
        )
    return sha256


def _install_chat_template(serving: Plan, settings: Settings, current: PathState) -> None:
    if settings.chat_template_src:
        managed_file(
            name="Install the Gemma 4 tool chat template",
            dest=CHAT_TEMPLATE_PATH,
            content=Path(settings.chat_template_src),
            current=current,
        )
    else:
        # files.download checks the sha256 after downloading and fails the deploy on a mismatch.
        files.download(
            name=f"Install vLLM {serving.engine.version}'s Gemma 4 tool chat template",
            src=serving.engine.chat_template_url,
            dest=CHAT_TEMPLATE_PATH,
            mode="0644",
            sha256sum=chat_template_sha256(serving, settings),
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
    yield from uv_install_commands(engine, vendor, uv)


def uv_install_commands(engine: EnginePlan, vendor: str, uv: str) -> list[str]:
    """Build the venv next to its final path from `engine.requirements`, check it, then move it in."""
    staging = f"{engine.venv}.partial"
    # engine.index_urls is in priority order. uv ranks every --extra-index-url (earlier first) above
    # --index-url, and its default strategy (first-index) never takes a package from a later index once an
    # earlier one has it: PyPI's CUDA torch cannot replace ROCm's (no unsafe-best-match).
    *preferred, fallback = engine.index_urls
    indexes = "".join(f"--extra-index-url {url} " for url in preferred) + f"--index-url {fallback}"
    commands = [
        f"rm -rf {staging}",
        f"{uv} venv --relocatable --python {engine.python} {staging}",
        f"VIRTUAL_ENV={staging} {uv} pip install {indexes} " + " ".join(f"'{r}'" for r in engine.requirements),
    ]
    if vendor == "amd":
        commands.append(f'{staging}/bin/python -c "{CHECK_HIP}"')
    # Built next to its final path, then moved: a failed install or check never leaves a half venv.
    commands.append(f"rm -rf {engine.venv} && mv {staging} {engine.venv}")
    return commands
