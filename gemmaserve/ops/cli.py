"""The operator's `gemmaserve` commands: plan, status, verify, bench, weights, keys, capacity."""

from __future__ import annotations

import json
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import typer

# No group ever prints a function's locals in a traceback (older typer releases did by default): `keys add` holds a key.
app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    help="Serve Gemma 4 with vLLM on your own hardware.",
)

EXIT_BAD_INPUT = 2
EXIT_REFUSED = 3
EXIT_UNREACHABLE = 1

# pyinfra's own --limit: a group name, else a glob on host names; repeatable.
_LIMIT = typer.Option([], "--limit", help="Only these hosts: a group name or a glob on host names (repeatable).")


def _fail(message: str, code: int) -> None:
    typer.echo(message, err=True)
    raise typer.Exit(code)


def _overrides(
    model: str | None,
    accelerator: str | None,
    count: int | None,
    max_model_len: int | None,
    gpu_memory_utilization: float | None,
    kv_cache_dtype: str | None,
    objective: str | None,
    speculative: str | None,
) -> dict[str, Any]:
    """CLI flags as a partial spec; they win over stack config."""
    data: dict[str, Any] = {}
    if model:
        data["model"] = model
    acc: dict[str, Any] = {}
    if accelerator:
        acc["kind"] = accelerator
    if count is not None:
        acc["count"] = count
    if acc:
        data["accelerator"] = acc
    workload: dict[str, Any] = {}
    for key, value in (
        ("max_model_len", max_model_len),
        ("gpu_memory_utilization", gpu_memory_utilization),
        ("kv_cache_dtype", kv_cache_dtype),
        ("objective", objective),
    ):
        if value is not None:
            workload[key] = value
    if speculative:
        method, _, tokens = speculative.partition(":")
        workload["speculative"] = {"method": method, **({"num_tokens": tokens} if tokens else {})}
    if workload:
        data["workload"] = workload
    return data


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


@app.command("plan")
def plan_command(
    stack: str | None = typer.Option(None, "--stack", help="Read Pulumi.STACK.yaml."),
    project_dir: Path = typer.Option(Path("."), "--project-dir", help="Where the Pulumi.*.yaml files are."),
    model: str | None = typer.Option(
        None,
        "--model",
        help="e2b, e4b, 31b, 26b-a4b, any Gemma 4 checkpoint's Hugging Face id (read from the local HF cache), a "
        "directory, or gs://BUCKET/PATH (read from --fetch's copy).",
    ),
    revision: str | None = typer.Option(None, "--revision", help="The checkpoint's commit sha (weights.revision)."),
    assistant_revision: str | None = typer.Option(
        None, "--assistant-revision", help="The MTP assistant's commit sha (weights.assistant_revision)."
    ),
    accelerator: str | None = typer.Option(None, "--accelerator", help="Accelerator kind, e.g. rtx-pro-6000, tpu-v6e."),
    count: int | None = typer.Option(None, "--count", help="Devices per host."),
    max_model_len: int | None = typer.Option(None, "--max-model-len"),
    gpu_memory_utilization: float | None = typer.Option(None, "--gpu-memory-utilization"),
    kv_cache_dtype: str | None = typer.Option(None, "--kv-cache-dtype", help="auto or fp8."),
    objective: str | None = typer.Option(None, "--objective", help="throughput, latency or balanced."),
    speculative: str | None = typer.Option(None, "--speculative", help="none, mtp or ngram, optionally :TOKENS."),
    vllm_version: str | None = typer.Option(
        None, "--vllm-version", help="Pinned vLLM release (capacity is reported as it logs)."
    ),
    available_kv_gib: float | None = typer.Option(
        None, "--available-kv-gib", help="Skip the memory estimate (check token accounting against a vLLM log)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    fetch: bool = typer.Option(
        False,
        "--fetch",
        help="Download the few kB planning reads (config.json, the weight index, adapter_config.json) of hub "
        "checkpoints and adapters into the local Hugging Face cache, or of a gs:// model into gemmaserve's copy, first.",
    ),
) -> None:
    """Show the replicas, vLLM argv/env and KV-cache capacity a spec produces."""
    from gemmaserve.plan import plan
    from gemmaserve.sources import SPEC_KEYS, read_stack_config, stack_scoped_secrets
    from gemmaserve.spec import SpecError, parse_spec

    flags = _overrides(
        model, accelerator, count, max_model_len, gpu_memory_utilization, kv_cache_dtype, objective, speculative
    )
    if vllm_version:
        flags["engine"] = {"vllm_version": vllm_version}
    pins = {"revision": revision, "assistant_revision": assistant_revision}
    if pins := {key: value for key, value in pins.items() if value}:
        flags["weights"] = pins
    try:
        if stack:
            # Secrets as the stack names them (gs-STACK-NAME), as its hosts and its `plan` output see them.
            base = stack_scoped_secrets(
                stack, {k: v for k, v in read_stack_config(stack, project_dir).items() if k in SPEC_KEYS}
            )
            data, source = _merge(base, flags), f"Pulumi.{stack}.yaml" + (" + flags" if flags else "")
        else:
            if "model" not in flags or "accelerator" not in flags:
                _fail("error: give --stack NAME, or at least --model and --accelerator", EXIT_BAD_INPUT)
            data, source = flags, "command-line flags"
        if fetch:
            _fetch_checkpoint_files(data)
        spec = parse_spec(data, source)
    except SpecError as error:
        _fail(f"error: {error}", EXIT_BAD_INPUT)
    if available_kv_gib is not None:
        memory = spec.accelerator_info.memory_gib
        if not (math.isfinite(available_kv_gib) and 0 < available_kv_gib <= memory):
            _fail(
                f"error: --available-kv-gib = {available_kv_gib}: allowed: a number > 0 and at most {memory:g} "
                f"(the GiB of memory of one {spec.accelerator.kind} device)",
                EXIT_BAD_INPUT,
            )

    result = plan(spec, available_kv_gib=available_kv_gib)
    if as_json:
        if result.ok:
            typer.echo(json.dumps(result.to_json(), indent=2))
    else:
        _print_plan(result)
    if not result.ok:
        _fail("refused:\n" + "\n".join(f"  - {r}" for r in result.refusals), EXIT_REFUSED)


def _fetch_checkpoint_files(data: dict[str, Any]) -> None:
    """`plan --fetch`: only the small files gemmaserve.checkpoint reads, for a hub model that is not in the catalog
    and for hub adapters, through huggingface_hub (its cache, token and endpoint settings); for a gs:// model,
    through google-cloud-storage (application default credentials) into the planner's copy. Each is reported."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    from gemmaserve.catalog import CATALOG
    from gemmaserve.checkpoint import ADAPTER_CONFIG_FILE, CONFIG_FILE, GCS_CHECKPOINT, HUB_REPO, INDEX_FILE

    wanted: list[tuple[str, str | None, tuple[str, ...]]] = []
    model = data.get("model")
    if isinstance(model, str) and GCS_CHECKPOINT.fullmatch(model):
        _fetch_from_bucket(model.rstrip("/"), (CONFIG_FILE, INDEX_FILE))
    if isinstance(model, str) and HUB_REPO.fullmatch(model):
        try:
            CATALOG.model(model)
        except KeyError:
            wanted.append((model, (data.get("weights") or {}).get("revision"), (CONFIG_FILE, INDEX_FILE)))
    for adapter in (data.get("serving") or {}).get("lora_adapters") or []:
        source = adapter.get("source") if isinstance(adapter, dict) else None
        if isinstance(source, str) and HUB_REPO.fullmatch(source):
            wanted.append((source, adapter.get("revision"), (ADAPTER_CONFIG_FILE,)))
    for repo, revision, files in wanted:
        for name in files:
            try:
                hf_hub_download(repo, name, revision=revision)
            except EntryNotFoundError:
                typer.echo(f"fetch: {repo} has no {name}", err=True)
                continue
            except Exception as error:  # noqa: BLE001 - network, auth or a missing repo: say which file
                _fail(f"error: --fetch {repo} {name}: {type(error).__name__}: {error}", EXIT_BAD_INPUT)
            typer.echo(f"fetch: {repo} {name}" + (f" at {revision}" if revision else ""), err=True)


def _fetch_from_bucket(uri: str, files: tuple[str, ...]) -> None:
    """Copy a gs:// checkpoint's small files into the planner's local copy (gemmaserve.checkpoint.gcs_cache_dir); a
    file the path does not hold is reported, not fatal (a single-file checkpoint has no index)."""
    from google.api_core import exceptions

    from gemmaserve.checkpoint import gcs_cache_dir
    from gemmaserve.ops.weights import storage_client

    bucket_name, _, path = uri.removeprefix("gs://").partition("/")
    target = gcs_cache_dir(uri)
    target.mkdir(parents=True, exist_ok=True)
    try:
        bucket = storage_client().bucket(bucket_name)
        for name in files:
            blob = bucket.blob(f"{path}/{name}")
            try:
                data = blob.download_as_bytes()
            except exceptions.NotFound:
                typer.echo(f"fetch: {uri} has no {name}", err=True)
                continue
            (target / name).write_bytes(data)
            typer.echo(f"fetch: {uri}/{name} ({len(data):,} bytes)", err=True)
    except exceptions.GoogleAPICallError as error:
        _fail(f"error: --fetch {uri}: {error.message}", EXIT_BAD_INPUT)
    except Exception as error:  # noqa: BLE001 - credentials or network: say which path
        _fail(f"error: --fetch {uri}: {type(error).__name__}: {error}", EXIT_BAD_INPUT)


def _print_plan(result) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    spec = result.spec
    title = (
        f"{result.model.hf_id} on {spec.accelerator.count} x {result.accelerator.name}"
        f" (vLLM {spec.vllm_version}, {spec.engine.kind}, max_model_len {spec.max_model_len})"
    )
    table = Table(title=title)
    for column in ("replica", "devices", "TP", "port", "weights GiB/dev", "KV GiB/dev", "KV tokens", "max concurrency"):
        table.add_column(column, justify="right")
    for r in result.replicas:
        c = r.capacity
        table.add_row(
            str(r.index),
            ",".join(map(str, r.devices)) or "-",
            str(r.tensor_parallel_size),
            str(r.port),
            f"{c.weights_gib_per_device:.1f}",
            f"{c.available_kv_cache_gib:.2f}" + ("" if c.estimated else " (given)"),
            f"{c.kv_cache_tokens:,}",
            f"{c.max_concurrency:.2f}x",
        )
    if result.replicas:
        console.print(table)
        first = result.replicas[0]
        c = first.capacity
        console.print(
            f"KV cache counted as {c.accounting} (block size {c.block_size}, "
            f"max_num_batched_tokens {c.max_num_batched_tokens})",
            markup=False,
            highlight=False,
        )
        if p := c.profile:
            graphs = f", {p.cudagraphs} CUDA graphs x {p.cudagraph_mib:.1f} MiB" if p.cudagraphs else ""
            console.print(
                f"besides weights and KV cache, per GPU: {p.derived:.2f} GiB from vLLM's source (profile-run peak "
                f"{p.activations:.2f}, load-time buffers {p.loaded_extra:.2f}, runner state {p.persistent:.2f}) + "
                f"{p.margin:.2f} GiB margin for what only the GPU measures (non-torch memory "
                f"{p.non_torch_margin:.2f}{graphs}; docs/capacity.md)",
                markup=False,
                highlight=False,
            )
        if c.lora_slots_gib:
            console.print(
                f"LoRA slots: {len(result.adapters)} at --max-lora-rank "
                f"{first.argv[first.argv.index('--max-lora-rank') + 1]} take "
                f"{c.lora_slots_gib:.2f} GiB per GPU from the KV cache (docs/checkpoints.md)",
                markup=False,
                highlight=False,
            )
        console.print("[bold]replica 0 command[/bold] (others differ only in devices and port):")
        devices = [f"{k}={v}" for k, v in first.env.items() if k.endswith("VISIBLE_DEVICES")]
        console.print(" ".join(devices + [shlex.join(first.argv)]), soft_wrap=True, markup=False, highlight=False)
        console.print("[bold]environment[/bold]:")
        for key, value in first.env.items():
            console.print(f"  {key}={value}", markup=False, highlight=False)
    weights = result.weights
    where = {
        "pull": f"pulled from {weights.uri} to {weights.local_dir} before replicas start",
        "stream": f"streamed from {weights.uri} (Run:ai Model Streamer)",
        "local": f"served from {result.model.local_dir}",
        "hub": "downloaded from Hugging Face before replicas start"
        + (f" (revision {weights.revision})" if weights.revision else ""),
    }[weights.mode]
    if weights.mode in ("local", "stream") and (weights.hub_assistant or weights.hub_adapters):
        downloads = [*weights.hub_adapters, *([weights.hub_assistant] if weights.hub_assistant else [])]
        pinned = [f"{repo}@{revision[:12]}" for repo, revision in downloads]
        where += f"; downloaded from Hugging Face before replicas start: {', '.join(pinned)}"
    console.print(f"[bold]weights[/bold]: {where}", markup=True, highlight=False)
    if result.quantization:
        q = result.quantization
        how = "16-bit weights quantized while vLLM loads them" if q.flags else "detected by vLLM from config.json"
        console.print(f"quantization: {q.describe()}, {how}", markup=False, highlight=False)
    for adapter in result.adapters:
        console.print(
            f"LoRA adapter: {adapter.name} (rank {adapter.rank}, from {adapter.source})", markup=False, highlight=False
        )
    if result.replicas:
        console.print(f"[bold]routing[/bold]: {result.routing.describe()}", markup=True, highlight=False)
    for warning in result.warnings:
        console.print(f"[yellow]warning:[/yellow] {warning}")


weights_app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_show_locals=False)
app.add_typer(weights_app, name="weights", help="Model weights in the stack's bucket (a mirror of Hugging Face).")


@weights_app.command("mirror")
def weights_mirror(
    stack: str | None = typer.Option(None, "--stack", help="Take model, weights.bucket and weights.revision from it."),
    model: str | None = typer.Option(None, "--model", help="Catalog alias or Hugging Face id (overrides the stack)."),
    bucket: str | None = typer.Option(
        None, "--bucket", help="gs://BUCKET or gs://BUCKET/PREFIX (overrides the stack)."
    ),
    revision: str | None = typer.Option(
        None, "--revision", help="Commit sha (40 hex); with --resolve, a branch or tag to pin."
    ),
    source_dir: Path | None = typer.Option(
        None, "--from-dir", help="Mirror a local directory (a test model or a snapshot) instead of the hub."
    ),
    resolve: bool = typer.Option(False, "--resolve", help="Print the commit sha --revision points to, copy nothing."),
) -> None:
    """Copy one pinned model revision, and the stack's LoRA adapters and MTP assistant at theirs, into the bucket:
    resumable, checked against the hub's hashes, idempotent."""
    from gemmaserve.ops import weights as mirror_ops
    from gemmaserve.plan import WeightsPlan
    from gemmaserve.sources import read_stack_config
    from gemmaserve.spec import SpecError, parse_spec

    try:
        config = read_stack_config(stack) if stack else {}
        spec_weights = dict(config.get("weights") or {})
        model_name = model or config.get("model")
        if resolve and source_dir:  # a directory's content revision: a model's or an adapter's
            typer.echo(mirror_ops.LocalSource(source_dir).resolve(revision))
            return
        if not model_name:
            raise SpecError(["model: give --model or --stack"], "weights mirror")
        if resolve:
            typer.echo(mirror_ops.HubSource(_model_id(model_name)).resolve(revision))
            return
        spec_weights.update({k: v for k, v in {"bucket": bucket, "revision": revision}.items() if v})
        spec_weights["source"] = "bucket"
        data = {"model": model_name, "accelerator": {"kind": "cpu"}, "weights": spec_weights}
        if adapters := (config.get("serving") or {}).get("lora_adapters"):
            data["serving"] = {"lora_adapters": adapters}
        if speculative := (config.get("workload") or {}).get("speculative"):
            data["workload"] = {"speculative": speculative}  # MTP: the assistant is mirrored beside the model
        # The hub checkpoint's and adapters' small files the spec reads (the mirror downloads them anyway).
        _fetch_checkpoint_files({k: v for k, v in data.items() if k != "model"} if source_dir else data)
        parsed = parse_spec(data, "weights mirror")
    except SpecError as error:
        _fail(f"error: {error}", EXIT_BAD_INPUT)
    plan = WeightsPlan.of(parsed)
    source = mirror_ops.LocalSource(source_dir) if source_dir else mirror_ops.HubSource(plan.model_id)
    try:
        mirror_ops.mirror(plan, source, progress=typer.echo)
        mirror_ops.mirror_adapters(plan, progress=typer.echo)
        mirror_ops.mirror_assistant(plan, progress=typer.echo)
    except mirror_ops.MirrorError as error:
        _fail(f"error: {error}", 1)


def _model_id(name: str) -> str:
    from gemmaserve.catalog import CATALOG

    try:
        return CATALOG.model(name).hf_id
    except KeyError:
        return name


@app.command("status")
def status_command(
    inventory: str = typer.Option("hosts/sandbox.py", "--inventory", help="A pyinfra inventory file."),
    limit: list[str] = _LIMIT,
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Per host and replica: unit state, health, model, running/waiting requests, KV-cache and prefix-cache use.

    Exits 1 when a host could not be reached over ssh (its replicas show as unreachable, with the reason)."""
    from gemmaserve.ops import fleet
    from gemmaserve.ops.status import UNREACHABLE, collect, print_table
    from gemmaserve.ops.status import as_json as status_json
    from gemmaserve.spec import SpecError

    try:
        statuses = collect(inventory, limit)
    except (SpecError, FileNotFoundError, fleet.InventoryError) as error:
        _fail(f"error: {error}", EXIT_BAD_INPUT)
    typer.echo(status_json(statuses)) if as_json else print_table(statuses)
    unreachable = sorted({s.host for s in statuses if s.state == UNREACHABLE})
    if unreachable:
        _fail(f"unreachable over ssh: {', '.join(unreachable)}", EXIT_UNREACHABLE)


@app.command("verify", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def verify(
    ctx: typer.Context,
    inventory: str = typer.Option("hosts/sandbox.py", "--inventory", help="A pyinfra inventory file."),
    limit: list[str] = _LIMIT,
) -> None:
    """Run the testinfra verification suite (gemmaserve/ops/verify) against every host of an inventory (or the
    hosts --limit picks); other arguments go to pytest."""
    import subprocess

    suite = Path(__file__).resolve().parent / "verify"
    command = [sys.executable, "-m", "pytest", str(suite), "--inventory", inventory, "-p", "no:cacheprovider", "-q"]
    for pattern in limit:
        command += ["--limit", pattern]
    raise typer.Exit(subprocess.call([*command, *ctx.args], cwd=Path.cwd()))


@app.command("bench")
def bench(
    inventory: str = typer.Option("hosts/sandbox.py", "--inventory", help="A pyinfra inventory file."),
    limit: list[str] = _LIMIT,
    workload: str = typer.Option(
        "profiles",
        "--workload",
        help="profiles: `vllm bench serve` over --profile and --concurrency; multi-turn: conversations that each "
        "resend their history (prefix reuse, hit rate, TTFT, request share per replica; docs/routing.md).",
    ),
    profile: list[str] = typer.Option(
        ["prompt-heavy", "decode-heavy", "balanced"],
        "--profile",
        help="prompt-heavy (8000/1000), decode-heavy (1000/8000), balanced (1000/1000).",
    ),
    concurrency: str = typer.Option("1,16,32,64,128,256", "--concurrency", help="Comma-separated sweep."),
    scale: float = typer.Option(
        1.0, "--scale", help="Multiply the profiles' token lengths (e.g. 0.01 on the sandbox)."
    ),
    prompts_per_level: int = typer.Option(4, "--prompts-per-level", help="Prompts per unit of concurrency."),
    conversations: int = typer.Option(32, "--conversations", help="multi-turn: how many conversations."),
    turns: int = typer.Option(4, "--turns", help="multi-turn: turns per conversation (2 or more)."),
    clients: int = typer.Option(8, "--clients", help="multi-turn: conversations in flight at once."),
    system_prompt_words: int = typer.Option(
        1000, "--system-prompt-words", help="multi-turn: length of each conversation's own system prompt."
    ),
    max_tokens: int = typer.Option(32, "--max-tokens", help="multi-turn: tokens per answer."),
    turn_words: int = typer.Option(0, "--turn-words", help="multi-turn: words each user turn adds (pasted text)."),
    order: str = typer.Option(
        "conversations",
        "--order",
        help="multi-turn: conversations (each client sends one conversation's turns back to back) or rounds (every "
        "conversation's turn N, shuffled, before any turn N+1: think time between turns).",
    ),
    request_timeout: float = typer.Option(120, "--request-timeout", help="multi-turn: seconds one turn may take."),
    out: Path = typer.Option(
        Path("bench-results"), "--out", help="Directory for bench.json and bench.png (multi-turn.json/.png)."
    ),
) -> None:
    """Run `vllm bench serve` on each host against its load balancer (or, with --workload multi-turn, multi-turn
    conversations through it); print a table, write JSON and a PNG plot."""
    from gemmaserve.ops import bench as benchmark
    from gemmaserve.ops import fleet

    if workload not in benchmark.WORKLOADS:
        _fail(f"error: --workload = {workload!r}: allowed: {', '.join(benchmark.WORKLOADS)}", EXIT_BAD_INPUT)
    if workload == "multi-turn":
        _bench_multi_turn(
            inventory,
            limit,
            out,
            conversations=conversations,
            turns=turns,
            clients=clients,
            system_prompt_words=system_prompt_words,
            max_tokens=max_tokens,
            timeout=request_timeout,
            turn_words=turn_words,
            order=order,
        )
        return
    unknown = [p for p in profile if p not in benchmark.PROFILES]
    if unknown:
        _fail(f"error: --profile = {unknown[0]!r}: allowed: {', '.join(benchmark.PROFILES)}", EXIT_BAD_INPUT)
    try:
        levels = [int(c) for c in concurrency.split(",")]
        if any(c < 1 for c in levels):
            raise ValueError
    except ValueError:
        _fail(f"error: --concurrency = {concurrency!r}: allowed: comma-separated positive integers", EXIT_BAD_INPUT)
    if scale <= 0:
        _fail(f"error: --scale = {scale}: must be > 0", EXIT_BAD_INPUT)
    try:
        points = benchmark.run(inventory, profile, levels, scale, prompts_per_level, log=typer.echo, limit=limit)
    except fleet.InventoryError as error:
        _fail(f"error: {error}", EXIT_BAD_INPUT)
    out.mkdir(parents=True, exist_ok=True)
    benchmark.write_json(points, out / "bench.json")
    benchmark.print_table(points)
    try:
        benchmark.write_plot(points, out / "bench.png")
    except ImportError:
        typer.echo(f"wrote {out / 'bench.json'}; no plot: install the plot extra (pip install 'gemmaserve[plot]')")
        return
    typer.echo(f"wrote {out / 'bench.json'} and {out / 'bench.png'}")


# The multi-turn workload's fields as `gemmaserve bench` names them.
_WORKLOAD_OPTIONS = {"timeout": "--request-timeout"}


def _bench_multi_turn(inventory: str, limit: list[str], out: Path, **fields: Any) -> None:
    import paramiko

    from gemmaserve.ops import bench as benchmark
    from gemmaserve.ops import conversations as multi_turn
    from gemmaserve.ops import fleet
    from gemmaserve.spec import SpecError

    workload = multi_turn.Workload(**fields)
    for field, allowed in workload.problems().items():
        option = _WORKLOAD_OPTIONS.get(field, "--" + field.replace("_", "-"))
        _fail(f"error: {option} = {getattr(workload, field)}: allowed: {allowed}", EXIT_BAD_INPUT)
    try:
        runs = benchmark.run_multi_turn(inventory, workload, log=typer.echo, limit=limit)
    except (fleet.InventoryError, FileNotFoundError, SpecError) as error:
        _fail(f"error: {error}", EXIT_BAD_INPUT)
    except (RuntimeError, OSError, EOFError, paramiko.SSHException) as error:
        _fail(f"error: {error}", 1)
    multi_turn.report(runs, out, log=typer.echo)
    silent = [run.name for run in runs if not run.completed]
    if silent:
        first = next(turn.error or f"HTTP {turn.status}" for run in runs for turn in run.turns if not turn.ok)
        _fail(f"no turn was answered: {', '.join(silent)} (first failure: {first})", 1)


keys_app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_show_locals=False)
app.add_typer(
    keys_app, name="keys", help="API keys the endpoint accepts: in a stack's Secret Manager secret or on hosts."
)


def _keys_target(stack: str | None, inventory: str | None) -> None:
    if (stack is None) == (inventory is None):
        _fail("error: give exactly one of --stack NAME (Secret Manager) or --inventory FILE (hosts)", EXIT_BAD_INPUT)


_STACK = typer.Option(None, "--stack", help="Keys in this stack's Secret Manager secret (serving.api_keys).")
_INVENTORY = typer.Option(None, "--inventory", help="Keys in the key store file on every host of this inventory.")
_PROJECT_DIR = typer.Option(Path("."), "--project-dir", help="Where the Pulumi.*.yaml files are.")


@keys_app.command("add")
def keys_add(
    key_id: str = typer.Argument(..., help="A name for the key (who uses it): a-z, 0-9, '_', '.', '-'."),
    stack: str | None = _STACK,
    inventory: str | None = _INVENTORY,
    project_dir: Path = _PROJECT_DIR,
    key_stdin: bool = typer.Option(
        False, "--key-stdin", help="Read the key from standard input instead of making one."
    ),
) -> None:
    """Make a key (printed once, on stdout) and let the endpoint accept it: only its digest is stored."""
    from gemmaserve.ops import keys

    _keys_target(stack, inventory)
    key, digest = keys.new_key()
    if key_stdin:
        key = sys.stdin.readline().strip()
        weak = keys.weak_key(key)
        if weak:
            _fail(f"error: --key-stdin: {weak}", EXIT_BAD_INPUT)
        digest = keys.key_digest(key)
    try:
        if stack:
            secret = keys.stack_secret(stack, project_dir)
            version = keys.secret_change(secret, "add", key_id, digest)
            typer.echo(f"key {key_id} added: {version}; hosts follow within their refresh interval", err=True)
        else:
            hosts = keys.inventory_change(inventory, "add", key_id, digest)
            typer.echo(f"key {key_id} added and live on {', '.join(hosts)}", err=True)
    except keys.spec_errors() as error:
        _fail(f"error: {error}", EXIT_BAD_INPUT)
    if not key_stdin:
        typer.echo(key)


@keys_app.command("revoke")
def keys_revoke(
    key_id: str = typer.Argument(..., help="The key's name."),
    stack: str | None = _STACK,
    inventory: str | None = _INVENTORY,
    project_dir: Path = _PROJECT_DIR,
) -> None:
    """Stop accepting a key: from the next request on each host (inventory) or within seconds (stack)."""
    from gemmaserve.ops import keys

    _keys_target(stack, inventory)
    try:
        if stack:
            version = keys.secret_change(keys.stack_secret(stack, project_dir), "revoke", key_id)
            typer.echo(f"key {key_id} revoked: {version}; hosts follow within their refresh interval", err=True)
        else:
            hosts = keys.inventory_change(inventory, "revoke", key_id)
            typer.echo(f"key {key_id} revoked on {', '.join(hosts)}", err=True)
    except keys.spec_errors() as error:
        _fail(f"error: {error}", EXIT_BAD_INPUT)


@keys_app.command("list")
def keys_list(
    stack: str | None = _STACK,
    inventory: str | None = _INVENTORY,
    project_dir: Path = _PROJECT_DIR,
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """The ids of the keys the endpoint accepts, and when each was added (never a key)."""
    from gemmaserve.ops import keys

    _keys_target(stack, inventory)
    try:
        if stack:
            listing = {keys.stack_secret(stack, project_dir): keys.secret_list(keys.stack_secret(stack, project_dir))}
        else:
            listing = keys.inventory_list(inventory)
    except keys.spec_errors() as error:
        _fail(f"error: {error}", EXIT_BAD_INPUT)
    if as_json:
        typer.echo(json.dumps(listing, indent=2))
        return
    for where, entries in listing.items():
        typer.echo(f"{where}:")
        for entry in entries or [{"id": "(no keys: every request is refused)", "created": ""}]:
            typer.echo(f"  {entry['id']:<24} {entry['created']}")


capacity_app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_show_locals=False)
_STACK = typer.Option(..., "--stack", help="The Pulumi stack (Pulumi.STACK.yaml).")
_PROJECT_DIR = typer.Option(Path("."), "--project-dir", help="Where Pulumi.yaml and the stack files are.")


def _open_capacity(stack: str, project_dir: Path):
    """The stack (checked against its stack file first) and read-only cloud clients with its credentials."""
    from gemmaserve.cloud.config import parse_cloud
    from gemmaserve.ops import capacity
    from gemmaserve.sources import read_stack_config, stack_file
    from gemmaserve.spec import SpecError

    try:
        config = read_stack_config(stack, project_dir)
        if "cloud" in config:  # what the program reads first, so a bad value stops here, not in `pulumi up`
            parse_cloud(config["cloud"], str(stack_file(stack, project_dir)))
    except SpecError as error:
        _fail(f"error: {error}", EXIT_BAD_INPUT)
    try:
        opened = capacity.open_stack(stack, project_dir)
    except FileNotFoundError as error:
        _fail(f"error: {error.filename or error}: not found; `gemmaserve capacity` drives the pulumi CLI", 1)
    except Exception as error:  # noqa: BLE001 - the automation API's CommandError, StackNotFoundError, ...
        _fail(f"error: stack {stack}: {type(error).__name__}: {str(error).strip()[:1000]}", 1)
    return capacity, opened, capacity.open_clouds(opened)


def _log(message: str) -> None:
    stamp = time.strftime("%H:%M:%S")
    for line in message.rstrip().splitlines() or [""]:
        typer.echo(f"[{stamp}] {line}", err=True)


@capacity_app.command("status")
def capacity_status(
    stack: str = _STACK,
    project_dir: Path = _PROJECT_DIR,
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Each queued resource / VM: state, zone, provisioning model, time in queue, time left, and what `up` would do."""
    capacity, opened, clouds = _open_capacity(stack, project_dir)
    rows = capacity.survey(opened, clouds, capacity.clock())
    typer.echo(capacity.as_json(rows)) if as_json else capacity.print_table(rows, stack)


@capacity_app.command("wait")
def capacity_wait(
    stack: str = _STACK,
    project_dir: Path = _PROJECT_DIR,
    timeout: str = typer.Option("6h", "--timeout", help="Give up after this long (e.g. 90m, 6h, 2d)."),
    poll: float = typer.Option(60, "--poll", help="Seconds between looks."),
    as_json: bool = typer.Option(False, "--json", help="Print the capacity and the hosts output as JSON."),
) -> None:
    """Until every queued resource / VM is ACTIVE (re-queueing through `pulumi up` as needed), then refresh hosts."""
    seconds = _duration_option("--timeout", timeout)
    if not (math.isfinite(poll) and 1 <= poll <= 86400):
        _fail(f"error: --poll = {poll}: allowed: 1 to 86400 seconds", EXIT_BAD_INPUT)
    capacity, opened, clouds = _open_capacity(stack, project_dir)
    ready, rows, outputs = capacity.wait(
        opened, clouds, seconds, poll, _log, clock=capacity.clock, sleep=capacity.pause
    )
    if as_json:
        typer.echo(json.dumps({"ready": ready, "capacity": json.loads(capacity.as_json(rows)), **outputs}, indent=2))
    else:
        capacity.print_table(rows, stack)
        if ready:
            typer.echo(f"ready: deploy with GEMMASERVE_STACK={stack} pyinfra hosts/stack.py deploy.py")
    raise typer.Exit(0 if ready else 1)


@capacity_app.command("watch")
def capacity_watch(
    stack: str = _STACK,
    project_dir: Path = _PROJECT_DIR,
    interval: str = typer.Option("5m", "--interval", help="Time between passes (e.g. 60s, 5m)."),
    once: bool = typer.Option(False, "--once", help="One pass, then exit (for a timer or a CI schedule)."),
) -> None:
    """Reconciler: re-queue dead capacity along the fallback chain, recycle flex-start, refresh hosts (systemd-friendly)."""
    seconds = _duration_option("--interval", interval)
    if not 1 <= seconds <= 86400:
        _fail(f"error: --interval = {interval!r}: allowed: 1s to 1d, e.g. 60s or 5m", EXIT_BAD_INPUT)
    capacity, opened, clouds = _open_capacity(stack, project_dir)
    stopper = capacity.Stopper().install()
    passes = capacity.watch(
        opened, clouds, seconds, _log, passes=1 if once else None, sleep=stopper.sleep, stop=stopper
    )
    raise typer.Exit(1 if passes and passes[-1].error else 0)


def _duration_option(flag: str, value: str) -> float:
    from gemmaserve.spec import parse_duration

    try:
        return parse_duration(value).total_seconds()
    except ValueError as error:
        _fail(f"error: {flag} = {value!r}: {error}", EXIT_BAD_INPUT)


# The sandbox's commands (demo, tiny-model, sandbox) are not here: gemmaserve/__main__.py plugs them in.
app.add_typer(
    capacity_app,
    name="capacity",
    help="TPU queued resources and GPU VMs of a stack: status, wait until ACTIVE, watch (re-queue, recycle).",
)
