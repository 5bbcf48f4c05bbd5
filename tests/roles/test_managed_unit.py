"""roles/_lib/managed.managed_unit, the roles' "install a program's unit, restart it if anything changed" shape:
which pyinfra operations it asks for and when they run (operations recorded, not run)."""

from __future__ import annotations

import pytest

from roles._lib import managed
from roles._lib.facts import PathState, UnitState


class Op:
    def __init__(self, changed: bool):
        self.changed = changed

    def did_change(self) -> bool:
        return self.changed


class Now:
    def __init__(self):
        self.paths = {"/etc/systemd/system/x.service": PathState("absent")}

    def path(self, path):
        return self.paths[path]

    def unit(self, unit):
        return UnitState(running=True, enabled=True)


@pytest.fixture
def recorded(monkeypatch):
    calls = []

    def record(kind, result=None):
        def call(**kwargs):
            calls.append((kind, kwargs))
            return result

        return call

    monkeypatch.setattr(managed, "managed_file", lambda **kw: calls.append(("file", kw)) or Op(kw["content"] == "new"))
    monkeypatch.setattr(managed.systemd, "service", record("service"))
    monkeypatch.setattr(managed.systemd, "daemon_reload", record("reload"))
    monkeypatch.setattr(managed, "managed_service", record("keep"))
    return calls


@pytest.mark.parametrize(
    "content, program_changed, restarts", [("new", False, True), ("same", True, True), ("same", False, False)]
)
def test_a_running_unit_restarts_when_its_file_or_its_program_changed(recorded, content, program_changed, restarts):
    unit = managed.managed_unit("x.service", content, Now(), restart_with=(Op(program_changed).did_change,))
    assert unit.did_change() is (content == "new")
    kinds = [kind for kind, _ in recorded]
    assert kinds == ["file", "service", "keep"]
    service = recorded[1][1]
    assert service["restarted"] and service["daemon_reload"] and service["service"] == "x.service"
    assert service["_if"]() is restarts
    assert recorded[2][1]["running"] is True and recorded[2][1]["enabled"] is True


def test_a_unit_only_enabled_is_reloaded_never_restarted(recorded):
    managed.managed_unit("x.service", "new", Now(), running=None)
    kinds = [kind for kind, _ in recorded]
    assert kinds == ["file", "reload", "keep"]
    assert recorded[1][1]["_if"]() is True
    assert recorded[2][1]["running"] is None and recorded[2][1]["enabled"] is True
