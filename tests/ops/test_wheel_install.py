"""A plain install of the project works outside the checkout: a wheel built from the tree (tracked and untracked
files git does not ignore, as a fresh clone would hold them plus the work in progress) goes into a fresh venv
with its dependencies from PyPI, and the operator CLI runs from a directory that is not the checkout.

Network tier: building fetches the build backend (setuptools) and installing fetches the core dependencies
from PyPI. About 20 to 30 s here, most of it pip."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import ROOT

pytestmark = pytest.mark.network

TIMEOUT = 600


def run(*args: str | Path, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT)


def source_tree(into: Path) -> Path:
    """The checkout's files as git sees them (no .venv, build/ or caches), copied to `into`."""
    listed = run("git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", cwd=ROOT)
    assert listed.returncode == 0, listed.stderr
    for name in filter(None, listed.stdout.split("\0")):
        source = ROOT / name
        if source.is_file():  # a file deleted in the work tree is still listed by --cached
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / name)
    return into


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path, dict[str, str]]:
    """(the venv's bin/, a working directory outside the checkout, a clean environment)."""
    base = tmp_path_factory.mktemp("wheel")
    source = source_tree(base / "src")
    built = run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", base / "dist", ".", cwd=source)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (base / "dist").glob("gemmaserve-*.whl")
    shutil.rmtree(source)  # nothing of the tree is left to import from
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "GEMMASERVE_"))}
    venv = base / "venv"
    made = run(sys.executable, "-m", "venv", venv, cwd=base, env=env)
    assert made.returncode == 0, made.stderr
    pip = run(venv / "bin" / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check", wheel, cwd=base)
    assert pip.returncode == 0, pip.stderr[-3000:]
    elsewhere = base / "elsewhere"
    elsewhere.mkdir()
    return venv / "bin", elsewhere, env


def test_the_package_is_imported_from_the_venv_not_the_checkout(installed):
    bin_dir, elsewhere, env = installed
    code = "import gemmaserve, roles; print(gemmaserve.__file__); print(roles.__file__)"
    result = run(bin_dir / "python", "-c", code, cwd=elsewhere, env=env)
    assert result.returncode == 0, result.stderr
    paths = [Path(line) for line in result.stdout.split()]
    assert all(bin_dir.parent in p.parents and ROOT not in p.parents for p in paths), paths


def test_gemmaserve_plan_runs_from_a_plain_install(installed):
    bin_dir, elsewhere, env = installed
    result = run(bin_dir / "gemmaserve", "plan", "--model", "31b", "--accelerator", "rtx-pro-6000", "--count", "8",
                 "--json", cwd=elsewhere, env=env)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert '"google/gemma-4-31B-it"' in result.stdout and '"--tensor-parallel-size"' in result.stdout


def test_gemmaserve_keys_help_and_the_key_store_program_from_a_plain_install(installed):
    bin_dir, elsewhere, env = installed
    result = run(bin_dir / "gemmaserve", "keys", "--help", cwd=elsewhere, env=env)
    assert result.returncode == 0, result.stderr
    assert all(command in result.stdout for command in ("add", "revoke", "list"))
    # What `keys add|revoke|list` read and write the store with: the access role's program, as package data.
    code = (
        "from gemmaserve.ops import keys; store = keys.store_format(); print(store.__file__); "
        "print(store.format_store(store.add_entry([], 'ci', keys.key_digest('k'), '2026-01-01T00:00:00Z')))"
    )
    result = run(bin_dir / "python", "-c", code, cwd=elsewhere, env=env)
    assert result.returncode == 0, result.stderr
    program, *store = result.stdout.splitlines()
    assert bin_dir.parent in Path(program).parents and any(line.startswith("ci sha256:") for line in store)


def test_the_sandbox_commands_are_plugged_in_there_too(installed):
    bin_dir, elsewhere, env = installed
    result = run(bin_dir / "gemmaserve", "--help", cwd=elsewhere, env=env)
    assert result.returncode == 0, result.stderr
    assert all(f" {name} " in result.stdout for name in ("plan", "demo", "tiny-model", "sandbox", "capacity"))
