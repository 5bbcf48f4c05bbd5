"""The multi-turn workload (gemmaserve.ops.conversations) against a stub OpenAI-compatible server on loopback that
plays two replicas behind a balancer: prompt tokens are words, each replica keeps a prefix cache in 16-token
blocks and counts its hits, queries and requests on a /metrics of its own. Every figure is checked against the
value computed by hand from the stub's token counts."""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from rich.console import Console
from typer.testing import CliRunner

from gemmaserve.ops import conversations
from gemmaserve.ops.conversations import (
    PolicyRun,
    ReplicaCounters,
    Turn,
    Workload,
    counter_deltas,
    ideal_reuse,
    measure,
    percentile,
    read_counters,
    system_prompt,
)
from gemmaserve.ops.endpoint import Credentials, Endpoint, request
from gemmaserve.ops.status import SEPARATOR
from gemmaserve.plan import plan
from gemmaserve.sandbox.profile import sandbox_host_data
from gemmaserve.sources import spec_from_host_data

KEY = "stub-key"
BLOCK = 16
ANSWER = ["alpha", " beta", " gamma"]  # 3 words: each answer adds 3 prompt tokens to the next turn
# The workload the hand-computed figures below are for: system prompts of 100 words, user turns of 7
# ("Turn 1: tell me more about c0."), so a conversation's prompts are 107, 117 and 127 tokens.
WORKLOAD = Workload(conversations=4, turns=3, clients=2, system_prompt_words=100, max_tokens=3, timeout=5)
PROMPTS = [107, 117, 127]
# Ideal reuse per conversation: floor(107 / 16) x 16 + floor(117 / 16) x 16 = 96 + 112.
IDEAL_PER_CONVERSATION = 208


@dataclass
class Replica:
    hits: int = 0
    queries: int = 0
    requests: int = 0
    cached: dict[str, int] = field(default_factory=dict)  # conversation -> longest prompt it holds

    def metrics(self) -> str:
        # As vLLM's Prometheus client writes them: label sets summed by metric_sums, a _created gauge beside.
        return (
            "# TYPE vllm:prefix_cache_queries_total counter\n"
            f'vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} {float(self.queries)}\n'
            f'vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} {float(self.hits)}\n'
            f'vllm:request_success_total{{engine="0",finished_reason="stop",model_name="m"}} {self.requests - 1 if self.requests else 0}.0\n'
            f'vllm:request_success_total{{engine="0",finished_reason="length",model_name="m"}} {min(self.requests, 1)}.0\n'
            f'vllm:request_success_created{{engine="0",finished_reason="stop",model_name="m"}} 1.7e+09\n'
        )


class Stub:
    """The balancer and its two replicas. `routing`: "affinity" (conversation cN to replica N % 2) or "alternate"
    (turn 1 to replica 0, turn 2 to replica 1, ...). `fail`/`hang`/`drip`: (conversation, turn) to answer 500, to
    answer nothing for 3 s, or to stream a chunk every 0.1 s for 3 s; `broken`: to stream an error chunk after the
    200, `no_usage`: to leave the usage chunk out; `reasoning`: (conversation, turn) -> the delta field ("reasoning"
    or "reasoning_content") that carries 0.5 s of thinking before the answer."""

    def __init__(self) -> None:
        self.routing = "affinity"
        self.replicas = [Replica(), Replica()]
        self.fail: set[tuple[str, int]] = set()
        self.hang: set[tuple[str, int]] = set()
        self.drip: set[tuple[str, int]] = set()
        self.broken: set[tuple[str, int]] = set()
        self.no_usage: set[tuple[str, int]] = set()
        self.reasoning: dict[tuple[str, int], str] = {}
        self.lock = threading.Lock()
        self.bodies: list[dict] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                index = int(self.path.split("/")[2])  # /replica/N/metrics
                self._send(200, stub.replicas[index].metrics().encode(), "text/plain")

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.headers.get("Authorization") != f"Bearer {KEY}":
                    return self._send(401, b'{"error": "no key"}')
                stub.bodies.append(body)
                stub.answer(self, body)

            def _send(self, status: int, data: bytes, kind: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.errors: list[BaseException] = []
        self.server.handle_error = self._error
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()
        self.endpoint = Endpoint(f"http://127.0.0.1:{self.server.server_address[1]}/v1", Credentials(KEY))

    def _error(self, request, address) -> None:
        error = sys.exc_info()[1]
        if not isinstance(error, ConnectionError):  # a client that gave up (the timeout tests) closed its socket
            self.errors.append(error)

    def metrics(self, index: int) -> str:
        status, body = request(f"{self.endpoint.root}/replica/{index}/metrics", timeout=5)
        assert status == 200
        return body

    def answer(self, handler: BaseHTTPRequestHandler, body: dict) -> None:
        messages = body["messages"]
        name = messages[0]["content"].split()[6].rstrip(".")
        turn = sum(m["role"] == "user" for m in messages)
        assert body["stream"] and body["stream_options"] == {"include_usage": True}
        if (name, turn) in self.fail:
            return handler._send(500, b'{"error": "replica failed"}')
        if (name, turn) in self.hang:
            time.sleep(3)
        prompt = sum(len(m["content"].split()) for m in messages)
        replica = self.replicas[int(name[-1]) % 2 if self.routing == "affinity" else (turn - 1) % 2]
        with self.lock:  # as a replica's scheduler counts: whole cached blocks of this prompt
            replica.queries += prompt
            replica.hits += min(replica.cached.get(name, 0), prompt) // BLOCK * BLOCK
            replica.cached[name] = max(replica.cached.get(name, 0), prompt)
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream")
        handler.end_headers()  # no length: the stream ends when the connection closes
        handler.close_connection = True

        def event(payload: dict | str) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            handler.wfile.write(f"data: {data}\n\n".encode())
            handler.wfile.flush()

        event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}], "usage": None})
        if (name, turn) in self.broken:  # as vLLM reports an engine error in a stream it has begun
            return event({"error": {"object": "error", "message": "engine died", "code": 500}})
        if (name, turn) in self.reasoning:
            event({"choices": [{"index": 0, "delta": {self.reasoning[name, turn]: "Let me think."}}], "usage": None})
            time.sleep(0.5)
        if (name, turn) in self.drip:
            for _ in range(30):
                time.sleep(0.1)
                event({"choices": [{"index": 0, "delta": {"content": "."}}], "usage": None})
        time.sleep(0.05)  # the time to first token
        for piece in ANSWER:
            event({"choices": [{"index": 0, "delta": {"content": piece}}], "usage": None})
        time.sleep(0.05)
        if (name, turn) not in self.no_usage:
            usage = {"prompt_tokens": prompt, "completion_tokens": 3, "total_tokens": prompt + 3}
            event({"choices": [], "usage": usage})
        event("[DONE]")

        # vLLM counts a finished request just after handing its last output on: counters lag the answer.
        def finished() -> None:
            with self.lock:
                replica.requests += 1

        threading.Timer(0.2, finished).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(autouse=True)
def quick_counter_polls(monkeypatch):
    monkeypatch.setattr(conversations, "COUNTERS_POLL_S", 0.05)


@pytest.fixture
def stub():
    server = Stub()
    yield server
    server.close()
    assert not server.errors, server.errors


class FakeHost:
    """A testinfra host whose shell answers `gemmaserve status`'s probe with the stub's replicas: what reading
    the counters over ssh gets on a real host."""

    def __init__(self, stub: Stub, host_plan) -> None:
        self.stub, self.plan, self.commands = stub, host_plan, []

    def run(self, command: str):
        self.commands.append(command)
        out = "".join(
            f"active\n{SEPARATOR}\n200\n{SEPARATOR}\n{{}}\n{SEPARATOR}\n{self.stub.metrics(r.index)}{SEPARATOR}\n"
            f"ready\nactive||\n{SEPARATOR}\n"
            for r in self.plan.replicas
        )
        return type("Result", (), {"stdout": out, "rc": 0})()


def two_replica_plan():
    return plan(spec_from_host_data({**sandbox_host_data(), "gemmaserve_accelerator": {"kind": "cpu", "count": 2}}))


def run_stub(stub: Stub, routing: str, names: list[str], policy: str) -> PolicyRun:
    stub.routing = routing
    host_plan = two_replica_plan()
    host = FakeHost(stub, host_plan)
    run = measure(
        stub.endpoint,
        "m",
        WORKLOAD,
        BLOCK,
        partial(read_counters, host, host_plan, "stub"),
        host="stub",
        policy=policy,
        names=names,
    )
    assert len(host.commands) >= 2 and all("127.0.0.1:8001/metrics" in c for c in host.commands)
    return run


def test_system_prompt_has_the_words_asked_and_names_its_conversation():
    text = system_prompt("c7", 100)
    assert len(text.split()) == 100 and text.startswith("You are the assistant of conversation c7.")
    assert system_prompt("c8", 100) != text


def test_prefix_affinity_on_the_stub_reaches_the_ideal_reuse(stub):
    """Every turn on its conversation's replica: each turn after the first hits the previous prompt's whole
    blocks. By hand: ideal 4 x 208 = 832; hits 832 of 4 x (107 + 117 + 127) = 1,404 tokens looked up; c0, c2 and
    c4 on replica 0 (9 requests), c1 on replica 1 (3)."""
    run = run_stub(stub, "affinity", ["c0", "c1", "c2", "c4"], "prefix-affinity")
    assert [t.prompt_tokens for t in run.turns] == PROMPTS * 4
    assert [(t.conversation, t.turn) for t in run.turns[:3]] == [("c0", 1), ("c0", 2), ("c0", 3)]
    assert (run.completed, run.failed) == (12, 0)
    assert run.ideal_reuse == 4 * IDEAL_PER_CONVERSATION == 832
    assert (run.prefix_cache_hits, run.prefix_cache_queries) == (832, 1404)
    assert run.reuse_of_ideal == 1.0 and run.hit_rate == pytest.approx(832 / 1404)
    assert [r.requests for r in run.replicas] == [9, 3] and run.request_share == [0.75, 0.25]
    # The stub waits 50 ms before the first token and 50 ms more before the end.
    assert all(0.05 <= t.ttft < t.latency and t.latency >= 0.1 for t in run.turns)
    assert 0.05 <= run.ttft(50) <= run.ttft(99) < 5
    # The conversation's history is resent: turn 3 carries both earlier answers, as the client read them.
    third = next(b for b in stub.bodies if b["messages"][-1]["content"] == "Turn 3: tell me more about c0.")
    assert [m["content"] for m in third["messages"] if m["role"] == "assistant"] == ["alpha beta gamma"] * 2


def test_turns_on_other_replicas_reuse_only_what_that_replica_saw(stub):
    """Turn 1 on replica 0, turn 2 on replica 1 (nothing cached), turn 3 on replica 0 (turn 1's 107 tokens: 96
    in whole blocks). By hand: 4 x 96 = 384 hits, 384 / 832 of the ideal; 8 requests on replica 0, 4 on 1."""
    run = run_stub(stub, "alternate", ["d0", "d1", "d2", "d4"], "least-outstanding")
    assert run.ideal_reuse == 832 and run.prefix_cache_hits == 384
    assert run.reuse_of_ideal == pytest.approx(384 / 832) and run.hit_rate == pytest.approx(384 / 1404)
    assert run.request_share == pytest.approx([2 / 3, 1 / 3])


def test_a_failed_turn_ends_its_conversation_and_leaves_the_ideal(stub):
    stub.fail.add(("f1", 2))
    workload = Workload(conversations=2, turns=3, clients=2, system_prompt_words=100, max_tokens=3, timeout=5)
    turns = conversations.run_workload(stub.endpoint, "m", ["f0", "f1"], workload)
    failed = [t for t in turns if t.conversation == "f1"]
    assert [(t.turn, t.status, t.ok) for t in failed] == [(1, 200, True), (2, 500, False)]
    assert "replica failed" in failed[1].error and failed[1].prompt_tokens is None
    assert ideal_reuse(turns, BLOCK) == IDEAL_PER_CONVERSATION  # f0's only: f1's second turn never got an answer


def test_a_turn_that_gets_no_answer_in_time_is_a_failure_not_a_hang(stub):
    stub.hang.add(("h1", 1))
    workload = Workload(conversations=1, turns=2, clients=1, system_prompt_words=100, max_tokens=3, timeout=0.5)
    started = time.monotonic()
    [turn] = conversations.run_workload(stub.endpoint, "m", ["h1"], workload)
    assert time.monotonic() - started < 2.5
    assert turn.status == 0 and not turn.ok and "timed out" in turn.error.lower()


def test_a_stream_that_runs_past_the_timeout_is_cut_off(stub):
    """Each chunk comes well within the socket timeout; the whole stream is bounded all the same."""
    stub.drip.add(("s1", 1))
    workload = Workload(conversations=1, turns=2, clients=1, system_prompt_words=100, max_tokens=3, timeout=0.5)
    [turn] = conversations.run_workload(stub.endpoint, "m", ["s1"], workload)
    assert turn.status == 200 and turn.error.startswith("timeout: the stream ran past 0.5 s")
    assert turn.latency < 2.5 and turn.ttft is not None


def test_an_error_chunk_in_the_stream_is_a_failed_turn(stub):
    stub.broken.add(("b1", 1))
    [turn] = conversations.run_workload(stub.endpoint, "m", ["b1"], WORKLOAD)
    assert (turn.status, turn.ok) == (200, False) and turn.error.startswith("error in the stream:")
    assert "engine died" in turn.error


def test_a_stream_without_usage_is_a_failed_turn(stub):
    stub.no_usage.add(("u1", 1))
    [turn] = conversations.run_workload(stub.endpoint, "m", ["u1"], WORKLOAD)
    assert (turn.status, turn.ok) == (200, False) and "no usage in the stream" in turn.error


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_the_first_token_may_be_reasoning_and_the_answer_is_only_the_content(stub, field):
    """vLLM streams a reasoning model's thinking in a delta field of its own (reasoning_content in older releases,
    reasoning in newer ones): that is generated text, so the first token; the answer resent next turn is the
    content alone."""
    stub.reasoning[("r1", 1)] = field
    workload = Workload(conversations=1, turns=2, clients=1, system_prompt_words=100, max_tokens=3, timeout=5)
    first, second = conversations.run_workload(stub.endpoint, "m", ["r1"], workload)
    assert first.ok and second.ok and first.ttft < 0.4 and first.latency >= 0.5
    assert [m["content"] for m in stub.bodies[-1]["messages"] if m["role"] == "assistant"] == ["alpha beta gamma"]


def test_a_wrong_key_is_a_failed_turn(stub):
    endpoint = Endpoint(stub.endpoint.base_url, Credentials("wrong"))
    [turn] = conversations.run_workload(endpoint, "m", ["k1"], WORKLOAD)
    assert (turn.status, turn.ok) == (401, False)


def test_ideal_reuse_counts_whole_blocks_of_the_previous_answered_prompt():
    def turn(n: int, prompt: int | None, status: int = 200) -> Turn:
        return Turn("c", n, status, prompt, 3, 0.1, 0.2)

    assert ideal_reuse([turn(1, 107), turn(2, 117), turn(3, 127)], 16) == 96 + 112
    assert ideal_reuse([turn(3, 127), turn(1, 107), turn(2, 117)], 16) == 96 + 112  # any order
    assert ideal_reuse([turn(1, 107), turn(2, None, 500)], 16) == 0
    assert ideal_reuse([turn(1, 32), turn(2, 40)], 16) == 32  # a prompt of whole blocks is reused whole
    assert ideal_reuse([turn(1, 15), turn(2, 40)], 16) == 0  # less than one block: nothing


def test_percentiles_interpolate_between_ranks():
    values = [float(v) for v in range(100, 0, -1)]
    assert percentile(values, 50) == 50.5 and percentile(values, 99) == pytest.approx(99.01)
    assert percentile([0.2], 99) == 0.2 and percentile([], 50) is None and percentile([1.0, 2.0], 50) == 1.5


def test_counters_come_from_the_replicas_metrics_as_status_reads_them():
    text = (
        'vllm:prefix_cache_hits_total{engine="0"} 5.0\nvllm:prefix_cache_queries_total{engine="0"} 20.0\n'
        'vllm:request_success_total{finished_reason="stop"} 3.0\nvllm:request_success_total{finished_reason="length"} 1.0\n'
    )
    assert ReplicaCounters.from_metrics(1, text) == ReplicaCounters(1, 5.0, 20.0, 4.0)
    with pytest.raises(RuntimeError, match="replica 0: no vLLM counters"):
        ReplicaCounters.from_metrics(0, "")


def test_counters_that_go_back_are_an_error():
    before = [ReplicaCounters(0, 10, 100, 5), ReplicaCounters(1, 0, 50, 2)]
    after = [ReplicaCounters(0, 30, 180, 9), ReplicaCounters(1, 0, 10, 1)]
    with pytest.raises(RuntimeError, match="replica 1: its counters went back"):
        counter_deltas(before, after)
    later = [ReplicaCounters(0, 30, 180, 9), ReplicaCounters(1, 0, 60, 3)]
    assert counter_deltas(before, later) == [ReplicaCounters(0, 20, 80, 4), ReplicaCounters(1, 0, 10, 1)]


@pytest.fixture(scope="module")
def two_runs() -> list[PolicyRun]:
    """One run per policy on one stub (the table, JSON, plot and CLI tests only read them)."""
    server = Stub()
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(conversations, "COUNTERS_POLL_S", 0.05)
            runs = [
                run_stub(server, "alternate", ["e0", "e1", "e2", "e4"], "least-outstanding"),
                run_stub(server, "affinity", ["g0", "g1", "g2", "g4"], "prefix-affinity"),
            ]
    finally:
        server.close()
    assert not server.errors, server.errors
    return runs


def test_table_and_json_hold_both_policies(two_runs, tmp_path):
    console = Console(record=True, width=200)
    conversations.print_table(two_runs, console)
    text = console.export_text()
    least, affine = (line for line in text.splitlines() if "least-outstanding" in line or "prefix-affinity" in line)
    # reuse of ideal, hit rate and request shares, computed by hand above: 384/832, 384/1404, 8/12 and 4/12;
    # 832/832, 832/1404, 9/12 and 3/12.
    assert [cell.strip() for cell in least.split("│")[3:6]] == ["12/12", "46%", "27%"] and "67% / 33%" in least
    assert [cell.strip() for cell in affine.split("│")[3:6]] == ["12/12", "100%", "59%"] and "75% / 25%" in affine
    conversations.write_json(two_runs, tmp_path / "runs.json")
    runs = json.loads((tmp_path / "runs.json").read_text())["runs"]
    assert [(r["policy"], r["ideal_reuse"], r["prefix_cache_hits"]) for r in runs] == [
        ("least-outstanding", 832, 384),
        ("prefix-affinity", 832, 832),
    ]
    assert [r["request_share"] for r in runs[1]["replicas"]] == [0.75, 0.25]
    assert len(runs[1]["turns"]) == 12 and runs[1]["workload"]["turns"] == 3
    assert runs[1]["ttft_p50_s"] >= 0.05 and set(runs[1]["ttft_p50_by_turn_s"]) == {"1", "2", "3"}


def test_plot_is_a_png(two_runs, tmp_path):
    pytest.importorskip("matplotlib")
    conversations.write_plot(two_runs, tmp_path / "runs.png")
    assert (tmp_path / "runs.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- the command line ---------------------------------------------------------------------------------------


def bench_cli(*args: str):
    from gemmaserve.ops.cli import app

    result = CliRunner().invoke(app, ["bench", *args], env={"COLUMNS": "200"})
    assert "Traceback" not in result.output, result.output
    return result


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workload", "unknown"], "--workload = 'unknown': allowed: profiles, multi-turn"),
        (["--workload", "multi-turn", "--turns", "1"], "--turns = 1: allowed: 2 or more"),
        (["--workload", "multi-turn", "--conversations", "0"], "--conversations = 0: allowed: 1 or more"),
        (["--workload", "multi-turn", "--clients", "0"], "--clients = 0: allowed: 1 or more"),
        (["--workload", "multi-turn", "--max-tokens", "0"], "--max-tokens = 0: allowed: 1 or more"),
        (["--workload", "multi-turn", "--system-prompt-words", "3"], "--system-prompt-words = 3: allowed: 8 or more"),
        (["--workload", "multi-turn", "--request-timeout", "nan"], "--request-timeout = nan: allowed: a number"),
        (["--workload", "multi-turn", "--request-timeout", "0"], "--request-timeout = 0.0: allowed: a number"),
        (["--workload", "multi-turn", "--order", "random"], "--order = random: allowed: conversations or rounds"),
        (["--workload", "multi-turn", "--turn-words", "-1"], "--turn-words = -1: allowed: 0 or more"),
    ],
)
def test_bad_multi_turn_input_names_the_option(args, message):
    # Checked before any inventory is read: the inventory named here does not exist.
    result = bench_cli("--inventory", "/nonexistent/inventory.py", *args)
    assert result.exit_code == 2 and message in result.output, result.output


def test_multi_turn_bench_writes_table_json_and_plot(two_runs, tmp_path, monkeypatch):
    from gemmaserve.ops import bench

    asked = {}

    def fake_run(inventory, workload, log, limit):
        asked.update(inventory=inventory, workload=workload, limit=limit)
        return two_runs

    monkeypatch.setattr(bench, "run_multi_turn", fake_run)
    out = tmp_path / "out"
    result = bench_cli("--workload", "multi-turn", "--turns", "3", "--clients", "2", "--limit", "h1", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert asked["workload"] == Workload(turns=3, clients=2) and asked["limit"] == ["h1"]
    bench_cli("--workload", "multi-turn", "--order", "rounds", "--turn-words", "40", "--out", str(out))
    assert asked["workload"] == Workload(order="rounds", turn_words=40)
    assert "least-outstanding" in result.output and "prefix-affinity" in result.output
    assert {r["policy"] for r in json.loads((out / "multi-turn.json").read_text())["runs"]} == set(
        conversations.POLICIES
    )
    assert (out / "multi-turn.png").exists() or "no plot" in result.output


def test_sandbox_routing_comparison_deploys_each_policy_on_two_replicas():
    from gemmaserve.sandbox.figures import ROUTING_POLICIES, ROUTING_WORKLOAD, routing_host_data

    assert sorted(ROUTING_POLICIES) == sorted(conversations.POLICIES) and not ROUTING_WORKLOAD.problems()
    for policy in ROUTING_POLICIES:
        host_plan = plan(spec_from_host_data({**sandbox_host_data(), **routing_host_data(policy)})).require_ok()
        assert host_plan.routing.policy == policy and len(host_plan.replicas) == 2


def test_rounds_send_every_first_turn_before_any_second_in_a_shuffled_order(stub):
    """order "rounds": turn N of every conversation is answered before any turn N + 1 is sent, each round in an
    order of its own (not the names' order every time), and a user message carries `turn_words` more words."""
    workload = Workload(conversations=6, turns=3, clients=2, system_prompt_words=20, max_tokens=3, timeout=5,
                        turn_words=25, order="rounds")  # fmt: skip
    names = [f"c{i}" for i in range(6)]
    turns = conversations.run_workload(stub.endpoint, "m", names, workload)
    assert len(turns) == 18 and all(turn.ok for turn in turns)
    sent = [(body["messages"][0]["content"].split()[6].rstrip("."), sum(m["role"] == "user" for m in body["messages"]))
            for body in stub.bodies]  # fmt: skip
    assert [turn for _, turn in sent] == [1] * 6 + [2] * 6 + [3] * 6
    rounds = [[name for name, _ in sent[i : i + 6]] for i in (0, 6, 12)]
    assert all(sorted(order) == names for order in rounds)
    assert len({tuple(order) for order in rounds}) > 1 or rounds[0] != names
    user = [m for m in stub.bodies[-1]["messages"] if m["role"] == "user"]
    assert [len(m["content"].split()) for m in user] == [7 + 25] * 3
    # The same names give the same order, so a run can be repeated (one client: arrival is the sending order).
    orders = []
    for _ in range(2):
        stub.bodies.clear()
        conversations.run_workload(stub.endpoint, "m", names, dataclasses.replace(workload, clients=1))
        orders.append([b["messages"][0]["content"].split()[6].rstrip(".") for b in stub.bodies])
    assert orders[0] == orders[1] and orders[0][:6] != names


def test_a_workload_with_an_unknown_order_is_refused():
    problems = Workload(order="random", turn_words=-1).problems()
    assert problems == {"order": "conversations or rounds", "turn_words": "0 or more"}
