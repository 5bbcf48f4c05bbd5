"""`gemmaserve capacity`: status, wait and watch against the fake TPU API, acting only through the stack.

The stack is tests/ops/fake_stack.FakeStack, whose `up` runs the real provider; capacity itself gets
read-only clouds. What could not run here (no pulumi CLI) is the real automation API call; the seam's
use of it is checked against the automation API's own signatures below.
"""

from __future__ import annotations

import inspect
import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from gemmaserve.ops import capacity
from gemmaserve.ops.cli import app
from tests.infra.fake_tpu import EPOCH, FakeTpu, Zone
from tests.infra.test_tpu_queued_resource import HOUR, PROJECT, QR_ID, ZONES, props, provider, qr_name
from tests.ops.fake_stack import FakeCompute, FakeStack, read_only


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
    world.stack.add_vm("gs-a100-gpu-0", "us-central1-a", provisioning="SPOT")
    world.compute.instances[(PROJECT, "us-central1-a", "gs-a100-gpu-0")]["status"] = "TERMINATED"
    (row,) = world.survey()
    assert (row.kind, row.provisioning, row.next) == ("vm", "spot", "start: the VM is TERMINATED")
    result = world.once()
    assert result.ran_up and result.rows[0].state == "RUNNING"


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
