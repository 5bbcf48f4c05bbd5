"""Fixtures for the tests that run vLLM's own code (the sandbox's vLLM CPU venv)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gemmaserve import vllm_cpu


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The vLLM CPU venv, built on first use (about 2 minutes, then cached under /opt/gemmaserve)."""
    if not vllm_cpu.is_built():
        if os.geteuid() != 0:
            reason = f"building the vLLM CPU venv {vllm_cpu.venv_path()} needs root"
            if os.environ.get("CI") == "true":
                pytest.fail(reason)
            pytest.skip(reason)
        vllm_cpu.build_vllm_cpu_venv()
    return vllm_cpu.venv_python()
