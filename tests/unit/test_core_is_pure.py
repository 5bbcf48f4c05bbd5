"""The core (catalog, spec, kv_cache, vllm_releases, plan, sources, records) loads nothing of the layers above it:
no SSH, cloud, pyinfra, testinfra or plotting library, and none of ops, sandbox, infra or roles."""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest

from tests import ROOT

CORE = ROOT / "gemmaserve"
CORE_MODULES = sorted(p.stem for p in CORE.glob("*.py") if p.stem not in ("__init__", "__main__"))
FORBIDDEN = (
    "pyinfra",
    "pulumi",
    "paramiko",
    "testinfra",
    "matplotlib",
    "google",
    "gemmaserve.ops",
    "gemmaserve.sandbox",
)


def test_the_core_is_the_modules_the_layout_names() -> None:
    # vllm_releases: each vLLM release's KV-cache rules, with their source lines (kv_cache applies them)
    # checkpoint: any Gemma 4 checkpoint's config.json, weight bytes and adapters, read from local files only
    # planned_flags: the vLLM flags the plan sets, which workload.extra_args may not set
    assert CORE_MODULES == [
        "catalog",
        "checkpoint",
        "engines",
        "kv_cache",
        "plan",
        "planned_flags",
        "records",
        "sources",
        "spec",
        "topology",
        "vllm_releases",
    ]


def test_importing_the_core_loads_no_outer_library() -> None:
    imports = "; ".join(f"import gemmaserve.{m}" for m in CORE_MODULES)
    code = f"import sys, json; {imports}; print(json.dumps(sorted(sys.modules)))"
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    offenders = [m for m in loaded if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]
    assert offenders == []


def test_the_check_catches_a_forbidden_import() -> None:
    """Not vacuous: the same probe sees pyinfra once something imports it."""
    code = "import sys, json; import gemmaserve.plan, pyinfra.api; print(json.dumps(sorted(sys.modules)))"
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert "pyinfra" in loaded


@pytest.mark.parametrize("module", CORE_MODULES)
def test_core_module_imports_only_the_core(module: str) -> None:
    tree = ast.parse((CORE / f"{module}.py").read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and n.level == 0]
    outer = [n for n in names if n.split(".")[0] in ("roles", "infra", "policy", "hosts") or n.startswith(FORBIDDEN)]
    assert outer == []
