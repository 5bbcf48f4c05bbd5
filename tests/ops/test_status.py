"""Parsing what `gemmaserve status` reads from a replica."""

import json
import os
import socket
import subprocess
import sys

from gemmaserve.ops.endpoint import API_KEY_ENV, CA_CERT_ENV
from gemmaserve.ops.status import metric_sums, probe_script, replica_status
from gemmaserve.plan import plan
from gemmaserve.sandbox.profile import sandbox_host_data
from gemmaserve.sources import spec_from_host_data
from tests import ROOT

METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 200.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 50.0
"""


def test_metric_sums_ignore_comments_and_sum_label_sets():
    sums = metric_sums(METRICS + 'vllm:num_requests_running{engine="1",model_name="m"} 2.0\n')
    assert sums["vllm:num_requests_running"] == 5.0 and sums["vllm:kv_cache_usage_perc"] == 0.25


def vllm_metrics_text(
    running: float, waiting: float, kv_cache: float, queries: float, hits: float, stop: float, length: float
) -> str:
    """A replica's /metrics as the pinned vLLM writes it: the metrics status reads, declared as
    vllm/v1/metrics/loggers.py declares them at v0.32.0 (names, documentation, labelnames ["model_name",
    "engine"], a request_success series per FinishReason, the TTFT histogram with its default buckets from
    vllm/v1/metrics/buckets.py) on prometheus_client's registry, and written by prometheus_client's exposition,
    which vLLM's /metrics route mounts (make_asgi_app, vllm/entrypoints/serve/instrumentator/metrics.py)."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    registry = CollectorRegistry()
    labels = {"model_name": "google/gemma-4-31B-it", "engine": "0"}
    names = list(labels)

    def gauge(name: str, doc: str, value: float) -> None:
        Gauge(name, doc, names, registry=registry).labels(**labels).set(value)

    def counter(name: str, doc: str, value: float) -> None:
        Counter(name, doc, names, registry=registry).labels(**labels).inc(value)

    gauge("vllm:num_requests_running", "Number of requests in model execution batches.", running)
    gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting)
    gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv_cache)
    counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", queries)
    counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", hits)
    success = Counter(
        "vllm:request_success",
        "Count of successfully processed requests.",
        [*names, "finished_reason"],
        registry=registry,
    )
    for reason, count in (("stop", stop), ("length", length), ("abort", 0), ("error", 0), ("repetition", 0)):
        success.labels(**labels, finished_reason=reason).inc(count)
    ttft = Histogram(
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        names,
        registry=registry,
        buckets=[0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0],
    )
    ttft.labels(**labels).observe(0.03)
    return generate_latest(registry).decode()


def test_status_reads_vllms_own_exposition():
    text = vllm_metrics_text(running=3, waiting=1, kv_cache=0.25, queries=200, hits=50, stop=58, length=2)
    assert "# TYPE vllm:prefix_cache_queries_total counter" in text and "_bucket{" in text  # what vLLM writes
    status = replica_status("h", 0, "active", "200", json.dumps({"data": [{"id": "m"}]}), text)
    assert (status.running, status.waiting, status.kv_cache_usage) == (3.0, 1.0, 0.25)
    assert (status.prefix_cache_queries, status.prefix_cache_hits, status.prefix_cache_hit_rate) == (200, 50, 0.25)
    assert status.requests == 60.0  # every finished_reason, not the _created timestamps beside them


def test_a_body_that_is_not_prometheus_text_gives_what_came_before_it():
    """A proxy's error page reads as no numbers; a body curl's -m cut mid-line keeps the families before it."""
    assert metric_sums("<html><body>502 Bad Gateway</body></html>") == {} and metric_sums("") == {}
    text = vllm_metrics_text(running=3, waiting=1, kv_cache=0.25, queries=200, hits=50, stop=58, length=2)
    cut = text[: text.index("vllm:num_requests_waiting{") + 20]
    assert metric_sums(cut)["vllm:num_requests_running"] == 3.0
    assert "vllm:kv_cache_usage_perc" not in metric_sums(cut)
    nan = 'vllm:kv_cache_usage_perc{engine="0",model_name="m"} NaN\n'
    assert "vllm:kv_cache_usage_perc" not in metric_sums(METRICS.replace("vllm:kv_cache_usage_perc", "x") + nan)


def test_replica_status_fields():
    status = replica_status("h", 0, "active", "200", json.dumps({"data": [{"id": "m"}]}), METRICS)
    assert (status.healthy, status.model, status.running, status.waiting) == (True, "m", 3.0, 1.0)
    assert status.prefix_cache_hit_rate == 0.25


# As the pinned vLLM's Prometheus client writes its counters (vllm/v1/metrics/loggers.py, v0.32.0): one series
# per finished_reason, labels in alphabetical order, a _created gauge beside each counter.
REQUESTS = """# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{{engine="0",finished_reason="stop",model_name="google/gemma-4-31B-it"}} {stop}
vllm:request_success_total{{engine="0",finished_reason="length",model_name="google/gemma-4-31B-it"}} {length}
vllm:request_success_total{{engine="0",finished_reason="abort",model_name="google/gemma-4-31B-it"}} 0.0
vllm:request_success_total{{engine="0",finished_reason="error",model_name="google/gemma-4-31B-it"}} 0.0
vllm:request_success_total{{engine="0",finished_reason="repetition",model_name="google/gemma-4-31B-it"}} 0.0
# HELP vllm:request_success_created Count of successfully processed requests.
# TYPE vllm:request_success_created gauge
vllm:request_success_created{{engine="0",finished_reason="stop",model_name="google/gemma-4-31B-it"}} 1.7955588314705157e+09
"""


def test_request_share_is_each_replicas_part_of_its_hosts_finished_requests():
    from gemmaserve.ops.status import with_request_shares

    rows = [
        replica_status("a", 0, "active", "200", "", METRICS + REQUESTS.format(stop="58.0", length="2.0")),
        replica_status("a", 1, "active", "200", "", METRICS + REQUESTS.format(stop="20.0", length="0.0")),
        replica_status("a", 2, "failed", "000", "", ""),
        replica_status("b", 0, "active", "200", "", METRICS + REQUESTS.format(stop="0.0", length="0.0")),
    ]
    shares = [(s.host, s.index, s.requests, s.request_share) for s in with_request_shares(rows)]
    assert shares == [("a", 0, 60.0, 0.75), ("a", 1, 20.0, 0.25), ("a", 2, None, None), ("b", 0, 0.0, None)]


def test_down_replica_has_no_numbers():
    status = replica_status("h", 1, "failed", "000", "", "")
    assert not status.healthy and status.model is None and status.kv_cache_usage is None


def test_probe_script_covers_every_replica():
    data = {**sandbox_host_data(), "gemmaserve_accelerator": {"kind": "cpu", "count": 2}}
    script = probe_script(plan(spec_from_host_data(data)))
    assert "127.0.0.1:8000/metrics" in script and "127.0.0.1:8001/metrics" in script


def test_phase_is_the_weights_units_line_while_it_fetches():
    from gemmaserve.ops.status import unit_phase

    assert unit_phase("\nready (38 s after start)\nactive|weights local in /w|\n") == "ready (38 s after start)"
    fetching = "\n\nactivating|fetching weights: 10/100 MiB (10%), 5 MiB/s|\n"
    assert unit_phase(fetching) == "fetching weights: 10/100 MiB (10%), 5 MiB/s"
    assert unit_phase("\ncompiling (3 new compile-cache files)\ninactive||\n").startswith("compiling")
    assert unit_phase("\n\ninactive||\n") == ""


def closed_loopback_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def status_cli(*args: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in (API_KEY_ENV, CA_CERT_ENV)}
    command = [sys.executable, "-m", "gemmaserve", "status", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120, env=environ)


def test_a_host_ssh_cannot_reach_is_a_row_per_replica_and_exit_1(tmp_path):
    """A fleet with a host down still gets a report: its replicas say why, the command exits 1, and the
    other hosts are read (the sandbox test proves that half against a serving host)."""
    data = {**sandbox_host_data(), "gemmaserve_accelerator": {"kind": "cpu", "count": 2}}
    data.update(ssh_hostname="127.0.0.1", ssh_port=closed_loopback_port(), ssh_user="root")
    inventory = tmp_path / "inventory.py"
    inventory.write_text(f"hosts = [('ghost-1', {data!r}), ('ghost-2', {data!r})]\n")
    result = status_cli("--inventory", str(inventory), "--limit", "ghost-1", "--json")
    assert result.returncode == 1, result.stderr[-2000:]
    rows = json.loads(result.stdout)["replicas"]
    assert [(r["host"], r["index"], r["state"], r["healthy"]) for r in rows] == [
        ("ghost-1", 0, "unreachable", False),
        ("ghost-1", 1, "unreachable", False),
    ]
    assert all(r["phase"].startswith("ssh 127.0.0.1: ") and "Unable to connect" in r["phase"] for r in rows)
    assert "unreachable over ssh: ghost-1" in result.stderr and "Traceback" not in result.stderr


def test_a_limit_that_picks_no_host_is_bad_input(tmp_path):
    inventory = tmp_path / "inventory.py"
    inventory.write_text(f"hosts = [('sandbox-1', {sandbox_host_data()!r})]\n")
    result = status_cli("--inventory", str(inventory), "--limit", "sandbox-2")
    assert result.returncode == 2 and "--limit 'sandbox-2'" in result.stderr and "sandbox-1" in result.stderr


def test_the_table_fits_80_columns_with_every_figure_whole():
    """`gemmaserve status` in an 80-column terminal: no line wider, nothing cut to an ellipsis; each host's
    replicas, hit rates and phases are there in full (a long phase wraps on a line of its own)."""
    import io

    from rich.console import Console

    from gemmaserve.ops.status import print_table, with_request_shares

    fetching = "fetching weights: 412/1090 MiB (38%), 25 MiB/s, from gs://gemmaserve-weights/google/gemma-4-31B-it"
    metrics = vllm_metrics_text(running=128, waiting=1024, kv_cache=1.0, queries=20000, hits=17468, stop=99, length=1)
    rows = [
        replica_status("gemmaserve-a3-ultra-europe-west4-1", i, "active", "200", '{"data": [{"id": "m"}]}', metrics)
        for i in range(8)
    ]
    rows[0] = replica_status(rows[0].host, 0, "deactivating", "000", "", "", fetching)
    ghost_phase = "ssh 10.0.0.9: [Errno None] Unable to connect to port 22 on 10.0.0.9"
    rows.append(replica_status("ghost", 0, "unreachable", "", "", "", ghost_phase))
    for row in rows:
        row.endpoint = "ok" if row.host != "ghost" else "unreachable: [Errno 111] Connection refused"
    console = Console(width=80, file=io.StringIO(), color_system=None)
    print_table(with_request_shares(rows), console)
    text = console.file.getvalue()
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80 and "…" not in text, text
    header = next(line for line in lines if line.startswith("replica "))
    assert header.split() == ["replica", "unit", "health", "run/wait", "KV", "cache", "prefix", "hits", "requests"]
    table = [line.split() for line in lines if line[:2] in {f"{i} " for i in range(8)}]
    assert [r[0] for r in table] == [*map(str, range(8)), "0"]  # every replica of both hosts
    assert table[1][1:] == ["active", "ok", "128/1024", "100.0%", "87.3%", "14.3%"]
    assert table[0][1:] == ["deactivating", "down", "-/-", "-", "-", "-"]
    assert table[-1][1:3] == ["unreachable", "down"]
    joined = " ".join(line.strip() for line in lines)
    assert f"replica 0: {fetching}" in joined and f"replica 0: {ghost_phase}" in joined
    assert "gemmaserve-a3-ultra-europe-west4-1 model m endpoint ok" in " ".join(joined.split())
