"""The generated blocks of docs/ are what `python -m gemmaserve.ops.docs` renders from the code, compared as text."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from gemmaserve.ops import docs, stack_figures
from tests import ROOT

DEFAULT_STACKS = {"gpu8", "h100", "a100", "tpu-v6e4", "tpu-v6e1"}


def gemmaserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gemmaserve", *args], cwd=ROOT, capture_output=True, text=True)


@pytest.mark.parametrize("block", docs.BLOCKS, ids=lambda block: block.name)
def test_the_page_holds_what_the_code_generates(block: docs.Block) -> None:
    assert docs.current((ROOT / block.page).read_text(), block.name) == block.render(ROOT)


def test_the_check_command_finds_every_block_current() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gemmaserve.ops.docs", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_the_check_command_outside_the_project_says_where_to_run_it(tmp_path) -> None:
    """The project is the working directory (as for pulumi), not wherever the package is installed."""
    result = subprocess.run(
        [sys.executable, "-m", "gemmaserve.ops.docs", "--check"], cwd=tmp_path, capture_output=True, text=True
    )
    assert result.returncode == 1 and "run from the project directory" in result.stderr, result.stderr


def test_the_stack_table_has_a_row_per_stack_file() -> None:
    rows = stack_figures.table(ROOT).splitlines()[2:]
    assert len(rows) == len(stack_figures.stacks(ROOT))
    assert [row.split(" | ")[0].removeprefix("| ") for row in rows] == stack_figures.stacks(ROOT)
    assert DEFAULT_STACKS <= set(stack_figures.stacks(ROOT))


@pytest.mark.parametrize("stack", sorted(DEFAULT_STACKS))
def test_a_stack_rows_figures_are_what_gemmaserve_plan_prints(stack: str) -> None:
    """The row's engine and capacity cells are those of `gemmaserve plan --stack STACK --json`, the CLI's own
    answer, not only the library call the table is rendered with."""
    result = gemmaserve("plan", "--stack", stack, "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    row = stack_figures.row(stack, ROOT)
    assert row[4] == f"{data['engine']['package']} {data['engine']['vllm_version']} ({data['engine']['kind']})"
    assert row[-4:] == stack_figures.figure_cells(data)


def project_copy(tmp_path):
    """A copy of the project's stack files and docs pages, to change one without touching the repository."""
    for path in ROOT.glob("Pulumi.*.yaml"):
        shutil.copy(path, tmp_path / path.name)
    shutil.copytree(ROOT / "docs", tmp_path / "docs", ignore=shutil.ignore_patterns("*.png", "*.json"))
    return tmp_path


def test_a_changed_plan_figure_fails_the_comparison(tmp_path) -> None:
    """A stack whose plan moves (here gpu8 at utilization 0.85) no longer matches the page: the test above fails
    until `--write` is run, and --write puts the new figure in."""
    project = project_copy(tmp_path)
    stack_file = project / "Pulumi.gpu8.yaml"
    document = yaml.safe_load(stack_file.read_text())
    document["config"]["gemmaserve:workload"]["gpu_memory_utilization"] = 0.85
    stack_file.write_text(yaml.safe_dump(document))
    block = next(block for block in docs.BLOCKS if block.name == "stack-capacity")
    page = project / block.page
    assert docs.current(page.read_text(), block.name) != block.render(project)
    assert docs.stale(project, [block]) == [f"{block.page}: {block.name}"]
    assert docs.write(project, [block]) == [block.page]
    assert docs.current(page.read_text(), block.name) == block.render(project)
    assert docs.stale(project, [block]) == []


def test_a_new_stack_file_gets_a_row(tmp_path) -> None:
    project = project_copy(tmp_path)
    shutil.copy(project / "Pulumi.a100.yaml", project / "Pulumi.a100-copy.yaml")
    assert "| a100-copy | " in stack_figures.table(project)
    assert stack_figures.table(project) != stack_figures.table(ROOT)


def test_the_gpu8_block_is_the_cli_at_120_columns() -> None:
    env = {**os.environ, "COLUMNS": "120", "NO_COLOR": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "gemmaserve", "plan", "--stack", "gpu8"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    page = (ROOT / "docs" / "capacity.md").read_text()
    block = docs.current(page, "plan-gpu8")
    assert block.startswith("```console\n$ gemmaserve plan --stack gpu8\n")
    assert block.splitlines()[2:-1] == [line.rstrip() for line in result.stdout.splitlines()]


def test_write_puts_the_block_between_the_markers(tmp_path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# intro\n\n<!-- demo: old -->\n| old |\n<!-- /demo -->\n\nmore\n")
    block = docs.Block("demo", "page.md", lambda root: "| new |\n")
    assert docs.write(tmp_path, [block]) == ["page.md"]
    text = page.read_text()
    assert text == f"# intro\n\n{block.begin}\n| new |\n<!-- /demo -->\n\nmore\n"
    assert docs.write(tmp_path, [block]) == []


def test_two_blocks_of_one_page_are_written_together(tmp_path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- a: x -->\n<!-- /a -->\ntext\n<!-- b: x -->\nold\n<!-- /b -->\n")
    blocks = [docs.Block("a", "page.md", lambda root: "A\n"), docs.Block("b", "page.md", lambda root: "B\n")]
    assert docs.write(tmp_path, blocks) == ["page.md"]
    assert [docs.current(page.read_text(), name) for name in "ab"] == ["A\n", "B\n"]


@pytest.mark.parametrize(
    "text",
    [
        "# intro\n",
        "<!-- demo: x -->\nno end\n",
        "<!-- /demo -->\n<!-- demo: x -->\n",
        "<!-- demo: x -->\n<!-- /demo -->\n<!-- demo: y -->\n<!-- /demo -->\n",
    ],
    ids=["no markers", "no end", "end first", "twice"],
)
def test_write_refuses_a_page_without_one_pair_of_markers(tmp_path, text) -> None:
    page = tmp_path / "page.md"
    page.write_text(text)
    with pytest.raises(ValueError, match="no demo markers"):
        docs.write(tmp_path, [docs.Block("demo", "page.md", lambda root: "| new |\n")])
    assert page.read_text() == text
