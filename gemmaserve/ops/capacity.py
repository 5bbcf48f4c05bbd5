"""`gemmaserve capacity status|wait|watch --stack S`: a stack's TPU queued resources and GPU VMs as Google
Cloud sees them now, and a reconciler that keeps them serving.

Three parts, kept apart:

- what the stack holds: its Pulumi state, through `PulumiStack`, the one seam to Pulumi
  (`AutomationStack`: Pulumi's automation API on this project directory);
- what Google Cloud says: read-only calls through the provider's own adapters (gemmaserve/cloud/tpu_api.py,
  compute_api.py) with the gcp provider's credentials (gemmaserve/cloud/gcp_credentials.py);
- what to do: the provider's own rules (tpu_queued_resource.decide). Nothing here changes anything in
  the cloud: when capacity is dead, ends soon, is stopped, or became ready while Pulumi's state says
  otherwise, the reconciler runs `pulumi up --refresh` on the stack. The re-queue is then done by the
  provider code and recorded by Pulumi: state never drifts and no request is left orphaned.

gemmaserve.cloud's modules (shared with the Pulumi program) are imported only when a command needs them:
the core stays free of cloud SDKs, and the rules are not copied.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

QUEUED = "pulumi-python:dynamic:Resource"
INSTANCE = "gcp:compute/instance:Instance"
STACK = "pulumi:pulumi:Stack"
READY = ("ACTIVE", "RUNNING")
# A stopped or deleted VM is brought back by `up`: the program declares desired_status RUNNING.
VM_DOWN = ("TERMINATED", "STOPPED", "SUSPENDED", "GONE")


# --- the seam to Pulumi -----------------------------------------------------------------------------


class PulumiStack(Protocol):
    """What capacity needs from a Pulumi stack; AutomationStack is the real one."""

    name: str

    def resources(self) -> list[dict[str, Any]]:
        """The deployment's resources as `pulumi stack export` writes them (type, urn, id, inputs, outputs)."""
        ...

    def config(self) -> dict[str, Any]:
        """The stack's config ("gcp:project": ...), secrets decrypted, for the gcp provider's credentials."""
        ...

    def up(self, log: Callable[[str], None]) -> dict[str, Any]:
        """`pulumi up --refresh --yes`, streaming its output to `log`; returns the stack outputs."""
        ...


class AutomationStack:
    """PulumiStack over Pulumi's automation API (needs the pulumi CLI on PATH and a logged-in backend)."""

    def __init__(self, stack: str, work_dir: Path = Path(".")):
        from pulumi import automation

        self.name = stack
        self._stack = automation.select_stack(stack_name=stack, work_dir=str(work_dir))

    def resources(self) -> list[dict[str, Any]]:
        return list((self._stack.export_stack().deployment or {}).get("resources") or [])

    def config(self) -> dict[str, Any]:
        return {key: value.value for key, value in self._stack.get_all_config().items()}

    def up(self, log: Callable[[str], None]) -> dict[str, Any]:
        result = self._stack.up(
            refresh=True,
            on_output=log,
            color="never",
            # The engine prints secret values in diffs when asked; the HF token must never reach a log.
            show_secrets=False,
            message="gemmaserve capacity: re-queue / refresh",
        )
        return {key: value.value for key, value in result.outputs.items()}


# --- the clouds, read-only ----------------------------------------------------------------------------


@dataclass
class Clouds:
    tpu: Any  # tpu_api.TpuApi: only get_queued_resource and get_node are called here
    compute: Any  # compute_api.ComputeApi


def google_clouds(config: dict[str, Any]) -> Clouds:
    """The real APIs, authenticated exactly as the stack's gcp provider is."""
    from gemmaserve.cloud import compute_api, gcp_credentials, tpu_api

    creds = gcp_credentials.credentials_for(gcp_credentials.gcp_auth(config.get, os.environ))
    return Clouds(
        tpu=tpu_api.GoogleTpuApi(credentials=creds),
        compute=compute_api.GoogleComputeApi(credentials=creds),
    )


# --- what there is ------------------------------------------------------------------------------------


@dataclass
class Capacity:
    """One queued resource or VM: its live state, how long it waited or has left, and what `up` would do."""

    name: str
    kind: str  # "tpu" (queued resource) or "vm"
    zone: str | None
    provisioning: str | None
    state: str
    reason: str | None
    in_queue_s: float | None
    time_left_s: float | None
    time_left_of: str | None
    next: str  # "none", or what `pulumi up --refresh` will do and why
    address: str | None
    stored_state: str | None
    stored_address: str | None
    history: list[dict] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        return self.state in READY

    @property
    def needs_up(self) -> bool:
        """Dead, ending, stopped or gone: only `up` brings it back."""
        return self.next != "none"

    @property
    def stale(self) -> bool:
        """Ready, but Pulumi's state (and so the stack's `hosts` output) does not know it yet."""
        return self.ready and (self.stored_state != self.state or self.stored_address != self.address)


def _epoch(value: str | None) -> float | None:
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def _queued_capacity(resource: dict[str, Any], clouds: Clouds, now: float) -> Capacity:
    from gemmaserve.cloud import tpu_queued_resource as qr

    outs, inputs = resource.get("outputs") or {}, resource.get("inputs") or {}
    try:
        live = qr.Observation.of(clouds.tpu.get_queued_resource(outs["queued_resource_name"]))
    except qr.ApiError as error:
        if error.status != "NOT_FOUND":
            raise
        live = qr.Observation(qr.GONE, "the request no longer exists")
    # Against the inputs Pulumi last applied: what the live state alone makes `up` do (new config is
    # not this command's business).
    applied = {key: inputs.get(key, outs.get(key)) for key in qr.INPUT_KEYS}
    decision = qr.decide(outs, {**outs, **applied}, live, now)
    address = None
    if live.state == "ACTIVE":
        try:
            endpoints = clouds.tpu.get_node(outs["node_name"]).get("networkEndpoints") or [{}]
            address = endpoints[0].get("ipAddress")
        except qr.ApiError:
            address = None
    created, termination, deadline = (
        _epoch(live.created_at),
        _epoch(live.termination_time),
        _epoch(live.valid_until_time),
    )
    waiting = live.state in qr.WAITING or live.state == "PROVISIONING"
    time_left, of = None, None
    start = _epoch(outs.get("valid_after"))
    if waiting and start and start > now:
        time_left, of = start - now, "starts in"
    elif live.state == "ACTIVE" and termination:
        time_left, of = termination - now, "flex-start ends in"
    elif waiting and deadline:
        time_left, of = deadline - now, "queue expires in"
    return Capacity(
        name=outs.get("queued_resource_id") or resource.get("id") or "?",
        kind="tpu",
        zone=outs.get("zone"),
        provisioning=outs.get("provisioning_model") or outs.get("provisioning"),
        state=live.state,
        reason=live.reason or None,
        in_queue_s=(now - created) if waiting and created else None,
        time_left_s=time_left,
        time_left_of=of,
        next="none" if decision.action in ("none", "store") else f"{decision.action}: {decision.why}",
        address=address,
        stored_state=outs.get("state"),
        stored_address=outs.get("internal_ip"),
        history=list(outs.get("history") or []),
    )


def _vm_capacity(resource: dict[str, Any], clouds: Clouds, now: float) -> Capacity:
    outs = resource.get("outputs") or {}
    scheduling = outs.get("scheduling") or {}
    project = outs.get("project") or ""
    try:
        live = clouds.compute.get_instance(project, outs["zone"], outs["name"])
        state = live.get("status", "UNKNOWN")
        termination = _epoch((live.get("scheduling") or {}).get("terminationTime"))
        address = ((live.get("networkInterfaces") or [{}])[0]).get("networkIP")
    except Exception as error:  # noqa: BLE001 - NOT_FOUND from either adapter
        if getattr(error, "status", None) != "NOT_FOUND":
            raise
        state, termination, address = "GONE", None, None
    stored_nics = outs.get("networkInterfaces") or [{}]
    nxt = "none"
    if state in VM_DOWN:
        nxt = f"{'recreate' if state == 'GONE' else 'start'}: the VM is {state}"
    return Capacity(
        name=outs.get("name") or resource.get("id") or "?",
        kind="vm",
        zone=outs.get("zone"),
        provisioning=(scheduling.get("provisioningModel") or "STANDARD").lower().replace("_", "-"),
        state=state,
        reason=None,
        in_queue_s=None,
        time_left_s=(termination - now) if termination else None,
        time_left_of="run ends in" if termination else None,
        next=nxt,
        address=address,
        stored_state=outs.get("currentStatus") or state,
        stored_address=stored_nics[0].get("networkIp"),
    )


def survey(stack: PulumiStack, clouds: Clouds, now: float) -> list[Capacity]:
    """Every queued resource and VM in the stack's state, as the APIs describe it now."""
    rows = []
    for resource in stack.resources():
        outs = resource.get("outputs") or {}
        if resource.get("type") == QUEUED and "queued_resource_id" in outs:
            rows.append(_queued_capacity(resource, clouds, now))
        elif resource.get("type") == INSTANCE:
            rows.append(_vm_capacity(resource, clouds, now))
    return rows


def stack_outputs(stack: PulumiStack) -> dict[str, Any]:
    for resource in stack.resources():
        if resource.get("type") == STACK:
            return dict(resource.get("outputs") or {})
    return {}


# --- acting: only through the stack ------------------------------------------------------------------


@dataclass
class Pass:
    rows: list[Capacity]
    ran_up: bool = False
    why: str = ""
    error: str | None = None
    outputs: dict[str, Any] = field(default_factory=dict)


def reconcile_once(
    stack: PulumiStack,
    clouds: Clouds,
    clock: Callable[[], float],
    log: Callable[[str], None],
    known: set[str] | None = None,
) -> Pass:
    """Look; if anything needs `up` (dead, ending, stopped, or ready but unknown to Pulumi), run it once.

    `known`: what earlier passes saw in the state. `up --refresh` drops a request that is gone from the
    state before it creates one; when that create fails, the state no longer holds the request at all, so
    only what was there before tells that the stack lost it: such a name runs `up` until one succeeds.
    """
    rows = survey(stack, clouds, clock())
    reasons = [f"{r.name}: {r.next}" for r in rows if r.needs_up]
    reasons += [f"{r.name}: {r.state} at {r.address}, Pulumi has {r.stored_state}" for r in rows if r.stale]
    if known is not None:
        reasons += [
            f"{name}: no longer in Pulumi's state (gone at a refresh, and the create after it failed)"
            for name in sorted(known - {r.name for r in rows})
        ]
        known.update(r.name for r in rows)
    if not reasons:
        return Pass(rows)
    why = "; ".join(reasons)
    log(f"pulumi up --refresh on {stack.name}: {why}")
    try:
        outputs = stack.up(log)
    except Exception as error:  # noqa: BLE001 - a locked stack, an API error: report, try again next pass
        log(f"pulumi up failed ({type(error).__name__}: {str(error)[:500]}); trying again next pass")
        return Pass(rows, ran_up=True, why=why, error=str(error))
    rows = survey(stack, clouds, clock())
    if known is not None:
        # A successful `up` made the state what the program declares: what it no longer holds was removed.
        known.clear()
        known.update(r.name for r in rows)
    return Pass(rows, ran_up=True, why=why, outputs=outputs)


def describe(row: Capacity) -> str:
    """One progress line."""
    parts = [f"{row.name}: {row.state}"]
    if row.zone:
        parts.append(f"in {row.zone} ({row.provisioning})")
    if row.in_queue_s is not None:
        parts.append(f"{duration(row.in_queue_s)} in queue")
    if row.time_left_s is not None:
        parts.append(f"{row.time_left_of} {duration(row.time_left_s)}")
    if row.address:
        parts.append(f"at {row.address}")
    if row.reason:
        parts.append(f"- {row.reason}")
    if row.needs_up:
        parts.append(f"-> {row.next}")
    return " ".join(parts)


def wait(
    stack: PulumiStack,
    clouds: Clouds,
    timeout: float,
    poll: float,
    log: Callable[[str], None],
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
    heartbeat: float = 600,
) -> tuple[bool, list[Capacity], dict[str, Any]]:
    """Until every queued resource / VM is ready (re-queueing through `up` on the way), then refresh hosts.

    Returns (ready, rows, stack outputs). Progress: a line when anything changes, and every `heartbeat` s.
    """
    deadline, seen, last_line, known = clock() + timeout, {}, 0.0, set()
    while True:
        result = reconcile_once(stack, clouds, clock, log, known)
        rows = result.rows
        for row in rows:
            line = describe(row)
            key = (row.state, row.zone, row.address, row.next)
            if seen.get(row.name) != key or clock() - last_line >= heartbeat:
                log(line)
                seen[row.name], last_line = key, clock()
        lost = known - {r.name for r in rows}
        if rows and not lost and all(r.ready and not r.stale for r in rows):
            return True, rows, result.outputs or stack_outputs(stack)
        if not rows and not known:
            log(f"{stack.name}: no queued resource or VM in the stack's state (run pulumi up first)")
            return False, rows, {}
        if clock() >= deadline:
            log(f"not ready after {duration(timeout)}")
            return False, rows, stack_outputs(stack)
        sleep(min(poll, max(deadline - clock(), 0)) or poll)


def watch(
    stack: PulumiStack,
    clouds: Clouds,
    interval: float,
    log: Callable[[str], None],
    passes: int | None = None,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
    stop: Callable[[], bool] = lambda: False,
) -> list[Pass]:
    """The reconciler: a pass every `interval` s (until `passes` or `stop()`); every pass is logged."""
    done: list[Pass] = []
    known: set[str] = set()
    while not stop() and (passes is None or len(done) < passes):
        try:
            result = reconcile_once(stack, clouds, clock, log, known)
        except Exception as error:  # noqa: BLE001 - a read failed: the next pass looks again
            log(f"pass failed ({type(error).__name__}: {str(error)[:500]})")
            result = Pass([], error=str(error))
        for row in result.rows:
            log(describe(row))
        done.append(result)
        if passes is not None and len(done) >= passes:
            break
        sleep(interval)
    return done


# Where the commands get their stack, clouds and time; tests put fakes here.
clock: Callable[[], float] = time.time
pause: Callable[[float], None] = time.sleep


def open_stack(stack: str, project_dir: Path) -> PulumiStack:
    return AutomationStack(stack, project_dir)


def open_clouds(stack: PulumiStack) -> Clouds:
    return google_clouds(stack.config())


class Stopper:
    """SIGTERM / SIGINT end `watch` after the pass in progress (a running `pulumi up` is never cut off)."""

    def __init__(self) -> None:
        self.stopped = False

    def install(self) -> Stopper:
        import signal

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._stop)
        return self

    def _stop(self, signum, frame) -> None:
        self.stopped = True

    def __call__(self) -> bool:
        return self.stopped

    def sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.stopped and time.monotonic() < deadline:
            time.sleep(min(1.0, deadline - time.monotonic()))


# --- output -------------------------------------------------------------------------------------------


def duration(seconds: float) -> str:
    sign, seconds = ("-" if seconds < 0 else ""), abs(int(seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes = rest // 60
    if days:
        return f"{sign}{days}d{hours}h"
    if hours:
        return f"{sign}{hours}h{minutes:02d}m"
    return f"{sign}{minutes}m{seconds % 60:02d}s" if minutes else f"{sign}{seconds}s"


def as_json(rows: list[Capacity]) -> str:
    return json.dumps([{**asdict(r), "ready": r.ready, "stale": r.stale} for r in rows], indent=2)


STATE_STYLE = {
    "ACTIVE": "green",
    "RUNNING": "green",
    "PROVISIONING": "cyan",
    "WAITING_FOR_RESOURCES": "yellow",
    "ACCEPTED": "yellow",
    "CREATING": "yellow",
}


def print_table(rows: list[Capacity], stack: str, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    # Piped or captured output is not wrapped at 80 columns: a row stays one readable line.
    console = console or Console(width=None if sys.stdout.isatty() else 200)
    table = Table(title=f"capacity of stack {stack}")
    for column in ("name", "kind", "zone", "model", "state", "in queue", "time left", "address", "next"):
        table.add_column(column, overflow="fold")
    for row in rows:
        style = STATE_STYLE.get(row.state, "red")
        left = f"{row.time_left_of} {duration(row.time_left_s)}" if row.time_left_s is not None else "-"
        table.add_row(
            row.name,
            row.kind,
            row.zone or "-",
            row.provisioning or "-",
            f"[{style}]{row.state}[/{style}]" + (f"\n{row.reason}" if row.reason else ""),
            duration(row.in_queue_s) if row.in_queue_s is not None else "-",
            left,
            row.address or "-",
            "-" if row.next == "none" else row.next,
        )
    if not rows:
        console.print(f"stack {stack} holds no queued resource or VM (run `pulumi up --stack {stack}` first)")
        return
    console.print(table)
    stale = [r.name for r in rows if r.stale]
    if stale:
        console.print(
            f"[yellow]{', '.join(stale)}: ready, but the stack's hosts output does not know it yet;"
            " `gemmaserve capacity wait` refreshes it[/yellow]"
        )
