"""The sandbox's commands, plugged into the operator's CLI: `gemmaserve sandbox ...` (local systemd-nspawn
hosts up and down), `gemmaserve demo` and `gemmaserve tiny-model`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer

# Only typer at module level: `gemmaserve plan` imports this module and must start in < 1 s.
sandbox_app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_show_locals=False)


def _console_log():
    from rich.console import Console

    console = Console(stderr=True, log_path=False)
    return lambda message: console.log(message, highlight=False)


def _fail(error: Exception) -> None:
    typer.secho(f"sandbox: {error}", fg=typer.colors.RED, err=True)
    raise typer.Exit(1)


@sandbox_app.command()
def up(
    hosts: int = typer.Option(1, "--hosts", "-n", min=1, max=254, help="How many hosts (sandbox-1..N)."),
    bind_ro: list[str] | None = typer.Option(
        None,
        "--bind-ro",
        help="SRC[:DST] to bind read-only into every new host (repeatable); "
        "/opt/gemmaserve/venvs and /var/lib/gemmaserve/models are bound when they exist.",
    ),
) -> None:
    """Boot sandbox hosts (idempotent: running hosts are kept, dead ones restarted)."""
    from gemmaserve.sandbox import lifecycle

    try:
        lifecycle.up(hosts, bind_ro=bind_ro or [], log=_console_log())
    except (RuntimeError, OSError, ValueError) as error:
        _fail(error)
    _print_table(lifecycle.status())


@sandbox_app.command()
def down() -> None:
    """Stop every sandbox host and remove its netns, veth, cgroups, files and the NAT table."""
    from gemmaserve.sandbox import lifecycle

    try:
        lifecycle.down(log=_console_log())
    except (RuntimeError, OSError) as error:
        _fail(error)


@sandbox_app.command()
def status(as_json: bool = typer.Option(False, "--json", help='Machine-readable: {"hosts": [...]}.')) -> None:
    """List sandbox hosts; endpoint is set once the host's load balancer answers /health."""
    from gemmaserve.sandbox import lifecycle

    records = lifecycle.status()
    if as_json:
        typer.echo(json.dumps({"hosts": [r.public() for r in records]}, indent=2))
    else:
        _print_table(records)


def _print_table(records) -> None:
    from rich.console import Console
    from rich.table import Table

    if not records:
        Console().print("no sandbox hosts; start one with `gemmaserve sandbox up`")
        return
    table = Table("name", "state", "address", "ssh", "endpoint")
    for r in records:
        state = "[green]running[/]" if r.running else "[red]dead[/]"
        table.add_row(r.name, state, r.address, f"{r.ssh_user}@{r.address}:{r.ssh_port}", r.endpoint or "-")
    console = Console()
    console.print(table)
    if any(r.ca_cert for r in records):
        # The key is not printed in the table (shoulder surfing, terminal logs); scripts read it from --json.
        ca = next(r.ca_cert for r in records if r.ca_cert)
        console.print(f"CA: {ca}   API key: `gemmaserve sandbox status --json` (api_key)")


@sandbox_app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def ssh(ctx: typer.Context, name: str = typer.Argument(..., help="Host name, e.g. sandbox-1.")) -> None:
    """Open a shell on a host (extra arguments run as a command)."""
    from gemmaserve.sandbox import state

    host = state.load_state().host(name)
    if host is None:
        _fail(RuntimeError(f"no host named {name}; see `gemmaserve sandbox status`"))
    argv = [
        "ssh",
        "-i",
        str(state.SSH_KEY),
        "-p",
        str(state.SSH_PORT),
        # Host keys are regenerated on every `up`: pinning them would only produce warnings.
        "-o",
        "StrictHostKeyChecking=no",
        "-o",
        "UserKnownHostsFile=/dev/null",
        "-o",
        "LogLevel=ERROR",
        f"{state.SSH_USER}@{host.address}",
        *ctx.args,
    ]
    os.execvp("ssh", argv)


@sandbox_app.command()
def reboot(name: str = typer.Argument(..., help="Host name, e.g. sandbox-1.")) -> None:
    """Reboot a host: a clean shutdown inside, then the same rootfs boots again."""
    from gemmaserve.sandbox import lifecycle

    try:
        lifecycle.reboot(name, log=_console_log())
    except RuntimeError as error:
        _fail(error)


@sandbox_app.command()
def bench(
    cold: bool = typer.Option(False, "--cold", help="Delete the cached rootfs first and time the debootstrap build."),
    deploy: bool = typer.Option(False, "--deploy", help="Also deploy the demo profile and time serving restarts."),
    fleet: int = typer.Option(0, "--fleet", help="Also time one pyinfra run deploying N fresh hosts against 1."),
    weights: bool = typer.Option(
        False,
        "--weights",
        help="Also time cold starts of a 1 GB test model (local, pulled from the sandbox's bucket) against the "
        "disk's and the bucket's floors, and a second host warm from the bucket's compile cache vs cold.",
    ),
    engines: bool = typer.Option(
        False, "--engines", help="Also compare the wheel and the container engine on fresh hosts."
    ),
    routing: bool = typer.Option(
        False,
        "--routing",
        help="Also run one multi-turn workload under each routing policy on a fresh host of two replicas: prefix "
        "reuse, hit rate, TTFT p50/p99, request share per replica (a table, routing.json and routing.png in --out).",
    ),
    vllm_router: bool = typer.Option(
        True,
        "--vllm-router/--no-vllm-router",
        help="With --routing: also run the workload through vllm-router (pinned, installed from PyPI once) under "
        "its cache_aware and consistent_hash policies, in front of the same replicas.",
    ),
    out: Path = typer.Option(Path("bench-results"), "--out", help="Where --routing writes routing.json and .png."),
) -> None:
    """Print sandbox figures: rootfs build and unpack, host up, boot to ssh, idle RSS, down
    (with --deploy: pyinfra deploy, no-op redeploy, first token after cold and warm restarts, eager and
    compiled; with --fleet N: N fresh hosts in one pyinfra run against 1, with the CPU floor; with
    --engines: image build, deploy, no-op redeploy and restarts, wheel against container; with --routing:
    both routing policies under one multi-turn workload)."""
    from gemmaserve.sandbox import figures as sandbox_figures

    try:
        figures = sandbox_figures.measure(cold=cold, log=_console_log())
        if deploy:
            figures.update(sandbox_figures.measure_deploy(log=_console_log()))
        if fleet:
            figures.update(sandbox_figures.measure_fleet(fleet, log=_console_log()))
        if weights:
            figures.update(sandbox_figures.measure_weights(log=_console_log()))
        if engines:
            figures.update(sandbox_figures.measure_engines(log=_console_log()))
        runs = sandbox_figures.measure_routing(log=_console_log(), vllm_router=vllm_router) if routing else []
    except (RuntimeError, OSError) as error:
        _fail(error)
    sandbox_figures.print_figures(figures)
    if runs:
        from gemmaserve.ops.conversations import report

        report(runs, out, stem="routing", log=typer.echo)


def demo(
    down: bool = typer.Option(False, "--down", help="Remove everything the demo made."),
    weights: str = typer.Option(
        "local", "--weights", help="local: the bound test model; bucket: mirror it into the sandbox's bucket, pull it."
    ),
    engine: str = typer.Option(
        "wheel", "--engine", help="wheel (the pinned venv) or container (the same vLLM from a locally built image)."
    ),
) -> None:
    """Sandbox host -> real pyinfra deploy -> vLLM (CPU) + HAProxy -> verified endpoint."""
    from gemmaserve.sandbox.demo import DemoError, run_demo, run_demo_down

    if weights not in ("local", "bucket"):
        typer.echo(f"error: --weights = {weights!r}: allowed: local, bucket", err=True)
        raise typer.Exit(2)
    try:
        run_demo_down() if down else run_demo(engine, weights=weights)
    except DemoError as error:
        typer.echo(f"demo failed: {error}", err=True)
        raise typer.Exit(1) from None


def tiny_model(out: str = typer.Argument(..., help="Directory to write the checkpoint to.")) -> None:
    """Build a tiny, randomly initialised Gemma 4 checkpoint (a TEST model, not for production)."""
    from gemmaserve.sandbox.tiny_model import build_tiny_model

    path = build_tiny_model(out)
    typer.echo(f"tiny test model written to {path}")


def plug_into(app: typer.Typer) -> typer.Typer:
    """Add the sandbox's commands to the operator's CLI (gemmaserve.ops.cli), which imports nothing of the
    sandbox: `demo` after `plan`, `tiny-model` after the other commands, the `sandbox` group before `capacity`,
    where `gemmaserve --help` lists them."""
    if any(info.name == "demo" for info in app.registered_commands):
        return app
    app.command("demo")(demo)
    app.command("tiny-model")(tiny_model)
    app.add_typer(sandbox_app, name="sandbox", help="Local sandbox hosts (systemd-nspawn) for demos and tests.")
    _move(app.registered_commands, "demo", after="plan")
    _move(app.registered_groups, "sandbox", before="capacity")
    return app


def _move(infos: list, name: str, after: str | None = None, before: str | None = None) -> None:
    """Move the command or group `name` right after `after` or right before `before` (where that one is)."""
    names = [info.name for info in infos]
    anchor = after or before
    if name not in names or anchor not in names:
        return
    info = infos.pop(names.index(name))
    names.remove(name)
    infos.insert(names.index(anchor) + (1 if after else 0), info)
