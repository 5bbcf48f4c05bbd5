"""Host programs import the shared ones of roles/_lib/files by name, as the roles install them together in
/opt/gemmaserve/lib and the units run them (`/usr/bin/python3 /opt/gemmaserve/lib/<program>.py`): Python puts
the script's own directory first on sys.path, so no program edits it."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from roles._lib.programs import ROLES

SHARED = sorted((ROLES / "_lib" / "files").glob("*.py"))


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
    """`program --help` from a copy of LIB_DIR holding it and `beside`, in a clean interpreter (-E -s)."""
    lib = tmp_path / "lib"
    lib.mkdir()
    for path in (program, *beside):
        shutil.copy(path, lib / path.name)
    command = [sys.executable, "-E", "-s", str(lib / program.name), "--help"]
    return subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=60)


def test_the_programs_that_import_a_shared_one_are_found():
    assert {p.name for p in IMPORTERS} >= {"weights_pull.py", "compile_cache.py"}


@pytest.mark.parametrize("program", IMPORTERS, ids=lambda p: p.name)
def test_a_program_runs_beside_the_shared_programs(program, tmp_path):
    result = run_installed(tmp_path, program, SHARED)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage:" in result.stdout


def test_without_them_it_does_not(tmp_path):
    """The check can fail: the puller alone, without gcs_json.py beside it, cannot start."""
    result = run_installed(tmp_path, ROLES / "weights" / "files" / "weights_pull.py", [])
    assert result.returncode != 0 and "No module named 'gcs_json'" in result.stderr
