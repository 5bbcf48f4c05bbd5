"""Host programs import the shared ones of roles/_lib/files by name, as the base role installs them in
/opt/gemmaserve/lib before any other role installs a program there and the units run them
(`/usr/bin/python3 /opt/gemmaserve/lib/<program>.py`): Python puts the script's own directory first on sys.path,
so no program edits it. Each importer starts from a copy holding only itself and what the base role installs."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from roles._lib.programs import INSTALLS, ROLES, source_of

# What the base role installs (roles/_lib/programs.INSTALLS), nothing else.
SHARED = [source_of("base", name) for name in INSTALLS["base"]]


def imported(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found


IMPORTERS = [p for p in sorted(ROLES.glob("*/files/*.py")) if imported(p) & {s.stem for s in SHARED}]


def run_installed(tmp_path: Path, program: Path, beside: list[Path]) -> subprocess.CompletedProcess:
    """From a copy of LIB_DIR holding `program` and `beside`, in a clean interpreter (-E -s): `program --help` as
    a unit runs it where it has an argparse command line, else an import of it with LIB_DIR first on sys.path
    (as a script's own directory is)."""
    lib = tmp_path / "lib"
    lib.mkdir()
    for path in (program, *beside):
        shutil.copy(path, lib / path.name)
    if "argparse" in imported(program):
        command = [sys.executable, "-E", "-s", str(lib / program.name), "--help"]
    else:
        command = [sys.executable, "-E", "-s", "-c", f"import {program.stem}; print('usage: imported')"]
    return subprocess.run(command, cwd=lib, capture_output=True, text=True, timeout=60)


def test_the_programs_that_import_a_shared_one_are_found():
    assert {p.name for p in IMPORTERS} >= {
        "weights_pull.py",
        "compile_cache.py",
        "api_keys.py",
        "haproxy_admin.py",
        "replica_ready.py",
        "preemption_drain.py",
        "secret_fetch.py",
        "gcs_json.py",
    }


@pytest.mark.parametrize("program", IMPORTERS, ids=lambda p: p.name)
def test_a_program_runs_beside_the_shared_programs(program, tmp_path):
    result = run_installed(tmp_path, program, [s for s in SHARED if s.name != program.name])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage:" in result.stdout


def test_without_them_it_does_not(tmp_path):
    """The check can fail: the puller alone, without gcs_json.py beside it, cannot start."""
    result = run_installed(tmp_path, ROLES / "weights" / "files" / "weights_pull.py", [])
    assert result.returncode != 0 and "No module named 'gcs_json'" in result.stderr


def test_without_hostlib_a_shared_program_does_not_import(tmp_path):
    """Nor can the import check pass vacuously: gcs_json.py alone, without hostlib.py beside it, fails."""
    result = run_installed(tmp_path, ROLES / "_lib" / "files" / "gcs_json.py", [])
    assert result.returncode != 0 and "No module named 'hostlib'" in result.stderr
