"""`gemmaserve capacity`: status, wait and watch against the fake TPU API, acting only through the stack.

The stack is tests/ops/fake_stack.FakeStack, whose `up` runs the real provider; capacity itself gets
read-only clouds. What could not run here (no pulumi CLI) is the real automation API call; the seam's
use of it is checked against the automation API's own signatures below.
"""

from __future__ import annotations

import inspect
import json
import random

import pytest
from rich.console import Console
from typer.testing import CliRunner

from gemmaserve.cloud.tpu_api import ApiError
from gemmaserve.ops import capacity
from gemmaserve.ops.cli import app
from tests.infra.fake_tpu import EPOCH, FakeTpu, Zone, service_disabled
from tests.infra.test_tpu_queued_resource import (
    DATA_DISK,
    HOUR,
    PROJECT,
    QR_ID,
    QUOTA_FAILURE,
    STOCKOUT,
    ZONES,
    exhausted,
    props,
    provider,
    qr_name,
)
from tests.ops.fake_stack import FakeCompute, FakeStack, UpKilled, program_vm, read_only


class World:
    """A project with a TPU stack on the fake API, and the clock they share."""

    def __init__(self, **prop_changes):
        self.tpu = FakeTpu()
        self.compute = FakeCompute()
        self.stack = FakeStack("tpu-v6e4", provider(self.tpu), self.compute)
        self.clouds = read_only(self.tpu, self.compute)
        self.props = props(**prop_changes)
        self.lines: list[str] = []

    @property
    def clock(self):
        return self.tpu.clock

    def log(self, line: str) -> None:
        self.lines.append(line)

    def survey(self):
        return capacity.survey(self.stack, self.clouds, self.clock())

    def once(self):
        return capacity.reconcile_once(self.stack, self.clouds, self.clock, self.log)


def capacity_now(world: World, zone: str, at: float | None = None) -> None:
    world.tpu.zones[zone] = Zone(capacity_at=world.clock() if at is None else at)


# --- status ---------------------------------------------------------------------------------------


def test_status_of_a_waiting_request_says_how_long_and_until_when():
    world = World(create_wait_seconds=60)
    world.stack.create_queued_resource(world.props)
    world.clock.advance(HOUR)
    (row,) = world.survey()
    assert (row.kind, row.zone, row.provisioning, row.state) == ("tpu", ZONES[0], "guaranteed", "WAITING_FOR_RESOURCES")
    assert row.in_queue_s == pytest.approx(HOUR + 60, abs=60)
    assert row.time_left_of == "queue expires in" and row.time_left_s == pytest.approx(5 * HOUR - 60, abs=60)
    assert row.next == "none" and not row.ready


def test_status_table_reads_at_a_glance_and_json_is_complete():
    world = World(create_wait_seconds=60)
    world.stack.create_queued_resource(world.props)
    rows = world.survey()
    console = Console(record=True, width=160)
    capacity.print_table(rows, "tpu-v6e4", console)
    text = console.export_text()
    for expected in (
        "capacity of stack tpu-v6e4",
        QR_ID,
        ZONES[0],
        "guaranteed",
        "WAITING_FOR_RESOURCES",
        "queue expires in",
    ):
        assert expected in text
    (record,) = json.loads(capacity.as_json(rows))
    assert record["state"] == "WAITING_FOR_RESOURCES" and record["ready"] is False and record["next"] == "none"


def test_status_of_an_active_flex_start_slice_shows_its_end():
    world = World(provisioning="flex-start", max_run_seconds=2 * HOUR, zones=["us-east5-a"], recycle_before_seconds=600)
    capacity_now(world, "us-east5-a")
    world.stack.create_queued_resource(world.props)
    (row,) = world.survey()
    assert row.ready and row.address == "10.42.0.7"
    assert row.time_left_of == "flex-start ends in" and row.time_left_s == pytest.approx(2 * HOUR, abs=300)


def test_status_says_what_up_would_do_with_a_preempted_slice():
    world = World()
    capacity_now(world, ZONES[0])
    world.stack.create_queued_resource(world.props)
    world.tpu.preempt(qr_name(ZONES[0]))
    (row,) = world.survey()
    assert row.state == "SUSPENDED" and row.next.startswith("requeue: SUSPENDED")


# --- watch: every action goes through `pulumi up` ---------------------------------------------------


def test_watch_requeues_a_preempted_slice_through_the_stack():
    world = World()
    capacity_now(world, ZONES[0])
    world.stack.create_queued_resource(world.props)
    world.tpu.preempt(qr_name(ZONES[0]))
    world.tpu.zones[ZONES[0]] = Zone(capacity_at=world.clock() + 300)  # capacity returns in 5 minutes
    result = world.once()
    assert result.ran_up and world.stack.ups == 1 and "SUSPENDED" in result.why
    (row,) = result.rows
    assert row.state == "ACTIVE" and row.stored_state == "ACTIVE" and not row.stale
    assert world.stack.resources()[0]["outputs"]["hosts"][0]["internal_ip"] == row.address


def test_watch_follows_the_chain_to_the_next_zone_when_a_queue_expires():
    world = World(valid_until_seconds=HOUR, create_wait_seconds=60)
    capacity_now(world, ZONES[1])
    world.stack.create_queued_resource(world.props)
    passes = capacity.watch(
        world.stack, world.clouds, 600, world.log, passes=12, clock=world.clock, sleep=world.clock.sleep
    )
    ups = [p.why for p in passes if p.ran_up]
    # The expiry re-queues in zone 2; once it is ACTIVE, one more `up` refreshes the hosts; then quiet.
    assert len(ups) == 2 and "FAILED" in ups[0] and "Pulumi has PROVISIONING" in ups[1]
    (row,) = passes[-1].rows
    assert (row.zone, row.state) == (ZONES[1], "ACTIVE")
    assert [r.zone for r in world.tpu.live()] == [ZONES[1]]  # the expired request is gone, nothing orphaned
    assert any("FAILED" in line for line in world.lines)


def test_watch_recycles_flex_start_before_its_end():
    world = World(
        provisioning="flex-start", max_run_seconds=2 * HOUR, zones=["us-east5-a"], recycle_before_seconds=1800
    )
    capacity_now(world, "us-east5-a")
    world.stack.create_queued_resource(world.props)
    first = world.tpu.live()[0].active_at
    capacity.watch(world.stack, world.clouds, 900, world.log, passes=7, clock=world.clock, sleep=world.clock.sleep)
    assert world.stack.ups >= 1 and any("recycling" in line for line in world.lines)
    (record,) = world.tpu.live()
    assert record.state == "ACTIVE" and record.active_at > first


def test_watch_refreshes_hosts_when_a_waiting_request_becomes_active():
    world = World(create_wait_seconds=60)
    capacity_now(world, ZONES[0], at=EPOCH + HOUR)
    world.stack.create_queued_resource(world.props)
    assert world.stack.resources()[0]["outputs"]["hosts"][0]["internal_ip"] is None
    world.clock.now = EPOCH + 2 * HOUR
    result = world.once()
    assert result.ran_up and "Pulumi has WAITING_FOR_RESOURCES" in result.why
    assert world.stack.resources()[0]["outputs"]["hosts"][0]["internal_ip"] == "10.42.0.7"
    assert not world.once().ran_up  # converged: the next pass does nothing


def test_watch_starts_a_preempted_spot_vm_through_the_stack():
    world = World()
    name, inputs = program_vm("a100")
    world.stack.add_vm(name, inputs)
    world.compute.instances[(PROJECT, "us-central1-a", name)]["status"] = "TERMINATED"
    (row,) = world.survey()
    assert (row.kind, row.provisioning, row.next) == ("vm", "spot", "start: the VM is TERMINATED")
    result = world.once()
    assert result.ran_up and result.rows[0].state == "RUNNING"
    assert world.compute.creations == {(PROJECT, "us-central1-a", name): 1} and not world.stack.replacements


def test_a_failed_up_is_reported_and_retried_next_pass():
    world = World()
    capacity_now(world, ZONES[0])
    world.stack.create_queued_resource(world.props)
    world.tpu.preempt(qr_name(ZONES[0]))
    world.stack.fail_next_up = RuntimeError("the stack is locked by another update (ConcurrentUpdateError)")
    passes = capacity.watch(
        world.stack, world.clouds, 300, world.log, passes=2, clock=world.clock, sleep=world.clock.sleep
    )
    assert passes[0].error and "locked" in passes[0].error and not passes[1].error
    assert any("trying again next pass" in line for line in world.lines)
    assert passes[1].rows[0].state in ("WAITING_FOR_RESOURCES", "ACTIVE")


def test_watch_stops_when_asked():
    world = World()
    capacity_now(world, ZONES[0])
    world.stack.create_queued_resource(world.props)
    stops = iter([False, True])
    passes = capacity.watch(
        world.stack, world.clouds, 300, world.log, clock=world.clock, sleep=world.clock.sleep, stop=lambda: next(stops)
    )
    assert len(passes) == 1


def test_watch_creates_a_request_a_failed_up_left_out_of_the_state():
    """`up --refresh` drops a vanished request from the state, then its create fails: watch still runs `up`."""
    world = World()
    capacity_now(world, ZONES[0])
    world.stack.create_queued_resource(world.props)
    world.tpu.records.clear()  # deleted out of band
    world.tpu.faults["create"] = [TimeoutError("The read operation timed out")]
    passes = capacity.watch(
        world.stack, world.clouds, 300, world.log, passes=3, clock=world.clock, sleep=world.clock.sleep
    )
    assert passes[0].error and not passes[1].error and "no longer in Pulumi's state" in passes[1].why
    assert [r.state for r in passes[-1].rows] == ["ACTIVE"] and len(world.tpu.live()) == 1


# --- watch through faults: many passes, never an orphan, never a replacement -----------------------


class Soak:
    """One stack (a spot TPU slice with its data disk, and the a100 stack's spot GPU VM as the program declares
    it, `vm`) watched for `passes` passes while a seeded RNG breaks
    things between them: the faults of issue 25's review (creates accepted and then failing for the caller,
    transport errors on create, get and delete, a re-queue whose create fails after acceptance, preemption,
    queues expiring, SERVICE_DISABLED, quota and capacity RESOURCE_EXHAUSTED), then a calm tail in which
    capacity must come back."""

    # Each fault and how often it is drawn: the ones that make an `up` create are drawn most.
    FAULTS = {
        "accepted, then the operation wait times out": 3,
        "accepted, then the connection drops": 3,
        "create times out on the way": 2,
        "accepted, then reads time out": 2,
        "get fails": 2,
        "delete times out on the way": 1,
        "delete accepted, then the connection drops": 1,
        "slice preempted": 3,
        "VM preempted": 1,
        "capacity leaves a zone": 1,
        "capacity comes to a zone": 1,
        "stockout in a zone": 1,
        "over quota": 1,
        "SERVICE_DISABLED": 1,
        "up killed after a create was accepted": 2,
    }

    def __init__(
        self,
        seed: int,
        passes: int = 100,
        calm: int = 12,
        interval: float = 600,
        vm: tuple[str, dict] | None = None,
    ):
        self.rng = random.Random(seed)
        self.passes, self.calm, self.interval = passes, calm, interval
        self.world = World(
            provisioning="spot", valid_until_seconds=int(1.5 * HOUR), create_wait_seconds=120, data_disk=DATA_DISK
        )
        self.messages: list[str] = []
        self.world.stack.provider.progress = self.messages.append
        for zone in ZONES:
            capacity_now(self.world, zone, at=self.world.clock() + self.rng.choice([0, HOUR, 3 * HOUR]))
        self.world.stack.create_queued_resource(self.world.props)
        self.vm_name, vm_inputs = vm or program_vm("a100")
        self.world.stack.add_vm(self.vm_name, vm_inputs)
        self.vm_key = (PROJECT, vm_inputs["zone"], self.vm_name)
        self.done = 0
        self.injected: list[str] = []
        # Kills not yet gone off; while one that did is not settled by a successful `up`, the request it may
        # have left (one at most) is allowed outside the state: Pulumi could not have recorded it.
        self.kills: list[UpKilled] = []
        self.grace = False
        self.ups_ok = 0
        up = self.world.stack.up

        def counted_up(log):
            outputs = up(log)
            self.ups_ok += 1
            return outputs

        self.world.stack.up = counted_up
        self.running: dict[str, tuple[float, float]] = {}
        self.vms_running: dict[tuple, int] = {}

    # --- what the stack tracks and what the fake holds ---------------------------------------------

    def tracked(self) -> set[str]:
        return {
            r["outputs"]["queued_resource_name"]
            for r in self.world.stack.resources()
            if r["type"] == capacity.QUEUED and r.get("id")
        }

    def held(self) -> set[str]:
        """Every request the project holds (billing or not) that is not on its way out."""
        return {r.name for r in self.world.tpu.live() if r.state != "DELETING"}

    def check(self, where: str) -> None:
        tracked, held = self.tracked(), self.held()
        pending = self.world.tpu.faults.get("create-accepted") or []
        fired = [kill for kill in self.kills if not any(kill is fault for fault in pending)]
        if fired:
            self.kills = [kill for kill in self.kills if kill not in fired]
            self.grace, self.ups_then = True, self.ups_ok
        elif self.grace and self.ups_ok > self.ups_then:
            self.grace = False
        if self.grace:
            assert len(held - tracked) <= 1, f"{where}: {sorted(held - tracked)}"
            held = held & tracked
        assert held <= tracked, f"{where}: in Google Cloud but not in Pulumi's state: {sorted(held - tracked)}"
        assert len(held) <= 1, f"{where}: {sorted(held)}"
        for name, (created, active_at) in self.running.items():
            record = self.world.tpu.records.get(name)
            assert record is not None and record.state == "ACTIVE", f"{where}: the running slice {name} went"
            assert (record.created, record.active_at) == (created, active_at), f"{where}: {name} was replaced"
        for key, creations in self.vms_running.items():
            assert self.world.compute.creations[key] == creations, f"{where}: the running VM {key} was replaced"
        assert not self.world.stack.replacements, f"{where}: {self.world.stack.replacements}"
        broken = [line for line in self.world.lines if "AssertionError" in line or "INVALID_ARGUMENT" in line]
        assert not broken, f"{where}: the fake refused what was sent: {broken}"

    # --- between passes ------------------------------------------------------------------------------

    def between(self, seconds: float) -> None:
        """watch's sleep: check the pass that just ran, break things for the next one, let time pass."""
        self.done += 1
        self.check(f"after pass {self.done} ({', '.join(self.injected[-3:])})")
        if self.done < self.passes - self.calm:
            for fault in self.rng.choices(list(self.FAULTS), list(self.FAULTS.values()), k=self.rng.choice([0, 1, 2])):
                self.inject(fault)
        elif self.done == self.passes - self.calm:
            self.settle()
        self.world.clock.sleep(seconds)
        tpu = self.world.tpu
        self.running = {r.name: (r.created, r.active_at) for r in tpu.live() if r.state == "ACTIVE"}
        self.vms_running = {
            key: self.world.compute.creations[key]
            for key, vm in self.world.compute.instances.items()
            if vm["status"] == "RUNNING"
        }

    def inject(self, fault: str) -> None:
        tpu, rng = self.world.tpu, self.rng
        self.injected.append(f"{self.done}: {fault}")

        def aim(call: str, *errors: BaseException) -> None:
            """The errors, after a few calls of that kind went through (so they land inside an `up` too);
            creates and deletes are few (one an `up`, mostly), so their faults do not queue up."""
            pending = tpu.faults.setdefault(call, [])
            if call != "get" and any(pending):
                return
            pending.extend([None] * rng.randint(0, 4 if call == "get" else 1) + list(errors))

        if fault == "accepted, then the operation wait times out":
            aim(
                "create-accepted",
                ApiError(504, "DEADLINE_EXCEEDED", "Deadline expired before operation could complete."),
            )
        elif fault == "accepted, then the connection drops":
            aim("create-accepted", ConnectionResetError("connection reset by peer"))
        elif fault == "accepted, then reads time out":
            aim("get-after-create", *[TimeoutError("The read operation timed out")] * rng.randint(1, 3))
        elif fault == "create times out on the way":
            aim("create", TimeoutError("The write operation timed out"))
        elif fault == "get fails":
            error = rng.choice(
                [
                    TimeoutError("The read operation timed out"),
                    ApiError(503, "UNAVAILABLE", "The service is unavailable."),
                ]
            )
            aim("get", *[error] * rng.randint(1, 3))
        elif fault == "delete times out on the way":
            aim("delete", TimeoutError("The write operation timed out"))
        elif fault == "delete accepted, then the connection drops":
            aim("delete-accepted", ConnectionResetError("connection reset by peer"))
        elif fault == "slice preempted":
            for record in tpu.live():
                if record.state == "ACTIVE":
                    tpu.preempt(record.name)
                    # A spot slice is taken back when its zone runs short: capacity returns there later.
                    tpu.zone(record.zone).capacity_at = self.world.clock() + rng.choice([600, HOUR, 4 * HOUR])
        elif fault == "VM preempted":
            self.world.compute.instances[self.vm_key]["status"] = "TERMINATED"
        elif fault == "capacity leaves a zone":
            tpu.zone(rng.choice(ZONES)).capacity_at = None
        elif fault == "capacity comes to a zone":
            tpu.zone(rng.choice(ZONES)).capacity_at = self.world.clock() + rng.choice([0, 1200, HOUR])
        elif fault == "stockout in a zone":
            # RESOURCE_EXHAUSTED with ErrorInfo STOCKOUT, for the next create wherever it asks.
            aim("create", exhausted([STOCKOUT]))
        elif fault == "over quota":
            aim("create", exhausted([QUOTA_FAILURE]))
        elif fault == "up killed after a create was accepted":
            self.kills.append(UpKilled("SIGKILL"))
            aim("create-accepted", self.kills[-1])
        elif fault == "SERVICE_DISABLED":
            if rng.random() < 0.5:
                tpu.disabled_calls = rng.randint(1, 4)
            else:
                aim(rng.choice(["get", "create"]), *[service_disabled(PROJECT)] * rng.randint(1, 4))

    def settle(self) -> None:
        """The calm tail: pending faults are dropped and capacity returns everywhere."""
        self.world.tpu.faults.clear()
        self.kills.clear()
        self.world.tpu.disabled_calls = 0
        for zone in ZONES:
            self.world.tpu.zone(zone).capacity_at = self.world.clock()

    def run(self) -> list[capacity.Pass]:
        world = self.world
        passes = capacity.watch(
            world.stack,
            world.clouds,
            self.interval,
            world.log,
            passes=self.passes,
            clock=world.clock,
            sleep=self.between,
        )
        self.check("after the last pass")
        return passes


SEEDS = [1, 2, 3, 4, 5]


def test_the_soak_fails_when_the_vm_leaves_out_the_local_ssds_google_attaches(monkeypatch):
    """The soak's "no RUNNING VM replaced" can fail: the a100 VM (a2-ultragpu-1g, one bundled Local SSD) with
    the program's declared scratch disks removed (infra/gpu_vm.py BUNDLED_LOCAL_SSDS emptied, issue 25
    finding 1 undone) is read back with its Local SSD, diffed as a replacement, and deleted by the first `up`."""
    import gpu_vm  # the module the program imports: tests.infra.conftest puts infra/ on sys.path, as Pulumi runs it

    monkeypatch.setattr(gpu_vm, "BUNDLED_LOCAL_SSDS", {})
    name, inputs = program_vm("a100")
    assert inputs.get("scratchDisks") in (None, [])
    with pytest.raises(AssertionError, match="replaced|scratchDisks"):
        Soak(1, vm=(name, inputs)).run()


def slice_zone(soak: Soak) -> str:
    (name,) = soak.held()
    return name.split("/")[3]


@pytest.mark.parametrize("seed", SEEDS)
def test_watch_through_faults_never_orphans_a_request_nor_replaces_a_running_slice(seed):
    soak = Soak(seed)
    passes = soak.run()  # checks after every pass: nothing held that the state does not track, no replacement
    world = soak.world
    assert sum(p.ran_up for p in passes) >= 5 and sum(bool(p.error) for p in passes) >= 5, soak.injected
    # Capacity came back: the slice is ACTIVE, the VM RUNNING, and Pulumi's state and hosts say so.
    rows = passes[-1].rows
    assert sorted((r.kind, r.state) for r in rows) == [("tpu", "ACTIVE"), ("vm", "RUNNING")], rows
    assert all(not r.stale and not r.needs_up for r in rows)
    assert soak.held() == soak.tracked()
    # No data disk left where no request is: one disk, in the slice's zone.
    assert [path.split("/")[3] for path in world.tpu.disks] == [slice_zone(soak)]
    (slice_,) = [r for r in rows if r.kind == "tpu"]
    hosts = {h["name"]: h["internal_ip"] for h in world.stack.resources()[0]["outputs"]["hosts"]}
    assert slice_.address in hosts.values()


def test_the_soak_reaches_every_path_it_is_meant_to():
    """Across the seeds, every fault is drawn and each path it aims at is taken at least once: an accepted
    create adopted, a killed `up`'s leftover adopted, quota failing fast, a stockout moving on, a queue
    expiring, SERVICE_DISABLED answered."""
    seen: dict[str, int] = dict.fromkeys(
        ("adopted after accept", "leftover adopted", "quota", "stockout", "expired", "disabled"), 0
    )
    drawn: set[str] = set()
    for seed in SEEDS:
        soak = Soak(seed)
        soak.run()
        drawn |= {line.split(": ", 1)[1] for line in soak.injected}
        seen["adopted after accept"] += sum("failed after it was accepted" in m for m in soak.messages)
        seen["leftover adopted"] += sum("adopting the existing" in m for m in soak.messages)
        seen["quota"] += sum("is QUOTA" in line for line in soak.world.lines)
        seen["stockout"] += sum("no capacity in" in m for m in soak.messages)
        seen["expired"] += sum("valid-until" in line for line in soak.world.lines)
        seen["disabled"] += sum("has not been used" in line for line in soak.world.lines)
    assert drawn == set(Soak.FAULTS)
    assert all(seen.values()), seen


# --- wait -------------------------------------------------------------------------------------------


def test_wait_returns_when_active_with_the_refreshed_hosts():
    world = World(create_wait_seconds=60)
    capacity_now(world, ZONES[0], at=EPOCH + 3 * HOUR)
    world.stack.create_queued_resource(world.props)
    ready, rows, outputs = capacity.wait(
        world.stack, world.clouds, 6 * HOUR, 120, world.log, clock=world.clock, sleep=world.clock.sleep
    )
    assert ready and rows[0].state == "ACTIVE"
    assert outputs["hosts"][0]["internal_ip"] == "10.42.0.7"
    assert world.clock() - EPOCH == pytest.approx(3 * HOUR + 120, abs=300)
    # Progress lines: one when anything changes and one every 10 minutes of waiting, not one per poll.
    progress = [line for line in world.lines if line.startswith(QR_ID)]
    assert 3 * HOUR // 600 <= len(progress) <= 3 * HOUR // 600 + 4
    assert "ACTIVE" in progress[-1] and "10.42.0.7" in progress[-1]


def test_wait_gives_up_at_its_timeout():
    world = World(create_wait_seconds=60, valid_until_seconds=None)
    world.stack.create_queued_resource(world.props)
    ready, rows, _ = capacity.wait(
        world.stack, world.clouds, HOUR, 300, world.log, clock=world.clock, sleep=world.clock.sleep
    )
    assert not ready and rows[0].state == "WAITING_FOR_RESOURCES"
    assert any("not ready after 1h00m" in line for line in world.lines)


# --- the seam to Pulumi -----------------------------------------------------------------------------


class RecordingAutomationStack:
    """Stands in for pulumi.automation.Stack and records how it is called."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []

    def up(self, **kwargs):
        self.calls.append(("up", kwargs))

        class Output:
            def __init__(self, value):
                self.value = value

        return type("UpResult", (), {"outputs": {"hosts": Output([{"name": "h"}])}})()

    def export_stack(self):
        self.calls.append(("export_stack", {}))
        return type("Deployment", (), {"deployment": {"resources": [{"type": "pulumi:pulumi:Stack"}]}})()

    def get_all_config(self):
        self.calls.append(("get_all_config", {}))
        return {"gcp:project": type("ConfigValue", (), {"value": PROJECT})()}


def test_automation_stack_calls_the_automation_api_as_it_is_declared(monkeypatch, tmp_path):
    from pulumi import automation

    recorder, selected = RecordingAutomationStack(), []

    def select_stack(**kwargs):
        selected.append(kwargs)
        return recorder

    monkeypatch.setattr(automation, "select_stack", select_stack)
    stack = capacity.AutomationStack("tpu-v6e4", tmp_path)
    assert stack.resources() == [{"type": "pulumi:pulumi:Stack"}]
    assert stack.config() == {"gcp:project": PROJECT}
    assert stack.up(print) == {"hosts": [{"name": "h"}]}
    # The real signatures accept exactly what the seam passes.
    inspect.signature(automation.select_stack).bind(**selected[0])
    up_kwargs = next(kwargs for name, kwargs in recorder.calls if name == "up")
    inspect.signature(automation.Stack.up).bind(None, **up_kwargs)
    assert selected[0] == {"stack_name": "tpu-v6e4", "work_dir": str(tmp_path)}
    assert up_kwargs["refresh"] is True and up_kwargs["show_secrets"] is False


# --- the command line -------------------------------------------------------------------------------


@pytest.fixture
def cli_world(monkeypatch):
    world = World(create_wait_seconds=60)
    world.stack.create_queued_resource(world.props)
    monkeypatch.setattr(capacity, "open_stack", lambda name, project_dir: world.stack)
    monkeypatch.setattr(capacity, "open_clouds", lambda stack: world.clouds)
    monkeypatch.setattr(capacity, "clock", world.clock)
    monkeypatch.setattr(capacity, "pause", world.clock.sleep)
    return world


def test_cli_status_json(cli_world):
    result = CliRunner().invoke(app, ["capacity", "status", "--stack", "tpu-v6e4", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)[0]["name"] == QR_ID


def test_cli_status_table(cli_world):
    result = CliRunner().invoke(app, ["capacity", "status", "--stack", "tpu-v6e4"])
    assert result.exit_code == 0 and "WAITING_FOR_RESOURCES" in result.stdout


def test_cli_wait_exits_1_on_timeout(cli_world):
    result = CliRunner().invoke(app, ["capacity", "wait", "--stack", "tpu-v6e4", "--timeout", "30m", "--poll", "600"])
    assert result.exit_code == 1


def test_cli_refuses_an_unknown_stack_before_touching_pulumi(monkeypatch):
    monkeypatch.setattr(capacity, "open_stack", lambda *a: pytest.fail("opened a stack that has no stack file"))
    result = CliRunner().invoke(app, ["capacity", "status", "--stack", "tpu-v9"])
    assert result.exit_code == 2 and "stack = 'tpu-v9'" in result.output and "tpu-v6e4" in result.output


def test_cli_refuses_a_bad_interval(cli_world):
    result = CliRunner().invoke(app, ["capacity", "watch", "--stack", "tpu-v6e4", "--interval", "often"])
    assert result.exit_code == 2 and "--interval = 'often'" in result.output


def test_cli_without_the_pulumi_cli_says_so(monkeypatch):
    def missing(*args):
        raise FileNotFoundError(2, "No such file or directory", "pulumi")

    monkeypatch.setattr(capacity, "open_stack", missing)
    result = CliRunner().invoke(app, ["capacity", "status", "--stack", "tpu-v6e4"])
    assert result.exit_code == 1 and "pulumi: not found" in result.output
