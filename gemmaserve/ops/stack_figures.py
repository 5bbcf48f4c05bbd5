"""Each stack's plan as docs/capacity.md shows it: the capacity table and the gpu8 `gemmaserve plan` block."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from gemmaserve.plan import plan
from gemmaserve.sources import load_stack_spec

COLUMNS = (
    "stack",
    "model",
    "devices",
    "replicas",
    "engine",
    "max_model_len",
    "KV dtype",
    "speculative",
    "KV GiB/device",
    "blocks",
    '"GPU KV cache size"',
    "max concurrency",
)
# rich wraps `gemmaserve plan` at the terminal's width; the docs' console blocks are 120 columns.
CONSOLE_COLUMNS = "120"


def stacks(project_dir: Path) -> list[str]:
    """Every stack of the project: the STACK of each Pulumi.STACK.yaml."""
    return sorted(path.name.removeprefix("Pulumi.").removesuffix(".yaml") for path in project_dir.glob("Pulumi.*.yaml"))


def figure_cells(plan_json: dict) -> tuple[str, ...]:
    """The capacity cells of a plan, from `gemmaserve plan --json`'s shape: what the pinned release will log.
    Replicas that differ (they do not in any stack today) show each distinct value, in replica order."""

    def cell(key: str, fmt: str) -> str:
        return " / ".join(dict.fromkeys(format(replica[key], fmt) for replica in plan_json["replicas"]))

    return (
        cell("available_kv_cache_gib", ".2f"),
        cell("num_blocks", ","),
        cell("kv_cache_tokens", ","),
        cell("max_concurrency", ".2f") + "x",
    )


def row(stack: str, project_dir: Path) -> tuple[str, ...]:
    """One stack's row, from the plan of its Pulumi.STACK.yaml exactly as `gemmaserve plan --stack` makes it."""
    spec = load_stack_spec(stack, project_dir)
    result = plan(spec)
    if not result.ok:
        raise ValueError(f"Pulumi.{stack}.yaml: the plan is refused: {'; '.join(result.refusals)}")
    data = result.to_json()
    engine, replicas = data["engine"], data["replicas"]
    tp = ", ".join(dict.fromkeys(f"TP{replica['tensor_parallel_size']}" for replica in replicas))
    speculative = spec.workload.speculative
    return (
        stack,
        f"`{result.model.hf_id}`",
        f"{spec.accelerator.count} x {result.accelerator.name}",
        f"{len(replicas)} x {tp}",
        f"{engine['package']} {engine['vllm_version']} ({engine['kind']})",
        f"{spec.max_model_len:,}",
        spec.workload.kv_cache_dtype,
        speculative.method + (f", {speculative.num_tokens} tokens" if speculative.num_tokens else ""),
        *figure_cells(data),
    )


def table(project_dir: Path) -> str:
    """The Markdown table of every stack of the project."""
    lines = [COLUMNS, ("---",) * len(COLUMNS), *(row(stack, project_dir) for stack in stacks(project_dir))]
    return "".join(f"| {' | '.join(cells)} |\n" for cells in lines)


def plan_console(stack: str, project_dir: Path) -> str:
    """`gemmaserve plan --stack STACK` as the CLI prints it at 120 columns, in a console block (lines
    right-stripped: rich pads a centred title with spaces)."""
    env = {**os.environ, "COLUMNS": CONSOLE_COLUMNS, "NO_COLOR": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "gemmaserve", "plan", "--stack", stack],
        cwd=project_dir,
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if result.returncode != 0:
        raise ValueError(f"gemmaserve plan --stack {stack} failed ({result.returncode}): {result.stderr.strip()}")
    output = "".join(f"{line.rstrip()}\n" for line in result.stdout.splitlines())
    return f"```console\n$ gemmaserve plan --stack {stack}\n{output}```\n"
