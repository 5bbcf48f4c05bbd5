"""Every host program has one role that installs it (roles/_lib/programs.INSTALLS): the shared ones the base
role, first on every host; roles install their programs only through that table (install_programs), and a
role that needs the shared ones refuses to run before base did."""

from __future__ import annotations

import ast
from collections import Counter

import pytest
from pyinfra.context import ctx_host, ctx_state

from roles._lib.managed import MissingBaseRole, require_base
from roles._lib.programs import INSTALLS, ROLES, SHARED, imports_shared
from tests.roles.fixtures.test_driver_ops import FakeHost, FakeState

# Installed by the vllm role as a credential helper on PATH (/usr/local/bin), not into LIB_DIR.
ON_PATH = {"registry_credential.py"}


def calls(path, function: str) -> list[ast.Call]:
    return [
        node
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == function
    ]


def test_each_program_is_installed_by_one_role():
    named = Counter(name for names in INSTALLS.values() for name in names)
    assert [name for name, count in named.items() if count > 1] == []
    programs = {p.name for p in ROLES.glob("*/files/*.py")}
    assert set(named) == programs - ON_PATH


def test_the_shared_programs_are_the_base_roles():
    assert set(SHARED) == {p.name for p in (ROLES / "_lib" / "files").glob("*.py")}
    assert "hostlib.py" in SHARED


def test_roles_install_programs_only_through_the_table():
    """No role uploads a program of a files/ folder itself (which is how two roles came to install one), and
    each role of the table calls install_programs with its own name."""
    direct = []
    called: dict[str, set[str]] = {}
    for path in sorted(ROLES.glob("*/**/*.py")):
        role = path.relative_to(ROLES).parts[0]
        if role == "_lib" or "files" in path.relative_to(ROLES).parts:
            continue
        for call in calls(path, "program_source"):
            name = call.args[1].value if isinstance(call.args[1], ast.Constant) else ast.unparse(call.args[1])
            if name.endswith(".py") and name not in ON_PATH:
                direct.append(f"{path.relative_to(ROLES)}: {name}")
        for call in calls(path, "install_programs"):
            called.setdefault(role, set()).add(call.args[0].value)
    assert direct == []
    assert called == {role: {role} for role in INSTALLS}


@pytest.mark.parametrize(
    "role, needs", [("weights", True), ("caches", True), ("access", True), ("router", True), ("nvidia", False)]
)
def test_which_roles_programs_import_the_shared_ones(role, needs):
    # nvidia's preflight stands alone: the nvidia role creates LIB_DIR itself and runs without base.
    assert imports_shared(role) is needs


class Host(FakeHost):
    state = object()


def test_a_role_that_needs_base_refuses_to_run_without_it():
    with ctx_host.use(Host({})), ctx_state.use(FakeState()):
        with pytest.raises(
            MissingBaseRole, match=r"fixture-host: the hf_token role needs hostlib.py, .* call base\(\)"
        ):
            require_base("hf_token")
