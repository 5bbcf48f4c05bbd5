"""roles/batch.py: the one-command facts run for real in a local shell, and the decisions they drive
(operation or none) with the facts fed in."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest

from roles import batch


def run_fact(fact: batch.FactBase, **kwargs) -> object:
    command = fact.command(**kwargs)
    output = subprocess.run(["sh", "-c", command], check=True, capture_output=True, text=True).stdout
    return fact.process(output.splitlines())


def test_path_states_reads_kind_owner_mode_and_sha1(tmp_path: Path) -> None:
    spaced = tmp_path / "a file with spaces"
    spaced.write_text("hello\n")
    spaced.chmod(0o640)
    folder = tmp_path / "dir"
    folder.mkdir(mode=0o750)
    folder.chmod(0o750)
    states = run_fact(batch.PathStates(), paths=(str(spaced), str(folder), str(tmp_path / "missing")))
    user = subprocess.run(["id", "-un"], capture_output=True, text=True, check=True).stdout.strip()
    assert states[0] == batch.PathState("file", user, states[0].group, 0o640, hashlib.sha1(b"hello\n").hexdigest())
    assert states[1].kind == "directory" and states[1].mode == 0o750 and states[1].sha1 == ""
    assert states[2] == batch.PathState("absent")


def test_installed_packages_tells_installed_from_missing() -> None:
    if not Path("/usr/bin/dpkg-query").exists():
        pytest.fail("dpkg-query is part of every Debian/Ubuntu machine this project supports")
    installed = run_fact(batch.InstalledPackages(), packages=("dpkg", "gemmaserve-no-such-package"))
    assert installed == {"dpkg"}


def test_unit_states_parses_active_and_enabled() -> None:
    states = batch.UnitStates().process(
        ["haproxy.service active enabled", "vllm@1.service failed", "gone.service inactive"]
    )
    assert states == {
        "haproxy.service": ("active", "enabled"),
        "vllm@1.service": ("failed", ""),
        "gone.service": ("inactive", ""),
    }


class FakeHost:
    def __init__(self, facts: dict):
        self.facts = facts

    def get_fact(self, cls, **kwargs):
        return self.facts[cls]


@pytest.fixture
def emitted(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict]]:
    calls: list[tuple[str, dict]] = []
    for module, op in (
        (batch.files, "put"),
        (batch.files, "directory"),
        (batch.systemd, "service"),
        (batch.apt, "packages"),
    ):
        monkeypatch.setattr(module, op, lambda _op=op, **kw: calls.append((_op, kw)) or f"{_op}-op")
    return calls


def snapshot(monkeypatch: pytest.MonkeyPatch, paths: dict[str, batch.PathState], units=None) -> batch.Snapshot:
    monkeypatch.setattr(
        batch, "host", FakeHost({batch.PathStates: list(paths.values()), batch.UnitStates: units or {}})
    )
    return batch.Snapshot(paths=list(paths), units=list(units or {}))


CONTENT = "x = 1\n"
SHA1 = hashlib.sha1(CONTENT.encode()).hexdigest()


def test_matching_file_emits_no_operation(monkeypatch, emitted) -> None:
    now = snapshot(monkeypatch, {"/f": batch.PathState("file", "root", "root", 0o644, SHA1)})
    assert now.put(name="f", dest="/f", content=CONTENT) is batch.UNCHANGED
    assert not batch.UNCHANGED.did_change() and emitted == []


@pytest.mark.parametrize(
    "state",
    [
        batch.PathState("file", "root", "root", 0o644, "0" * 40),  # content differs
        batch.PathState("file", "root", "root", 0o600, SHA1),  # mode differs
        batch.PathState("file", "nobody", "root", 0o644, SHA1),  # owner differs
        batch.PathState("absent"),
        batch.PathState("directory", "root", "root", 0o644),
    ],
)
def test_any_difference_emits_pyinfras_put(monkeypatch, emitted, state) -> None:
    now = snapshot(monkeypatch, {"/f": state})
    assert now.put(name="f", dest="/f", content=CONTENT) == "put-op"
    assert emitted[0][1]["dest"] == "/f" and emitted[0][1]["mode"] == "0644"


def test_unreadable_answer_falls_back_to_pyinfra(monkeypatch, emitted) -> None:
    monkeypatch.setattr(batch, "host", FakeHost({batch.PathStates: [], batch.UnitStates: {}}))
    now = batch.Snapshot(paths=["/f"])
    assert now.put(name="f", dest="/f", content=CONTENT) == "put-op"


def test_directory_decision(monkeypatch, emitted) -> None:
    now = snapshot(
        monkeypatch,
        {
            "/d": batch.PathState("directory", "root", "gemmaserve", 0o750),
            "/e": batch.PathState("directory", "root", "root", 0o755),
        },
    )
    assert now.directory(name="d", path="/d", group="gemmaserve", mode="0750") is batch.UNCHANGED
    assert now.directory(name="e", path="/e", mode="0750") == "directory-op"


@pytest.mark.parametrize(
    "state, running, enabled, needed",
    [
        (("active", "enabled"), True, True, False),
        (("active", "static"), True, True, False),
        (("inactive", "enabled"), True, True, True),
        (("failed", "enabled"), True, True, True),
        (("active", "disabled"), True, True, True),
        (("inactive", "enabled"), None, True, False),
        (("active", "enabled"), False, False, True),
    ],
)
def test_service_decision(monkeypatch, emitted, state, running, enabled, needed) -> None:
    now = snapshot(monkeypatch, {}, units={"x.service": state})
    result = now.service(name="x", service="x.service", running=running, enabled=enabled)
    assert (result == "service-op") is needed
    assert now.is_failed("x.service") is (state[0] == "failed")


def test_packages_only_when_missing(monkeypatch, emitted) -> None:
    monkeypatch.setattr(batch, "host", FakeHost({batch.InstalledPackages: {"curl"}}))
    assert batch.packages(name="p", packages=["curl"]) is batch.UNCHANGED
    assert batch.packages(name="p", packages=["curl", "haproxy"]) == "packages-op"
    assert emitted == [
        (
            "packages",
            {"name": "p", "packages": ["curl", "haproxy"], "no_recommends": True, "update": True, "cache_time": 3600},
        )
    ]


def test_render_keeps_the_trailing_newline_and_is_strict(tmp_path: Path) -> None:
    (tmp_path / "t.j2").write_text("  {% if x %}\na={{ x }}\n  {% endif %}\n")
    assert batch.render(tmp_path / "t.j2", x=1) == "a=1\n"
    with pytest.raises(Exception, match="'x' is undefined"):
        batch.render(tmp_path / "t.j2")
