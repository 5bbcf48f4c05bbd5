"""A multi-turn, shared-prefix workload against an OpenAI-compatible endpoint, and what it shows about routing:
prefix-cache reuse against the ideal, hit rate, time to first token and each replica's share of the requests."""

from __future__ import annotations

import json
import math
import random
import secrets
import time
import typing
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gemmaserve.ops.endpoint import Endpoint
from gemmaserve.ops.status import ReplicaStatus, read_host, replica_status
from gemmaserve.plan import Plan
from gemmaserve.spec import Serving

# serving.routing's values, as the spec allows them.
POLICIES: tuple[str, ...] = typing.get_args(Serving.model_fields["routing"].annotation)
# How long the replicas' counters may lag the last answer a client read (vLLM counts a finished request after
# it has handed the request's last output on), and how often they are read again meanwhile.
COUNTERS_SETTLE_S, COUNTERS_POLL_S = 10.0, 0.5
# How the turns of the conversations are ordered (Workload.order).
ORDERS = ("conversations", "rounds")


@dataclass(frozen=True)
class Workload:
    """N conversations of T turns, sent by C clients at once; each conversation opens with a system prompt of
    its own, `system_prompt_words` words long, and each turn is sent once the previous answer has arrived."""

    conversations: int = 32
    turns: int = 4
    clients: int = 8
    system_prompt_words: int = 1000
    max_tokens: int = 32
    # Seconds one turn may take, from sending it to the stream's end.
    timeout: float = 120.0
    # Words each user message adds to the conversation (a pasted text, a tool's output) beyond "Turn N: ...".
    turn_words: int = 0
    # "conversations": each client sends one conversation's turns back to back (a closed loop); "rounds": every
    # conversation's first turn in a shuffled order, then every second turn, and so on, so other conversations'
    # turns come between two turns of one, as a user's think time or an agent's tool call puts them.
    order: str = "conversations"

    def problems(self) -> dict[str, str]:
        """Each field out of range -> what is allowed (empty when the workload can run)."""
        allowed = {
            "conversations": (self.conversations >= 1, "1 or more"),
            # Reuse is measured from the second turn on: one turn reuses nothing.
            "turns": (self.turns >= 2, "2 or more (prefix reuse starts at the second turn)"),
            "clients": (self.clients >= 1, "1 or more"),
            "system_prompt_words": (self.system_prompt_words >= 8, "8 or more"),
            "max_tokens": (self.max_tokens >= 1, "1 or more"),
            "timeout": (math.isfinite(self.timeout) and self.timeout > 0, "a number of seconds > 0"),
            "turn_words": (self.turn_words >= 0, "0 or more"),
            "order": (self.order in ORDERS, " or ".join(ORDERS)),
        }
        return {name: what for name, (ok, what) in allowed.items() if not ok}

    def describe(self) -> str:
        return (
            f"{self.conversations} conversations x {self.turns} turns, {self.clients} clients, system prompts of "
            f"{self.system_prompt_words} words, {self.max_tokens} tokens per answer"
            + (f", {self.turn_words} more words per turn" if self.turn_words else "")
            + (", turns in shuffled rounds" if self.order == "rounds" else "")
        )


@dataclass(frozen=True)
class Turn:
    """One request of one conversation, as the client saw it."""

    conversation: str
    turn: int  # 1 for the first
    status: int  # the HTTP status; 0 when none came (no connection, timeout)
    prompt_tokens: int | None  # the endpoint's own count (usage)
    completion_tokens: int | None
    ttft: float | None  # seconds from sending to the first chunk of generated text
    latency: float  # seconds from sending to the stream's end (or the failure)
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error and self.prompt_tokens is not None


def system_prompt(name: str, words: int) -> str:
    """A system prompt of exactly `words` words that no other conversation shares (it names `name` first)."""
    fact = "it is worth a careful, patient and complete answer."
    text = [*f"You are the assistant of conversation {name}.".split()]
    sentence = 0
    while len(text) < words:
        text += f"Fact {sentence} about {name}: {fact}".split()
        sentence += 1
    return " ".join(text[:words])


def user_message(name: str, turn: int, words: int = 0) -> str:
    """Turn `turn`'s question, with `words` more words of text that no other turn or conversation shares."""
    extra = []
    sentence = 0
    while len(extra) < words:
        extra += f"Note {turn}.{sentence} on {name}: it is worth a careful, patient and complete answer.".split()
        sentence += 1
    return " ".join([f"Turn {turn}: tell me more about {name}.", *extra[:words]])


def conversation_names(count: int, label: str = "conversation") -> list[str]:
    """Names no earlier run used (a random run id), so no replica has any of them cached."""
    run = secrets.token_hex(4)
    return [f"{label}-{run}-{i}" for i in range(count)]


def send_turn(
    client, payload: dict[str, Any], timeout: float, conversation: str = "", turn: int = 0
) -> tuple[Turn, str]:
    """Stream one chat completion (`payload`: create()'s arguments, with stream and include_usage set) through
    `client`, the OpenAI SDK without retries (Endpoint.openai(max_retries=0): a retried turn would be timed and
    counted twice); the turn's record and the answer's text ("" when the turn failed)."""
    import openai

    started = time.monotonic()
    ttft: float | None = None
    usage = None
    status = 0
    text: list[str] = []

    def record(error: str = "") -> Turn:
        latency = time.monotonic() - started
        prompt, completion = (usage.prompt_tokens, usage.completion_tokens) if usage else (None, None)
        return Turn(conversation, turn, status, prompt, completion, ttft, latency, error)

    try:
        # `timeout` bounds each read of the socket (the SDK's httpx timeout); the loop bounds the whole stream.
        with client.chat.completions.create(**payload, timeout=timeout) as stream:
            status = stream.response.status_code
            for chunk in stream:
                if time.monotonic() - started > timeout:
                    return record(f"timeout: the stream ran past {timeout:g} s"), ""
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    delta = choice.delta
                    # vLLM streams a reasoning model's thinking as reasoning_content (older) or reasoning: both
                    # are generated text, so the first of them is the first token.
                    reasoning = getattr(delta, "reasoning_content", None) or getattr(delta, "reasoning", None)
                    if ttft is None and (delta.content or reasoning):
                        ttft = time.monotonic() - started
                    text.append(delta.content or "")
    except openai.APIStatusError as error:  # an HTTP error status: its body is the reason
        status = error.status_code
        return record(error.response.text[:200]), ""
    except openai.APIConnectionError as error:  # no connection, or a read timed out (APITimeoutError)
        status = 0
        return record(f"{type(error).__name__}: {error}"[:200]), ""
    except openai.APIError as error:  # a chunk of the stream that is an error, after a 200
        return record(f"error in the stream: {str(error.body or error.message)[:200]}"), ""
    except ValueError as error:  # a chunk that is not JSON, or not a chunk (pydantic's ValidationError)
        return record(f"{type(error).__name__}: {error}"[:200]), ""
    if usage is None:
        return record("no usage in the stream (stream_options.include_usage)"), ""
    return record(), "".join(text)


class Conversation:
    """One conversation's messages so far and its turns' records; `send` sends its next turn."""

    def __init__(self, client, model: str, name: str, workload: Workload) -> None:
        self.client, self.model, self.name, self.workload = client, model, name, workload
        self.messages = [{"role": "system", "content": system_prompt(name, workload.system_prompt_words)}]
        self.turns: list[Turn] = []

    @property
    def failed(self) -> bool:
        return any(not turn.ok for turn in self.turns)

    def send(self) -> None:
        """The next turn, unless an earlier one failed (a failed turn ends its conversation)."""
        if self.failed:
            return
        number = len(self.turns) + 1
        self.messages.append({"role": "user", "content": user_message(self.name, number, self.workload.turn_words)})
        payload = {
            "model": self.model,
            "messages": self.messages,
            "max_tokens": self.workload.max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        turn, answer = send_turn(self.client, payload, self.workload.timeout, self.name, number)
        self.turns.append(turn)
        if turn.ok:
            self.messages.append({"role": "assistant", "content": answer})


def run_conversation(client, model: str, name: str, workload: Workload) -> list[Turn]:
    """Every turn of one conversation through `client` (send_turn's), each after the previous answer; it stops at
    the first failed turn."""
    conversation = Conversation(client, model, name, workload)
    for _ in range(workload.turns):
        conversation.send()
    return conversation.turns


def run_workload(endpoint: Endpoint, model: str, names: Sequence[str], workload: Workload) -> list[Turn]:
    """Every conversation of `names`, `workload.clients` requests at a time: each conversation's turns back to
    back in the order of `names`, or (order "rounds") round by round, each round in a shuffled order (seeded
    by the names, so a run can be repeated)."""
    problems = workload.problems()
    if problems:
        raise ValueError("; ".join(f"{name}: allowed: {what}" for name, what in problems.items()))
    # One client for every turn (its connection pool is shared by the threads), closed with the run.
    with endpoint.openai(max_retries=0, timeout=workload.timeout) as client:
        with ThreadPoolExecutor(max_workers=min(workload.clients, len(names)) or 1) as pool:
            if workload.order == "conversations":
                done = list(pool.map(lambda name: run_conversation(client, model, name, workload), names))
                return [turn for turns in done for turn in turns]
            conversations = [Conversation(client, model, name, workload) for name in names]
            order = random.Random(",".join(names))
            for _ in range(workload.turns):
                list(pool.map(Conversation.send, order.sample(conversations, len(conversations))))
    return [turn for conversation in conversations for turn in conversation.turns]


def ideal_reuse(turns: Sequence[Turn], block_size: int) -> int:
    """Prompt tokens a prefix cache could serve at best: every answered turn after a conversation's first reuses
    the previous turn's whole prompt, in whole blocks of `block_size` tokens (sum of floor(previous prompt / block) x
    block); pass the plan's prefix_cache_block, the granularity of vLLM's prefix-cache hits."""
    previous: dict[str, Turn] = {}
    total = 0
    for turn in sorted(turns, key=lambda t: (t.conversation, t.turn)):
        before = previous.get(turn.conversation)
        if turn.ok and before is not None and before.ok and before.turn == turn.turn - 1:
            total += before.prompt_tokens // block_size * block_size
        previous[turn.conversation] = turn
    return total


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile, interpolated between the nearest ranks (numpy's default); None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class ReplicaCounters:
    """A replica's vLLM counters at one moment: prefix-cache tokens hit and looked up, requests finished."""

    index: int
    prefix_cache_hits: float
    prefix_cache_queries: float
    requests: float

    @classmethod
    def of(cls, status: ReplicaStatus) -> ReplicaCounters:
        counters = (status.prefix_cache_hits, status.prefix_cache_queries, status.requests)
        if all(value is None for value in counters):
            where = f"{status.host} " if status.host else ""
            raise RuntimeError(
                f"{where}replica {status.index}: no vLLM counters in its /metrics ({status.state or 'no unit state'}"
                f"{', ' + status.phase if status.phase else ''})"
            )
        return cls(status.index, *(value or 0.0 for value in counters))

    @classmethod
    def from_metrics(cls, index: int, text: str) -> ReplicaCounters:
        """From a replica's /metrics text, parsed as `gemmaserve status` parses it."""
        return cls.of(replica_status("", index, "", "", "", text))


def read_counters(target, plan: Plan, host: str = "") -> list[ReplicaCounters]:
    """Every replica's counters on one host, read over ssh on `target` (a testinfra host) as `gemmaserve status`
    reads them: the replicas listen on the host's loopback, behind its balancer."""
    return [ReplicaCounters.of(status) for status in read_host(host, plan, target)]


def counter_deltas(before: Sequence[ReplicaCounters], after: Sequence[ReplicaCounters]) -> list[ReplicaCounters]:
    """What each replica counted in between; a counter that went back (a replica restarted) is an error."""
    if [c.index for c in before] != [c.index for c in after]:
        raise RuntimeError(
            f"replicas changed during the run: {[c.index for c in before]} -> {[c.index for c in after]}"
        )
    deltas = []
    for old, new in zip(before, after, strict=True):
        delta = ReplicaCounters(
            new.index,
            new.prefix_cache_hits - old.prefix_cache_hits,
            new.prefix_cache_queries - old.prefix_cache_queries,
            new.requests - old.requests,
        )
        if min(delta.prefix_cache_hits, delta.prefix_cache_queries, delta.requests) < 0:
            raise RuntimeError(
                f"replica {new.index}: its counters went back during the run (restarted?): {old} -> {new}"
            )
        deltas.append(delta)
    return deltas


@dataclass
class PolicyRun:
    """One run of the workload against one host's balancer under one routing policy."""

    host: str
    policy: str
    block_size: int
    workload: Workload
    turns: list[Turn]
    # What each replica counted during the run (ReplicaCounters deltas).
    replicas: list[ReplicaCounters]
    seconds: float
    # What the table's plot calls this run (default: "POLICY (HOST)").
    label: str = ""

    @property
    def completed(self) -> int:
        return sum(turn.ok for turn in self.turns)

    @property
    def failed(self) -> int:
        return len(self.turns) - self.completed

    @property
    def prefix_cache_hits(self) -> float:
        return sum(r.prefix_cache_hits for r in self.replicas)

    @property
    def prefix_cache_queries(self) -> float:
        return sum(r.prefix_cache_queries for r in self.replicas)

    @property
    def ideal_reuse(self) -> int:
        return ideal_reuse(self.turns, self.block_size)

    @property
    def reuse_of_ideal(self) -> float | None:
        """Prefix-cache hits as a share of the ideal (above 1 when other traffic or the chat template's shared
        opening adds hits)."""
        ideal = self.ideal_reuse
        return self.prefix_cache_hits / ideal if ideal else None

    @property
    def hit_rate(self) -> float | None:
        queries = self.prefix_cache_queries
        return self.prefix_cache_hits / queries if queries else None

    @property
    def request_share(self) -> list[float | None]:
        total = sum(r.requests for r in self.replicas)
        return [r.requests / total if total else None for r in self.replicas]

    def ttft(self, q: float, turn: int | None = None) -> float | None:
        """The q-th percentile of the answered turns' time to first token (of turn number `turn` only)."""
        return percentile([t.ttft for t in self.turns if t.ok and t.ttft is not None and turn in (None, t.turn)], q)

    @property
    def name(self) -> str:
        return self.label or f"{self.policy} ({self.host})"

    def to_json(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "policy": self.policy,
            "label": self.label,
            "block_size": self.block_size,
            "workload": asdict(self.workload),
            "seconds": self.seconds,
            "completed": self.completed,
            "failed": self.failed,
            "prefix_cache_hits": self.prefix_cache_hits,
            "prefix_cache_queries": self.prefix_cache_queries,
            "ideal_reuse": self.ideal_reuse,
            "reuse_of_ideal": self.reuse_of_ideal,
            "hit_rate": self.hit_rate,
            "ttft_p50_s": self.ttft(50),
            "ttft_p99_s": self.ttft(99),
            "ttft_p50_by_turn_s": {t: self.ttft(50, t) for t in range(1, self.workload.turns + 1)},
            "replicas": [
                {**asdict(r), "request_share": s} for r, s in zip(self.replicas, self.request_share, strict=True)
            ],
            "turns": [asdict(turn) for turn in self.turns],
        }


def measure(
    endpoint: Endpoint,
    model: str,
    workload: Workload,
    block_size: int,
    read: Callable[[], list[ReplicaCounters]],
    *,
    host: str = "",
    policy: str = "",
    names: Sequence[str] | None = None,
    label: str = "",
) -> PolicyRun:
    """Run the workload through `endpoint` (a host's balancer) with conversations never seen before (or `names`),
    reading every replica's counters with `read` before and after (read_counters over ssh; anything returning
    ReplicaCounters in a test). Run it on an otherwise idle host: other clients' requests count too."""
    names = list(names) if names is not None else conversation_names(workload.conversations, policy or "conversation")
    before = read()
    started = time.monotonic()
    turns = run_workload(endpoint, model, names, workload)
    seconds = time.monotonic() - started
    answered = sum(turn.ok for turn in turns)
    deadline = time.monotonic() + COUNTERS_SETTLE_S
    while True:
        deltas = counter_deltas(before, read())
        if sum(d.requests for d in deltas) >= answered or time.monotonic() >= deadline:
            break
        time.sleep(COUNTERS_POLL_S)
    return PolicyRun(host, policy, block_size, workload, turns, deltas, seconds, label)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


def table_rows(runs: Sequence[PolicyRun]) -> list[list[str]]:
    """The table's cells, one row per run: host, policy, turns answered, prefix reuse of ideal, hit rate,
    TTFT p50 and p99, request share per replica."""
    return [
        [
            run.host,
            run.policy,
            f"{run.completed}/{run.workload.conversations * run.workload.turns}",
            _percent(run.reuse_of_ideal),
            _percent(run.hit_rate),
            _ms(run.ttft(50)),
            _ms(run.ttft(99)),
            " / ".join(_percent(share) for share in run.request_share),
        ]
        for run in runs
    ]


TABLE_COLUMNS = (
    "host",
    "policy",
    "turns ok",
    "prefix reuse (of ideal)",
    "hit rate",
    "TTFT p50",
    "TTFT p99",
    "request share",
)


def print_table(runs: Sequence[PolicyRun], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    workloads = {run.workload.describe() for run in runs}
    table = Table(title="multi-turn workload" + (f": {workloads.pop()}" if len(workloads) == 1 else ""))
    for column in TABLE_COLUMNS:
        table.add_column(column, justify="left" if column in ("host", "policy") else "right")
    for row in table_rows(runs):
        table.add_row(*row)
    (console or Console()).print(table)


def write_json(runs: Sequence[PolicyRun], path: Path) -> None:
    path.write_text(json.dumps({"runs": [run.to_json() for run in runs]}, indent=2) + "\n")


def write_plot(runs: Sequence[PolicyRun], path: Path) -> None:
    """Four panels: prefix reuse and hit rate, TTFT p50/p99, TTFT p50 by turn, request share per replica.
    Needs matplotlib (the plot extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [run.name for run in runs]
    x = range(len(runs))
    fig, ((cache, latency), (by_turn, share)) = plt.subplots(2, 2, figsize=(11, 8))
    width = 0.38
    for offset, label, values in (
        (-width / 2, "prefix reuse (of ideal)", [run.reuse_of_ideal for run in runs]),
        (width / 2, "hit rate", [run.hit_rate for run in runs]),
    ):
        cache.bar([i + offset for i in x], [100 * (v or 0) for v in values], width, label=label)
    cache.set_ylabel("%")
    cache.set_title("prefix cache")
    for offset, label, q in ((-width / 2, "TTFT p50", 50), (width / 2, "TTFT p99", 99)):
        latency.bar([i + offset for i in x], [1000 * (run.ttft(q) or 0) for run in runs], width, label=label)
    latency.set_ylabel("ms")
    latency.set_title("time to first token")
    for run in runs:
        turns = range(1, run.workload.turns + 1)
        by_turn.plot(list(turns), [1000 * (run.ttft(50, t) or 0) for t in turns], marker="o", label=run.name)
    by_turn.set_xticks(range(1, max((run.workload.turns for run in runs), default=1) + 1))
    by_turn.set_xlabel("turn")
    by_turn.set_ylabel("ms")
    by_turn.set_title("TTFT p50 by turn")
    bottoms = [0.0] * len(runs)
    for replica in range(max((len(run.replicas) for run in runs), default=0)):
        values = [100 * (run.request_share[replica] or 0) if replica < len(run.replicas) else 0 for run in runs]
        share.bar(list(x), values, 0.6, bottom=bottoms, label=f"replica {replica}")
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    share.set_ylabel("% of requests")
    share.set_title("request share per replica")
    for axis in (cache, latency, share):
        axis.set_xticks(list(x), names, fontsize=8)
    for axis in (cache, latency, by_turn, share):
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(runs: Sequence[PolicyRun], out: Path, stem: str = "multi-turn", log: Callable[[str], None] = print) -> None:
    """The runs' table on the console, STEM.json and (with the plot extra) STEM.png under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    print_table(runs)
    write_json(runs, out / f"{stem}.json")
    failed = [turn for run in runs for turn in run.turns if not turn.ok]
    if failed:
        first = failed[0]
        log(
            f"{len(failed)} turns failed (first: {first.conversation} turn {first.turn}: {first.error or first.status})"
        )
    try:
        write_plot(runs, out / f"{stem}.png")
    except ImportError:
        log(f"wrote {out / stem}.json; no plot: install the plot extra (pip install 'gemmaserve[plot]')")
        return
    log(f"wrote {out / stem}.json and {out / stem}.png")
