"""The `gemmaserve` command is the operator's CLI with the sandbox's commands plugged in (gemmaserve/__main__.py):
ops.cli alone has none of them, the assembled one lists them where they always were."""

from __future__ import annotations

import subprocess
import sys

from typer.testing import CliRunner

from tests import ROOT

SANDBOX_COMMANDS = {"demo", "tiny-model", "sandbox"}


def names(app) -> list[str]:
    import typer.main

    return list(typer.main.get_command(app).commands)


def test_the_operators_cli_has_no_sandbox_command() -> None:
    # In a child: importing gemmaserve.__main__ in this process would plug the sandbox into the shared app.
    code = (
        "import typer.main; from gemmaserve.ops.cli import app; print(' '.join(typer.main.get_command(app).commands))"
    )
    listed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert "plan" in listed and "capacity" in listed and not SANDBOX_COMMANDS & set(listed)


def test_the_gemmaserve_command_lists_the_sandboxs_commands_where_they_were() -> None:
    from gemmaserve.__main__ import app

    assert names(app) == [
        "plan",
        "demo",
        "status",
        "verify",
        "bench",
        "tiny-model",
        "weights",
        "keys",
        "sandbox",
        "capacity",
    ]
    assert list(typer_group(app, "sandbox").commands) == ["up", "down", "status", "ssh", "reboot", "bench"]


def typer_group(app, name: str):
    import typer.main

    return typer.main.get_command(app).commands[name]


def test_plugging_in_twice_adds_nothing() -> None:
    from gemmaserve.__main__ import app
    from gemmaserve.sandbox.cli import plug_into

    before = names(app)
    assert names(plug_into(app)) == before


def test_a_plugged_in_command_reports_bad_input_as_before() -> None:
    from gemmaserve.__main__ import app

    result = CliRunner().invoke(app, ["demo", "--weights", "nfs"])
    assert result.exit_code == 2 and "error: --weights = 'nfs': allowed: local, bucket" in result.output


def test_python_m_gemmaserve_runs_the_assembled_cli() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gemmaserve", "sandbox", "--help"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0 and "Boot sandbox hosts" in result.stdout
