"""Imports go one way (docs: STYLE.md, "Data flows one way"): the operator's tools (gemmaserve.ops) never
import the local test hosts (gemmaserve.sandbox), which plug into them; nothing edits sys.path; a role never
imports another role's private names (what two roles share lives in roles/_lib); host programs
(roles/<role>/files) import the standard library and the programs installed beside them, nothing else.

Read from the source with `ast`, lazy imports inside functions included: a function-level import is still
a dependency, it only moves the failure to run time. The edges still to remove are listed with what removes
them; the list must match what the tree holds, so it only shrinks."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from tests import ROOT

# gemmaserve.ops -> gemmaserve.sandbox imports left, each with its fix: none (the console script and
# `python -m gemmaserve`, gemmaserve/__main__.py, plug sandbox.cli's commands into ops.cli's app).
OPS_IMPORTS_OF_THE_SANDBOX: set[tuple[str, str]] = set()
# Files that still edit sys.path, each with its fix: none (host programs import the shared ones beside them in
# /opt/gemmaserve/lib, tests/roles/files/test_installed_layout.py; off hosts roles._lib.programs.load_program
# loads those first under the same names).
SYS_PATH_EDITS: set[str] = set()


def python_files(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(source: str, module: str = "", is_package: bool = False) -> list[tuple[str, list[str]]]:
    """(imported module, names taken from it) for every import in `source`, relative ones made absolute."""
    found: list[tuple[str, list[str]]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join([*package, *([base] if base else [])])
            found.append((base, [alias.name for alias in node.names]))
    return found


def import_edges(paths: list[Path], root: Path = ROOT) -> set[tuple[str, str]]:
    """(importing module, imported module) for each file; `from a import b` counts as a.b where a.b is a module,
    as a where b is a name of a."""
    edges = set()
    for path in paths:
        module = module_name(path, root)
        for target, names in imports(path.read_text(), module, path.name == "__init__.py"):
            submodules = {f"{target}.{name}" for name in names if is_module(f"{target}.{name}")}
            edges |= {(module, sub) for sub in submodules}
            if not names or len(submodules) < len(names):  # a name of the package itself
                edges.add((module, target))
    return edges


def is_module(dotted: str) -> bool:
    path = ROOT / Path(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def edits_sys_path(source: str) -> bool:
    """A call on sys.path (append, insert, extend, ...) or an assignment to it."""
    for node in ast.walk(ast.parse(source)):
        target = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = node.func.value
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            target = next((t.value if isinstance(t, ast.Subscript) else t for t in targets), None)
        if target is not None and ast.unparse(target) == "sys.path":
            return True
    return False


def private_role_imports(path: Path, root: Path = ROOT) -> list[str]:
    """What this role file takes from another role that the other role keeps to itself (a _name or a _module)."""
    own = path.relative_to(root / "roles").parts[0]
    found = []
    for target, names in imports(path.read_text(), module_name(path, root), path.name == "__init__.py"):
        parts = target.split(".")
        if parts[0] != "roles" or len(parts) < 2 or parts[1] in (own, "_lib"):
            continue
        private = [n for n in names if n.startswith("_")]
        if any(p.startswith("_") for p in parts[2:]) or private:
            found.append(f"{target}: {', '.join(private) or '(private module)'}")
    return found


def host_program_imports(path: Path) -> list[str]:
    """Imports of a host program that are neither the standard library nor a program installed beside it."""
    installed = {p.stem for p in (ROOT / "roles").glob("*/files/*.py")}
    # Run by the serving engine's own interpreter (the vllm venv, the TPU exporter's venv), not python3.
    engine_side = {"vllm_argcheck.py": {"vllm"}, "tpu_metrics_exporter.py": {"tpu_info"}}
    top = {target.split(".")[0] for target, _ in imports(path.read_text())}
    allowed = set(sys.stdlib_module_names) | installed | engine_side.get(path.name, set()) | {"__future__"}
    return sorted(top - allowed)


# --- the tree ------------------------------------------------------------------------------------------


def test_ops_imports_of_the_sandbox_are_only_the_listed_ones_still_to_remove():
    edges = {(a, b) for a, b in import_edges(python_files("gemmaserve/ops")) if b.startswith("gemmaserve.sandbox")}
    new = sorted(edges - OPS_IMPORTS_OF_THE_SANDBOX)
    gone = sorted(OPS_IMPORTS_OF_THE_SANDBOX - edges)
    assert not new, f"gemmaserve.ops must not import gemmaserve.sandbox (the sandbox plugs into ops): {new}"
    assert not gone, f"removed, so take them off OPS_IMPORTS_OF_THE_SANDBOX: {gone}"


def test_the_sandbox_imports_no_outer_layer():
    """The sandbox may use the operator's tools and what roles share (roles/_lib: where programs are installed);
    nothing of infra/, policy/, the inventories or one role's own package."""
    edges = import_edges(python_files("gemmaserve/sandbox"))
    outer = sorted(
        (a, b)
        for a, b in edges
        if b.split(".")[0] in ("infra", "policy", "hosts") or (b.startswith("roles") and not b.startswith("roles._lib"))
    )
    assert outer == []


def test_nothing_edits_sys_path():
    paths = python_files("gemmaserve", "roles", "hosts") + [ROOT / "deploy.py"]
    editing = {str(p.relative_to(ROOT)) for p in paths if edits_sys_path(p.read_text())}
    assert editing == SYS_PATH_EDITS, f"edits sys.path: {sorted(editing - SYS_PATH_EDITS)}; fixed: " + str(
        sorted(SYS_PATH_EDITS - editing)
    )


@pytest.mark.parametrize("path", python_files("roles"), ids=lambda p: str(p.relative_to(ROOT / "roles")))
def test_a_role_takes_no_private_name_of_another_role(path):
    assert private_role_imports(path) == []


@pytest.mark.parametrize(
    "path", sorted((ROOT / "roles").glob("*/files/*.py")), ids=lambda p: str(p.relative_to(ROOT / "roles"))
)
def test_a_host_program_imports_the_standard_library_and_the_programs_beside_it(path):
    assert host_program_imports(path) == []


# --- the checks are not vacuous ------------------------------------------------------------------------


def test_the_checks_see_what_they_look_for(tmp_path):
    lazy = "def f():\n    from gemmaserve.sandbox import state\n    from . import endpoint\n"
    assert imports(lazy, "gemmaserve.ops.fleet") == [
        ("gemmaserve.sandbox", ["state"]),
        ("gemmaserve.ops", ["endpoint"]),
    ]
    fleet = tmp_path / "gemmaserve" / "ops" / "fleet.py"
    fleet.parent.mkdir(parents=True)
    fleet.write_text(lazy)
    assert ("gemmaserve.ops.fleet", "gemmaserve.sandbox.state") in import_edges([fleet], tmp_path)
    for edit in ("sys.path.append('x')", "sys.path.insert(0, 'x')", "sys.path[:0] = ['x']", "sys.path += ['x']"):
        assert edits_sys_path(f"import sys\n{edit}\n"), edit
    assert not edits_sys_path("import sys\nprint(sys.path)\n")
    role = tmp_path / "roles" / "router" / "__init__.py"
    role.parent.mkdir(parents=True)
    role.write_text("from roles.weights import _marker, unit_name\nfrom roles._lib.managed import _x\n")
    assert private_role_imports(role, tmp_path) == ["roles.weights: _marker"]
    program = tmp_path / "program.py"
    program.write_text("import json, requests\nfrom google.auth import default\nimport gcs_json\n")
    assert host_program_imports(program) == ["google", "requests"]


def test_infra_modules_shadow_nothing_of_the_repository():
    """Pulumi (and tests/infra) put infra/ on sys.path for the program's flat imports: no module there may take
    the name of a top-level package of the repository (infra/hosts.py once hid the hosts/ inventories)."""
    flat = {p.stem for p in (ROOT / "infra").glob("*.py")} - {"__main__"}
    top = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")}
    assert "hosts" in top and "network" in flat
    assert flat & (top | {p.stem for p in ROOT.glob("*.py")}) == set()
