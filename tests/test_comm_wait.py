"""deeppart.comm._wait: a rank that waits in a small MPI collective
sleeps between polls instead of holding a core (the agreement of an
asynchronous save on more ranks than cores)."""

from __future__ import annotations

import time

import pytest

from deeppart import comm


class FakeRequest:
    """An MPI request that completes on its ``after``-th ``Test``."""

    def __init__(self, after: int) -> None:
        self.after = after
        self.tests = 0

    def Test(self) -> bool:
        self.tests += 1
        return self.tests >= self.after


def test_a_done_request_returns_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    sleeps: list[float] = []
    monkeypatch.setattr(time, "sleep", sleeps.append)
    req = FakeRequest(1)
    comm._wait(req)
    assert req.tests == 1 and sleeps == []


def test_a_long_wait_sleeps_between_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    sleeps: list[float] = []
    monkeypatch.setattr(time, "sleep", sleeps.append)
    monkeypatch.setattr(comm, "SPIN_SECONDS", 0.0)
    req = FakeRequest(40)
    comm._wait(req)
    assert req.tests == 40, "polls until the request completes, and no further"
    # Past the spin window every failed poll is followed by one sleep.
    assert len(sleeps) == 38
    assert all(s == comm.POLL_SECONDS for s in sleeps)
