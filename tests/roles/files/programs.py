"""Host programs (roles/<role>/files/*.py) loaded by path, as the stdlib-only scripts they are on hosts."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from roles._lib.programs import program_source


def load(role: str, name: str) -> ModuleType:
    path = program_source(role, f"{name}.py")
    module_name = f"gemmaserve_program_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module
