"""The programs roles install on hosts (roles/<role>/files/, stdlib only) and where they land there."""

from __future__ import annotations

import ast
import importlib.util
import shutil
import sys
from importlib.resources import files
from pathlib import Path
from types import ModuleType

# The installed `roles` package (a checkout or site-packages): its files/ folders ship as package data.
ROLES = Path(str(files("roles")))
LIB_DIR = "/opt/gemmaserve/lib"
# Which role installs each program into LIB_DIR: one owner per program. The base role, first on every host,
# installs what several roles' programs import or run (roles/_lib/files); each other role its own files/
# programs, and a role whose programs import a shared one, or whose units run one, depends on base having
# run first (roles._lib.managed.install_programs and require_base say so clearly when it has not). The vllm
# role's registry_credential.py is not here: it is a credential helper on PATH (/usr/local/bin).
INSTALLS: dict[str, tuple[str, ...]] = {
    "base": ("hostlib.py", "gcs_json.py", "secret_fetch.py"),
    "nvidia": ("gpu_preflight.py",),
    "vllm": ("vllm_cpu.py", "vllm_argcheck.py"),
    "weights": ("weights_pull.py",),
    "caches": ("compile_cache.py",),
    "access": ("api_keys.py",),
    "router": ("haproxy_admin.py",),
    "replicas": ("replica_ready.py",),
    "preemption": ("preemption_drain.py",),
    "monitoring": ("tpu_metrics_exporter.py",),
}
SHARED = INSTALLS["base"]
# Installed by the vllm role, run by the replicas role before any restart.
ARGCHECK = f"{LIB_DIR}/vllm_argcheck.py"
# Installed by the router role, run by the replicas role around restarts.
HAPROXY_ADMIN = f"{LIB_DIR}/haproxy_admin.py"


def program_source(role: str, name: str) -> Path:
    """A program as it sits in the repository: roles/<role>/files/<name>."""
    path = ROLES / role / "files" / name
    if not path.is_file():
        raise FileNotFoundError(path)
    return path


def installed_path(name: str) -> str:
    return f"{LIB_DIR}/{name}"


def source_of(role: str, name: str) -> Path:
    """Where `role`'s program `name` (INSTALLS) sits in the repository: base's are roles/_lib/files'."""
    return program_source("_lib" if role == "base" else role, name)


def imports_shared(role: str) -> bool:
    """Whether a program `role` installs imports one the base role installs (read from its source)."""
    shared = {Path(name).stem for name in SHARED}
    for name in INSTALLS[role]:
        for node in ast.walk(ast.parse(source_of(role, name).read_text())):
            if isinstance(node, ast.Import) and {a.name.split(".")[0] for a in node.names} & shared:
                return True
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in shared:
                return True
    return False


def load_program(role: str, name: str) -> ModuleType:
    """roles/<role>/files/<name>.py imported on this machine as it runs on a host. There every program sits in
    LIB_DIR, whose programs import the shared ones of roles/_lib/files by name (`import gcs_json`, the script's
    own directory being first on sys.path); here those are loaded first under the same names, so nothing edits
    sys.path. A shared program is its own module ("gcs_json"), any other one "gemmaserve_program_<name>"; hostlib
    first, as the other shared ones import it."""
    for shared in sorted((ROLES / "_lib" / "files").glob("*.py"), key=lambda path: (path.stem != "hostlib", path.stem)):
        _load(shared.stem, shared)
    return _load(name if role == "_lib" else f"gemmaserve_program_{name}", program_source(role, f"{name}.py"))


def installed_copy(lib: Path, *programs: tuple[str, str]) -> Path:
    """`lib` made a copy of LIB_DIR as a host holds it: what the base role installs beside each (role, file
    name) of `programs`, so they run as units run them (`python3 LIB/<program>.py`); `lib`."""
    lib.mkdir(parents=True, exist_ok=True)
    for path in (*(source_of("base", name) for name in SHARED), *(program_source(*each) for each in programs)):
        shutil.copy(path, lib / path.name)
    return lib


def _load(module_name: str, path: Path) -> ModuleType:
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name]


# Host data naming a GCS API emulator (the sandbox's bucket); unset in production, where hosts reach
# storage.googleapis.com with their service account.
STORAGE_EMULATOR_KEY = "gemmaserve_storage_emulator_host"

# Installed by the nvidia role, run by each NVIDIA replica before vLLM starts.
GPU_PREFLIGHT = f"{LIB_DIR}/gpu_preflight.py"
