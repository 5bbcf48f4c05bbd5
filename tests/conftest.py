"""Suite-wide fixtures: sandbox hosts (tests/sandbox_fixtures.py) for the tests that deploy to real hosts, and a
real GCS API emulator on loopback (tests/gcs_fixtures.py) for the bucket tests. A test asking for a fixture of the
sandbox or vllm tier must carry that tier's marker (docs/testing.md, "Test tiers"). The `[figure]` lines tests
print (measurements, never asserted as timings) are gathered into one section of the terminal summary, so a CI
log carries them even when every test passes."""

from __future__ import annotations

import pytest

pytest_plugins = ["tests.sandbox_fixtures", "tests.gcs_fixtures"]

# The tier each fixture puts a test in: unmarked, `make check` would boot hosts or build the vLLM CPU venv.
FIXTURE_TIERS = {
    "sandbox_ready": "sandbox",
    "served_assets": "sandbox",
    "sandbox_hosts": "sandbox",
    "sandbox_host": "sandbox",
    "fresh_sandbox_host": "sandbox",
    "serving_peer": "sandbox",
    "bucket_emulator": "sandbox",
    "bucket_hosts": "sandbox",
    "served_image": "sandbox",
    "vllm_python": "vllm",
}

FIGURE = "[figure]"
_figures: list[tuple[str, str]] = []
# Seconds spent in each tier's tests (setup, call and teardown), and how many tests ran in it.
TIERS = ("sandbox", "vllm", "network")
_tier_seconds: dict[str, float] = {}
_tier_tests: dict[str, set[str]] = {}


def tier_of(item: pytest.Item) -> str:
    """The most expensive tier a test is marked with (docs/testing.md), or "fast" for `make check`'s."""
    return next((tier for tier in TIERS if item.get_closest_marker(tier)), "fast")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    # Carried with the report, so the summary can count it where the report arrives (under pytest-xdist, the
    # controller, not the worker that ran the test).
    report.user_properties.append(("tier", tier_of(item)))
    return report


# `make test` runs two pytest-xdist workers (docs/testing.md): one runs every test under these directories, the
# sandbox tier with them, in order (its hosts are session fixtures its modules share); the other runs everything
# else in order, then OWN_HOST_MODULES. The workers never share a fixture, a port or a host, and the CPU-bound tests
# run while sandbox tests wait on hosts. A sandbox test elsewhere would run beside them:
# `pytest_collection_modifyitems` refuses it.
SANDBOX_WORKER_DIRS = ("tests/roles/sandbox/", "tests/sandbox/")
# Sandbox modules whose hosts are their own (taken under the sandbox lock: lifecycle.up_new_hosts) and that use
# none of the sandbox worker's session hosts: a third work unit, which the other worker takes once its own is done
# (xdist's loadscope gives a worker the next unit when it has two tests left), so it runs beside the sandbox worker
# instead of after it. Measured: the container module is 500 s of the sandbox worker's 1,960 s.
OWN_HOST_MODULES = ("tests/roles/sandbox/test_container_mode.py",)


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Three work units, not xdist's per-test or per-module ones: SANDBOX_WORKER_DIRS' tests (less
    OWN_HOST_MODULES), the rest, and OWN_HOST_MODULES, given out in that order of size. Only for `-n` without
    `--dist` (make test); another `--dist` (make check's loadfile: no sandbox tier) is xdist's own."""
    if config.getoption("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ThreeUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith(OWN_HOST_MODULES):
                return "own hosts"
            return "sandbox" if nodeid.startswith(SANDBOX_WORKER_DIRS) else "rest"

    return ThreeUnits(config, log)


def outside_the_sandbox_worker(items: list[pytest.Item]) -> list[str]:
    """Each sandbox test that `make test`'s scheduler would run beside the sandbox worker instead of on it."""
    return [
        f"{item.nodeid}: a sandbox test outside {', '.join(SANDBOX_WORKER_DIRS)}"
        for item in items
        if item.get_closest_marker("sandbox") and not item.nodeid.startswith(SANDBOX_WORKER_DIRS)
    ]


# The sandbox worker's session hosts (tests/sandbox_fixtures.py): a module in OWN_HOST_MODULES runs on the other
# worker, where asking for one would bring up a second copy of it beside the first.
SANDBOX_WORKER_HOSTS = ("sandbox_hosts", "bucket_emulator", "bucket_hosts", "serving_peer")


def own_host_modules_borrowing(items: list[pytest.Item]) -> list[str]:
    """Each test of OWN_HOST_MODULES that asks for one of the sandbox worker's session hosts."""
    return [
        f"{item.nodeid}: uses {', '.join(used)}, a host of the sandbox worker's (tests/conftest.py, OWN_HOST_MODULES)"
        for item in items
        if item.nodeid.startswith(OWN_HOST_MODULES)
        and (used := [f for f in SANDBOX_WORKER_HOSTS if f in getattr(item, "fixturenames", ())])
    ]


def unmarked_tiers(items: list[pytest.Item]) -> list[str]:
    """Each test asking for a tier's fixture without that tier's marker."""
    problems = []
    for item in items:
        used = [f for f in FIXTURE_TIERS if f in getattr(item, "fixturenames", ())]
        for tier in sorted({FIXTURE_TIERS[f] for f in used if item.get_closest_marker(FIXTURE_TIERS[f]) is None}):
            fixtures = ", ".join(f for f in used if FIXTURE_TIERS[f] == tier)
            problems.append(f"{item.nodeid}: uses {fixtures}, so it needs @pytest.mark.{tier}")
    return problems


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Before `-m` deselects anything: every collected test is held to its fixtures' tiers.
    if unmarked := unmarked_tiers(items):
        raise pytest.UsageError("tests missing their tier's marker (docs/testing.md):\n" + "\n".join(unmarked))
    if borrowing := own_host_modules_borrowing(items):
        raise pytest.UsageError("\n".join(borrowing))
    if misplaced := outside_the_sandbox_worker(items):
        raise pytest.UsageError(
            "sandbox tests must live where make test's sandbox worker runs them:\n" + "\n".join(misplaced)
        )


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    tier = dict(report.user_properties).get("tier", "fast")
    _tier_seconds[tier] = _tier_seconds.get(tier, 0.0) + report.duration
    _tier_tests.setdefault(tier, set()).add(report.nodeid)
    # A later phase's report repeats the earlier phases' output: keep each line once per test.
    for line in report.capstdout.splitlines():
        figure = (report.nodeid, line.strip()[len(FIGURE) :].strip())
        if line.strip().startswith(FIGURE) and figure not in _figures:
            _figures.append(figure)


def pytest_terminal_summary(terminalreporter) -> None:
    if _tier_seconds:
        terminalreporter.section("time per tier (setup + call + teardown of its tests)")
        for tier in ("fast", *TIERS):
            if tier in _tier_seconds:
                seconds, count = _tier_seconds[tier], len(_tier_tests[tier])
                terminalreporter.write_line(f"{tier:>8}: {seconds:7.1f} s ({seconds / 60:.1f} min), {count} tests")
    if not _figures:
        return
    terminalreporter.section("figures (measured, not asserted)")
    for nodeid, figure in _figures:
        terminalreporter.write_line(f"{figure}  ({nodeid.split('::')[-1]})")
