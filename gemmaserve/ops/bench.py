"""`gemmaserve bench`: `vllm bench serve` on each host against its load balancer, over the benchmark
profiles of vLLM's Gemma 4 recipe and a concurrency sweep; a table, a JSON file and a PNG plot of throughput and latency.
With `--workload multi-turn`, conversations sent to each host's balancer (gemmaserve.ops.conversations) instead."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from gemmaserve.ops import conversations, fleet
from gemmaserve.ops.endpoint import API_KEY_ENV, CA_CERT_ENV
from gemmaserve.ops.status import metric_sums
from gemmaserve.plan import CONTAINER_RUNTIME, HF_HOME, STATE_DIR, Plan

# vLLM's Gemma 4 recipe, "Benchmark Configurations" (https://docs.vllm.ai/projects/recipes/en/latest/Google/Gemma4.html): input / output tokens.
PROFILES = {"prompt-heavy": (8000, 1000), "decode-heavy": (1000, 8000), "balanced": (1000, 1000)}
# The same recipe's concurrency sweep: 1, 16, 32, 64, 128, 256.
DEFAULT_CONCURRENCY = (1, 16, 32, 64, 128, 256)
RESULT_DIR = "/tmp/gemmaserve-bench"
# `--workload`: vLLM's benchmark over PROFILES, or multi-turn conversations that share each one's prefix.
WORKLOADS = ("profiles", "multi-turn")
FIELDS = (
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "completed",
    "failed",
)
SPEC_METRICS = (
    "vllm:spec_decode_num_accepted_tokens_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_drafts_total",
)


@dataclass(frozen=True)
class Point:
    host: str
    profile: str
    concurrency: int
    input_len: int
    output_len: int
    num_prompts: int
    results: dict[str, float]
    acceptance_rate: float | None = None
    accepted_length: float | None = None


def bench_command(
    plan: Plan,
    profile: str,
    input_len: int,
    output_len: int,
    concurrency: int,
    prompts: int,
    base_url: str,
    ca_cert: str | None = None,
) -> str:
    """The `vllm bench serve` line for one point, run on the host against its own HAProxy at `base_url`
    (https://ADDRESS:PORT, the name its certificate carries). The API key arrives on standard input and
    reaches vLLM's benchmark as OPENAI_API_KEY (never on a command line); `ca_cert` (a file on the host)
    is what its TLS client trusts (SSL_CERT_FILE; in container mode a file under RESULT_DIR, which the
    container mounts)."""
    model = plan.model
    tokenizer = model.local_dir or model.hf_id
    if plan.engine.kind == "wheel":
        vllm = f"{plan.engine.vllm_executable}"
    else:
        # The serving image's own `vllm bench`, under the same runtime and flags the replicas use.
        vllm = (
            f"{CONTAINER_RUNTIME} run --rm --pull=never --cgroups=disabled --network=host -v {STATE_DIR}:{STATE_DIR} "
            f"-v {RESULT_DIR}:{RESULT_DIR} -e HF_HOME={HF_HOME} -e OPENAI_API_KEY "
            f"{'-e SSL_CERT_FILE ' if ca_cert else ''}--entrypoint vllm {plan.engine.image}"
        )
    env = f"HF_HOME={HF_HOME} " + ("HF_HUB_OFFLINE=1 " if model.is_test_model else "")
    if ca_cert:
        env += f"SSL_CERT_FILE={ca_cert} "
    args = [
        "bench",
        "serve",
        "--backend",
        "openai-chat",
        "--endpoint",
        "/v1/chat/completions",
        "--base-url",
        base_url,
        "--model",
        model.hf_id,
        "--tokenizer",
        tokenizer,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(input_len),
        "--random-output-len",
        str(output_len),
        "--num-prompts",
        str(prompts),
        "--max-concurrency",
        str(concurrency),
        "--request-rate",
        "inf",
        "--ignore-eos",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        RESULT_DIR,
        "--result-filename",
        f"{profile}-c{concurrency}.json",
    ]
    return (
        f"IFS= read -r OPENAI_API_KEY && export OPENAI_API_KEY && mkdir -p {RESULT_DIR} && "
        f"{env}{vllm} {shlex.join(args)} >/dev/null 2>{RESULT_DIR}/{profile}-c{concurrency}.log"
    )


def _spec_counters(target, plan: Plan) -> dict[str, float]:
    """Speculative-decoding counters summed over the replicas, read on loopback (the balancer hides /metrics)."""
    sums: dict[str, float] = {}
    for replica in plan.replicas:
        for name, value in metric_sums(target.run(f"curl -s -m 10 {replica.url}/metrics").stdout).items():
            sums[name] = sums.get(name, 0.0) + value
    return {m: sums.get(m, 0.0) for m in SPEC_METRICS}


def run(
    inventory: str,
    profiles: list[str],
    concurrency: list[int],
    scale: float,
    prompts_per_level: int,
    log=print,
    limit: list[str] | tuple[str, ...] = (),
) -> list[Point]:
    points: list[Point] = []
    for host in fleet.load(inventory, limit):
        name, plan, target = host.name, host.plan, host.connect()
        endpoint = host.endpoint()
        if endpoint.credentials.api_key is None:
            raise RuntimeError(f"{name}: set {API_KEY_ENV} to a key of this endpoint (and {CA_CERT_ENV} to its CA)")
        ca_on_host = None
        if endpoint.credentials.ca_cert:
            # The CA certificate is public; the benchmark on the host trusts it to verify HAProxy's certificate.
            ca_on_host = f"{RESULT_DIR}/ca.pem"
            pem = Path(endpoint.credentials.ca_cert).read_text()
            target.run(f"mkdir -p {RESULT_DIR} && cat > {ca_on_host} <<'EOF'\n{pem}\nEOF")
        mtp = plan.spec.workload.speculative.method != "none"
        for profile in profiles:
            base_in, base_out = PROFILES[profile]
            input_len, output_len = max(1, int(base_in * scale)), max(1, int(base_out * scale))
            for level in concurrency:
                prompts = max(level * prompts_per_level, level)
                before = _spec_counters(target, plan) if mtp else {}
                log(f"{name}: {profile} {input_len}/{output_len} tokens, concurrency {level}, {prompts} prompts")
                command = bench_command(plan, profile, input_len, output_len, level, prompts, endpoint.root, ca_on_host)
                rc, _, _ = fleet.run_with_secret(target, command, endpoint.credentials.api_key)
                if rc != 0:
                    tail = target.run(f"tail -20 {RESULT_DIR}/{profile}-c{level}.log").stdout
                    raise RuntimeError(f"{name}: vllm bench serve failed ({profile}, c={level}):\n{tail}")
                raw = json.loads(target.run(f"cat {RESULT_DIR}/{profile}-c{level}.json").stdout)
                extra: dict[str, Any] = {}
                if mtp:
                    after = _spec_counters(target, plan)
                    delta = {k: after[k] - before[k] for k in SPEC_METRICS}
                    drafted, drafts = delta[SPEC_METRICS[1]], delta[SPEC_METRICS[2]]
                    if drafted:
                        extra["acceptance_rate"] = delta[SPEC_METRICS[0]] / drafted
                        extra["accepted_length"] = 1 + delta[SPEC_METRICS[0]] / drafts if drafts else None
                points.append(
                    Point(
                        name,
                        profile,
                        level,
                        input_len,
                        output_len,
                        prompts,
                        {f: raw[f] for f in FIELDS if f in raw},
                        **extra,
                    )
                )
    return points


def run_multi_turn(
    inventory: str,
    workload: conversations.Workload,
    log=print,
    limit: list[str] | tuple[str, ...] = (),
) -> list[conversations.PolicyRun]:
    """The multi-turn workload against each host's balancer, as a client calls it, under the routing policy the
    host is deployed with; its replicas' counters are read over ssh before and after (conversations.measure)."""
    runs = []
    for host in fleet.load(inventory, limit):
        plan = host.plan
        endpoint = host.endpoint()
        if endpoint.credentials.api_key is None:
            raise RuntimeError(
                f"{host.name}: set {API_KEY_ENV} to a key of this endpoint (and {CA_CERT_ENV} to its CA)"
            )
        target = host.connect()
        log(f"{host.name}: {workload.describe()}, routing {plan.routing.policy}")
        run = conversations.measure(
            endpoint,
            plan.model.hf_id,
            workload,
            plan.replicas[0].capacity.prefix_cache_block,
            partial(conversations.read_counters, target, plan, host.name),
            host=host.name,
            policy=plan.routing.policy,
        )
        runs.append(run)
    return runs


def write_json(points: list[Point], path: Path) -> None:
    path.write_text(json.dumps({"points": [p.__dict__ for p in points]}, indent=2) + "\n")


def write_plot(points: list[Point], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (throughput, latency) = plt.subplots(1, 2, figsize=(11, 4.2))
    for host, profile in sorted({(p.host, p.profile) for p in points}):
        series = sorted((p for p in points if (p.host, p.profile) == (host, profile)), key=lambda p: p.concurrency)
        x = [p.concurrency for p in series]
        label = f"{profile} ({series[0].input_len}/{series[0].output_len}) {host}"
        throughput.plot(x, [p.results.get("output_throughput", 0) for p in series], marker="o", label=label)
        latency.plot(x, [p.results.get("p99_ttft_ms", 0) for p in series], marker="o", label=f"{label} p99 TTFT")
        latency.plot(
            x, [p.results.get("p99_tpot_ms", 0) for p in series], marker="x", linestyle="--", label=f"{label} p99 TPOT"
        )
    for axis, ylabel in ((throughput, "output tokens/s"), (latency, "ms")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrency")
        axis.set_ylabel(ylabel)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=7)
    throughput.set_title("throughput")
    latency.set_title("latency (p99)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(points: list[Point]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="gemmaserve bench")
    for column in (
        "host",
        "profile",
        "conc.",
        "req/s",
        "out tok/s",
        "TTFT mean",
        "TTFT p99",
        "TPOT mean",
        "TPOT p99",
        "failed",
        "MTP accept",
        "accepted len",
    ):
        table.add_column(column, justify="right")
    for p in points:
        r = p.results
        table.add_row(
            p.host,
            p.profile,
            str(p.concurrency),
            f"{r.get('request_throughput', 0):.2f}",
            f"{r.get('output_throughput', 0):.1f}",
            f"{r.get('mean_ttft_ms', 0):.1f}",
            f"{r.get('p99_ttft_ms', 0):.1f}",
            f"{r.get('mean_tpot_ms', 0):.1f}",
            f"{r.get('p99_tpot_ms', 0):.1f}",
            str(r.get("failed", 0)),
            "-" if p.acceptance_rate is None else f"{p.acceptance_rate:.0%}",
            "-" if p.accepted_length is None else f"{p.accepted_length:.2f}",
        )
    Console().print(table)
