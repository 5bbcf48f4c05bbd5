"""The programs roles install on hosts (roles/<role>/files/, stdlib only) and where they land there."""

from __future__ import annotations

from pathlib import Path

ROLES = Path(__file__).resolve().parents[1]
LIB_DIR = "/opt/gemmaserve/lib"
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


# Host data naming a GCS API emulator (the sandbox's bucket); unset in production, where hosts reach
# storage.googleapis.com with their service account.
STORAGE_EMULATOR_KEY = "gemmaserve_storage_emulator_host"

# Installed by the nvidia role, run by each NVIDIA replica before vLLM starts.
GPU_PREFLIGHT = f"{LIB_DIR}/gpu_preflight.py"
