"""ops.fleet reads pyinfra's own tables: the results of a run and the changes a dry run detects.

The samples are pyinfra 3.10's output from real deploys to a sandbox host (trimmed to a few rows)."""

from __future__ import annotations

import pytest

from gemmaserve.ops.fleet import PyinfraRun

RESULTS = """--> Results:
    Operation                                                       Hosts   Success   Error   No Change
    Prepare the host | Install base packages                        1       -         -       1
    Run vLLM replicas | Install the vllm@.service template          1       1         -       -
    Route with HAProxy | Keep HAProxy running                       1       -         -       1
    Grand total                                                     58      3         -       55

--> Disconnecting from hosts...
"""

DETECTED = """--> Detected changes:
    Operation                                                                             Change          Conditional Change
    Prepare the host | Install base packages                                              -               -
    Run vLLM replicas | Wait for replica 0 to be healthy (http://127.0.0.1:8000/health)   -               1 (sandbox-1)
    Monitor with Prometheus | Keep Prometheus running                                     1 (sandbox-1)   -

    Detected changes may not include every change pyinfra will execute.
"""


def test_totals_read_the_grand_total_row() -> None:
    assert PyinfraRun(0, RESULTS, 1.0).totals() == (58, 3)
    assert PyinfraRun(0, RESULTS.replace("58      3", "58      -"), 1.0).totals() == (58, 0)


def test_proposed_changes_count_only_unconditional_changes() -> None:
    assert PyinfraRun(0, DETECTED, 1.0).proposed_changes() == ["Monitor with Prometheus | Keep Prometheus running"]


def test_missing_tables_are_errors_not_zeros() -> None:
    with pytest.raises(ValueError, match="no results table"):
        PyinfraRun(1, "--> An exception occurred in: deploy.py", 1.0).totals()
    with pytest.raises(ValueError, match="no detected-changes table"):
        PyinfraRun(0, RESULTS, 1.0).proposed_changes()
