"""The README's default capacity figures are what `gemmaserve plan` prints with the pinned engine."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
STACK_ROW = re.compile(r"^\| (?P<stack>[a-z0-9-]+) \((?P<what>[^|]*)\) \|[^|]*\|(?P<cells>( [^|]+ \|){4})$")


def gemmaserve(*args: str) -> subprocess.CompletedProcess:
    # rich wraps at the terminal width; the README's blocks are 120 columns.
    env = {**os.environ, "COLUMNS": "120", "NO_COLOR": "1"}
    return subprocess.run(
        [sys.executable, "-m", "gemmaserve", *args], cwd=ROOT, capture_output=True, text=True, env=env
    )


def readme_stack_rows() -> dict[str, tuple[str, list[str]]]:
    rows = {}
    for line in README.read_text().splitlines():
        match = STACK_ROW.match(line)
        if match and "vllm" in match["what"]:
            rows[match["stack"]] = (match["what"], [c.strip() for c in match["cells"].strip(" |").split("|")])
    return rows


def test_the_readme_lists_every_default_stack() -> None:
    assert set(readme_stack_rows()) == {"gpu8", "h100", "a100", "tpu-v6e4", "tpu-v6e1"}


@pytest.mark.parametrize("stack", ["gpu8", "h100", "a100", "tpu-v6e4", "tpu-v6e1"])
def test_stack_row_is_the_plan(stack: str) -> None:
    what, cells = readme_stack_rows()[stack]
    result = gemmaserve("plan", "--stack", stack, "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    engine, replica = data["engine"], data["replicas"][0]
    assert f"{engine['package']} {engine['vllm_version']}" in what
    assert cells == [
        f"{replica['available_kv_cache_gib']:.2f}",
        f"{replica['num_blocks']:,}",
        f"{replica['kv_cache_tokens']:,}",
        f"{replica['max_concurrency']:.2f}x",
    ]


def test_gpu8_console_block_is_the_plan() -> None:
    text = README.read_text()
    block = text.split("$ gemmaserve plan --stack gpu8\n", 1)[1].split("```\n", 1)[0]
    result = gemmaserve("plan", "--stack", "gpu8")
    assert result.returncode == 0, result.stderr
    assert block == result.stdout
