"""Bad input to the real `gemmaserve` command line is a one-line error (exit 2) naming the option or field, the
value and what is allowed, never a traceback (issue 26, "the endpoint on a bad day")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from gemmaserve.ops.cli import app
from tests import ROOT


def cli(*args: str, input: str | None = None):
    result = CliRunner().invoke(app, list(args), input=input)
    assert "Traceback" not in result.output, result.output
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.exception
    return result


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e308", "0", "-1", "100000"])
def test_available_kv_gib_is_a_finite_size_the_device_can_hold(value):
    result = cli("plan", "--model", "e2b", "--accelerator", "l4", "--available-kv-gib", value)
    assert result.exit_code == 2, result.output
    assert f"--available-kv-gib = {float(value)}: allowed: a number > 0 and at most" in result.output


def test_available_kv_gib_within_the_device_still_plans():
    assert cli("plan", "--model", "e2b", "--accelerator", "l4", "--available-kv-gib", "10").exit_code == 0


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["capacity", "wait", "--timeout", "99999999999d"], "--timeout = '99999999999d': "),
        (["capacity", "wait", "--poll", "0"], "--poll = 0.0: "),
        (["capacity", "wait", "--poll", "nan"], "--poll = nan: "),
        (["capacity", "watch", "--interval", "0s"], "--interval = '0s': "),
        (["capacity", "watch", "--interval", "99999999999d"], "--interval = '99999999999d': "),
    ],
)
def test_capacity_durations_out_of_range(args, named):
    result = cli(*args, "--stack", "tpu-v6e4", "--project-dir", str(ROOT))
    assert result.exit_code == 2, result.output
    assert named in result.output and "allowed" in result.output, result.output


def stack_dir(tmp_path: Path, **cloud) -> Path:
    document = yaml.safe_load((ROOT / "Pulumi.tpu-v6e4.yaml").read_text())
    document["config"]["gemmaserve:cloud"].update(cloud)
    (tmp_path / "Pulumi.x.yaml").write_text(yaml.safe_dump(document))
    return tmp_path


def test_cloud_valid_until_out_of_range_is_named(tmp_path):
    result = cli(
        "capacity", "status", "--stack", "x", "--project-dir", str(stack_dir(tmp_path, valid_until="99999999999d"))
    )
    assert result.exit_code == 2, result.output
    assert "cloud.valid_until = '99999999999d': " in result.output and "allowed" in result.output


def test_an_overlong_duration_is_a_value_error():
    from gemmaserve.spec import parse_duration

    with pytest.raises(ValueError, match="allowed: at most 999999999 days"):
        parse_duration("99999999999d")


@pytest.mark.parametrize(
    "make",
    [
        lambda d: (d / "Pulumi.x.yaml").symlink_to("/etc/hostname"),
        lambda d: (d / "Pulumi.x.yaml").symlink_to(d / "missing.yaml"),
        lambda d: (d / "Pulumi.x.yaml").symlink_to(d / "Pulumi.x.yaml"),
        lambda d: (d / "Pulumi.x.yaml").write_text("- a\n- b\n"),
        lambda d: (d / "Pulumi.x.yaml").write_text("config: [\n"),
        lambda d: (d / "Pulumi.x.yaml").write_text("config:\n  - gemmaserve:model\n"),
    ],
    ids=["symlink-to-a-text-file", "dangling-symlink", "symlink-loop", "a-list", "not-yaml", "config-a-list"],
)
@pytest.mark.parametrize("command", [["plan"], ["keys", "list"], ["capacity", "status"]])
def test_a_stack_file_that_is_no_stack_file_is_named(tmp_path, make, command):
    make(tmp_path)
    result = cli(*command, "--stack", "x", "--project-dir", str(tmp_path))
    assert result.exit_code == 2, result.output
    assert "Pulumi.x.yaml" in result.output and "allowed" in result.output, result.output


def test_keys_add_without_credentials_is_an_error_and_prints_no_key(tmp_path):
    document = yaml.safe_load((ROOT / "Pulumi.gpu8.yaml").read_text())
    document["config"]["gcp:project"] = "demo-project"
    (tmp_path / "Pulumi.gpu8.yaml").write_text(yaml.safe_dump(document))
    result = subprocess.run(
        [sys.executable, "-m", "gemmaserve", "keys", "add", "alice", "--stack", "gpu8", "--project-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        # No credentials anywhere, and no metadata server to ask (google-auth's NO_GCE_CHECK).
        env={"PATH": os.environ["PATH"], "HOME": str(tmp_path), "NO_GCE_CHECK": "true", "COLUMNS": "200"},
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "gsk-" not in result.stdout + result.stderr
    assert "no Google credentials" in result.stderr and "gcloud auth application-default login" in result.stderr


def test_no_command_group_shows_locals_in_a_traceback():
    """A traceback must never print a function's locals: `keys add` holds the key it made."""

    def apps(each: typer.Typer):
        yield each
        for group in each.registered_groups:
            yield from apps(group.typer_instance)

    assert [a.info.name or "gemmaserve" for a in apps(app) if a.pretty_exceptions_show_locals] == []


@pytest.mark.parametrize(
    "key", ["a" * 40, "abcabcabcabcabcabcabcabc", "password1234567890abc", "0123456789" * 3, "short-key"]
)
def test_a_weak_key_on_stdin_is_refused_without_echoing_it(key):
    result = cli("keys", "add", "ci", "--key-stdin", "--stack", "gpu8", "--project-dir", str(ROOT), input=key + "\n")
    assert result.exit_code == 2, result.output
    assert "--key-stdin: " in result.output and "allowed" in result.output and "128 bits" in result.output
    assert key not in result.output


def _stack_with_valid_until(d: Path) -> None:
    document = yaml.safe_load((ROOT / "Pulumi.tpu-v6e4.yaml").read_text())
    document["config"]["gemmaserve:cloud"]["valid_until"] = "99999999999d"
    (d / "Pulumi.x.yaml").write_text(yaml.safe_dump(document))


# Each case of issue 26's item 9, run as the operator runs it: a process, typer's own exception handling, no
# test runner in between. (make, args with {dir} for a stack directory the case makes, what the error names)
AS_A_PROCESS = {
    "cloud.valid_until": (_stack_with_valid_until, ["capacity", "status", "--stack", "x"], "cloud.valid_until = "),
    "wait --timeout": (None, ["capacity", "wait", "--timeout", "99999999999d"], "--timeout = '99999999999d': "),
    "watch --interval 0s": (None, ["capacity", "watch", "--interval", "0s"], "--interval = '0s': "),
    **{
        f"--available-kv-gib {v}": (None, ["plan", "--model", "e2b", "--accelerator", "l4", "--available-kv-gib", v], "--available-kv-gib = ")
        for v in ("nan", "inf", "1e308")
    },
    "symlinked stack file": (
        lambda d: (d / "Pulumi.x.yaml").symlink_to("/etc/hostname"),
        ["plan", "--stack", "x"],
        "(a symlink to /etc/hostname)",
    ),
    "weak key on stdin": (None, ["keys", "add", "ci", "--key-stdin"], "--key-stdin: "),
}  # fmt: skip


@pytest.mark.parametrize("case", list(AS_A_PROCESS))
def test_each_bad_input_as_a_process_is_one_clean_error(tmp_path, case):
    make, args, named = AS_A_PROCESS[case]
    if make is not None:
        make(tmp_path)
        args = [*args, "--project-dir", str(tmp_path)]
    elif "--model" not in args:
        args = [*args, "--stack", "gpu8" if args[0] == "keys" else "tpu-v6e4", "--project-dir", str(ROOT)]
    weak = "a" * 40
    result = subprocess.run(
        [sys.executable, "-m", "gemmaserve", *args],
        input=weak + "\n",
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": os.environ["PATH"], "HOME": str(tmp_path), "NO_GCE_CHECK": "true", "COLUMNS": "200"},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "Traceback" not in output and weak not in output, output
    assert named in output and "allowed" in output, output
