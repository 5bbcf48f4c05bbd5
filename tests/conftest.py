"""Suite-wide fixtures: sandbox hosts (tests/sandbox_fixtures.py) for the tests that deploy to real hosts, and a
real GCS API emulator on loopback (tests/gcs_fixtures.py) for the bucket tests. The `[figure]` lines tests print
(measurements, never asserted as timings) are gathered into one section of the terminal summary, so a CI log
carries them even when every test passes."""

from __future__ import annotations

import pytest

pytest_plugins = ["tests.sandbox_fixtures", "tests.gcs_fixtures"]

FIGURE = "[figure]"
_figures: list[tuple[str, str]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # A later phase's report repeats the earlier phases' output: keep each line once per test.
    for line in report.capstdout.splitlines():
        figure = (report.nodeid, line.strip()[len(FIGURE) :].strip())
        if line.strip().startswith(FIGURE) and figure not in _figures:
            _figures.append(figure)


def pytest_terminal_summary(terminalreporter) -> None:
    if not _figures:
        return
    terminalreporter.section("figures (measured, not asserted)")
    for nodeid, figure in _figures:
        terminalreporter.write_line(f"{figure}  ({nodeid.split('::')[-1]})")
