"""`gemmaserve status`: per host and replica, unit state, health, model, load, cache use, prefix-cache hit rate
and share of the host's requests, read over ssh from each replica's own /health, /v1/models and /metrics
(replicas listen on loopback behind HAProxy), and whether the host's load balancer answers a client with the
operator's key (GEMMASERVE_API_KEY)."""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import asdict, dataclass

from prometheus_client.parser import text_string_to_metric_families

from gemmaserve.ops import fleet
from gemmaserve.ops.endpoint import API_KEY_ENV, EndpointError
from gemmaserve.plan import Plan

SEPARATOR = "----gemmaserve-status----"
# The unit state of every replica of a host that ssh could not reach; `phase` then says why.
UNREACHABLE = "unreachable"


@dataclass
class ReplicaStatus:
    host: str
    index: int
    unit: str
    state: str
    healthy: bool
    model: str | None
    running: float | None
    waiting: float | None
    kv_cache_usage: float | None
    # Tokens found in the prefix cache over tokens looked up, since the replica started (vLLM's counters).
    prefix_cache_hit_rate: float | None
    # Requests the replica finished since it started (every finish reason), and that count's share of the
    # host's: cache-affine routing spreads conversations, not requests, so shares drift apart (docs/routing.md).
    requests: float | None = None
    request_share: float | None = None
    # The counters the hit rate comes from (tokens), for rates over an interval (gemmaserve.ops.conversations).
    prefix_cache_hits: float | None = None
    prefix_cache_queries: float | None = None
    # What the unit says it is doing: "fetching weights: 412/1090 MiB ...", "loading model",
    # "compiling (12 new compile-cache files)", "ready (38 s after start)" (roles/replicas/files/replica_ready.py).
    phase: str = ""
    # The host's load balancer as a client sees it, with the key from GEMMASERVE_API_KEY: "ok", "HTTP 401", ...
    endpoint: str = "-"


def metric_sums(text: str) -> dict[str, float]:
    """Prometheus text format -> {sample name: sum over its label sets}, NaN samples left out.

    Keyed by the sample's name, as exposed: a counter's family is `vllm:prefix_cache_queries` and its samples
    are `vllm:prefix_cache_queries_total` (and `_created`). A body that stops being Prometheus text (an error
    page, a reply curl's -m cut mid-line) keeps the families read before it."""
    sums: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if not math.isnan(sample.value):
                    sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    except ValueError:
        pass
    return sums


def replica_status(
    host: str, index: int, state: str, health_code: str, models_json: str, metrics: str, phase: str = ""
) -> ReplicaStatus:
    sums = metric_sums(metrics)
    try:
        model = json.loads(models_json)["data"][0]["id"]
    except (ValueError, KeyError, IndexError):
        model = None
    # vLLM's names at the pinned release (vllm/v1/metrics/loggers.py, v0.32.0): counters vllm:prefix_cache_queries
    # and vllm:prefix_cache_hits (tokens), vllm:request_success (requests, by finished_reason); Prometheus
    # exposes counters with a _total suffix.
    queries = sums.get("vllm:prefix_cache_queries_total")
    hits = sums.get("vllm:prefix_cache_hits_total")
    return ReplicaStatus(
        host=host,
        index=index,
        unit=f"vllm@{index}.service",
        state=state,
        healthy=health_code == "200",
        model=model,
        running=sums.get("vllm:num_requests_running"),
        waiting=sums.get("vllm:num_requests_waiting"),
        kv_cache_usage=sums.get("vllm:kv_cache_usage_perc"),
        prefix_cache_hit_rate=(hits / queries) if queries else None,
        requests=sums.get("vllm:request_success_total"),
        prefix_cache_hits=hits,
        prefix_cache_queries=queries,
        phase=phase,
    )


def with_request_shares(statuses: list[ReplicaStatus]) -> list[ReplicaStatus]:
    """Each replica's share of its host's finished requests (None where a count is missing or the host has none)."""
    totals: dict[str, float] = {}
    for status in statuses:
        if status.requests is not None:
            totals[status.host] = totals.get(status.host, 0.0) + status.requests
    for status in statuses:
        total = totals.get(status.host)
        status.request_share = status.requests / total if status.requests is not None and total else None
    return statuses


def unit_phase(chunk: str) -> str:
    """The probe's last part: the replica's status line, then the weights unit's "ActiveState|StatusText|"."""
    body = chunk[1:] if chunk.startswith("\n") else chunk  # the separator's own newline
    lines = body.split("\n") + ["", ""]
    weights_state, _, weights_text = lines[1].partition("|")
    return phase_of(lines[0].strip(), weights_state, weights_text.rstrip("|"))


def phase_of(replica_text: str, weights_state: str, weights_text: str) -> str:
    """The weights unit's line while it is fetching, else the replica unit's own status line."""
    if weights_state == "activating" and weights_text:
        return weights_text
    return replica_text


def probe_script(plan: Plan) -> str:
    """One shell command that prints, per replica: unit state, /health code, /v1/models, /metrics."""
    parts = []
    for r in plan.replicas:
        base = r.url
        parts.append(
            f"systemctl is-active vllm@{r.index} || true; echo {SEPARATOR}; "
            f"curl -s -m 3 -o /dev/null -w '%{{http_code}}' {base}/health || true; echo; echo {SEPARATOR}; "
            f"curl -s -m 3 {base}/v1/models || true; echo; echo {SEPARATOR}; "
            f"curl -s -m 3 {base}/metrics || true; echo {SEPARATOR}; "
            f"systemctl show -p StatusText --value vllm@{r.index}; "
            "systemctl show -p ActiveState,StatusText --value gemmaserve-weights 2>/dev/null | tr '\\n' '|'; "
            f"echo; echo {SEPARATOR}"
        )
    return "; ".join(parts)


def endpoint_check(host: fleet.FleetHost) -> str:
    """GET /v1/models through the host's load balancer, as a client with the operator's key and CA."""
    endpoint = host.endpoint()
    if endpoint.credentials.api_key is None:
        return f"no key ({API_KEY_ENV})"
    try:
        code, _ = endpoint.request("/v1/models", timeout=10)
    except EndpointError as error:
        reason = getattr(error.__cause__, "reason", None) or error.__cause__ or error
        return f"unreachable: {reason}"[:80]
    return "ok" if code == 200 else f"HTTP {code}"


def collect(inventory: str, limit: list[str] | tuple[str, ...] = ()) -> list[ReplicaStatus]:
    """Every replica of every host (or of the hosts `limit` picks); a host ssh cannot reach gets a row per
    replica in state "unreachable" with the reason, and the others are still read."""
    import paramiko

    statuses = []
    for host in fleet.load(inventory, limit):
        name, plan = host.name, host.plan
        try:
            replicas = read_host(name, plan, host.connect())
        except (OSError, EOFError, paramiko.SSHException) as error:
            reason = f"ssh {host.address}: {error}".replace("\n", " ")[:120]
            # Nothing is known of its replicas but why.
            replicas = [replica_status(name, r.index, UNREACHABLE, "", "", "", reason) for r in plan.replicas]
        endpoint = endpoint_check(host)
        for status in replicas:
            status.endpoint = endpoint
            statuses.append(status)
    return with_request_shares(statuses)


def read_host(name: str, plan: Plan, target) -> list[ReplicaStatus]:
    """Every replica of one host, read in one ssh round trip on `target` (a testinfra host): what ssh raises
    when the host cannot be reached is raised. Request shares are left unset (with_request_shares)."""
    chunks = target.run(f"sh -c {shlex.quote(probe_script(plan))}").stdout.split(SEPARATOR)
    statuses = []
    for replica in plan.replicas:
        raw = chunks[replica.index * 5 : replica.index * 5 + 5]
        state, code, models, metrics = (c.strip() for c in raw[:4])
        statuses.append(replica_status(name, replica.index, state, code, models, metrics, unit_phase(raw[4])))
    return statuses


def as_json(statuses: list[ReplicaStatus]) -> str:
    return json.dumps({"replicas": [asdict(s) for s in statuses]}, indent=2)


def print_table(statuses: list[ReplicaStatus], console=None) -> None:
    """One table per host, sized for an 80-column terminal: the host's line carries what its replicas share
    (model, the endpoint's answer), each replica's phase has a line of its own under the table, where a long
    one wraps whole instead of in a narrow column."""
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = console or Console()
    hosts: dict[str, list[ReplicaStatus]] = {}
    for s in statuses:
        hosts.setdefault(s.host, []).append(s)

    def number(value: float | None, percent: bool = False) -> str:
        if value is None:
            return "-"
        return f"{value * 100:.1f}%" if percent else f"{value:g}"

    console.print(Text("gemmaserve status", style="bold"))
    for host, rows in hosts.items():
        models = sorted({s.model for s in rows if s.model})
        endpoints = sorted({s.endpoint for s in rows})
        console.print(
            Text.assemble(
                ("\n" + host, "bold"),
                ("  model ", "dim"),
                ", ".join(models) or "-",
                ("  endpoint ", "dim"),
                ", ".join(endpoints),
            )
        )
        # Two spaces between columns and none at the edges: the widest row (unit "deactivating") takes 72.
        table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0))
        for column in ("replica", "unit", "health", "run/wait", "KV cache", "prefix hits", "requests"):
            numeric = column not in ("replica", "unit", "health")
            table.add_column(column, justify="right" if numeric else "left", no_wrap=True)
        for s in rows:
            table.add_row(
                str(s.index),
                s.state,
                Text("ok", style="green") if s.healthy else Text("down", style="red"),
                f"{number(s.running)}/{number(s.waiting)}",
                number(s.kv_cache_usage, True),
                number(s.prefix_cache_hit_rate, True),
                number(s.request_share, True),
            )
        console.print(table)
        for s in rows:
            if s.phase:
                console.print(Text.assemble((f"replica {s.index}: ", "dim"), s.phase))
