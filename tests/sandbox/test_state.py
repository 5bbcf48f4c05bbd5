"""state.free_indices: the throwaway-host indices benches and tests take, clear of recorded hosts."""

import pytest

from gemmaserve.sandbox import state


def recorded(monkeypatch, *indices: int) -> None:
    monkeypatch.setattr(state, "load_state", lambda: state.State(hosts=[state.new_host(i) for i in indices]))


def test_skips_indices_in_use(monkeypatch):
    recorded(monkeypatch, 1, 101, 103)
    assert state.free_indices(3) == [102, 104, 105]


def test_refuses_when_the_range_runs_out(monkeypatch):
    recorded(monkeypatch, *range(101, 254))
    assert state.free_indices(1) == [254]
    with pytest.raises(RuntimeError, match="no 2 free sandbox host indices from 101"):
        state.free_indices(2)
