"""`Flight` (the sharded plan's point-to-point window) starts an operation only once there is
room: a buffer's next receive never starts before its previous receive was waited for and
unpacked (two receives in flight, double-buffered)."""

from __future__ import annotations

from typing import Any

import pytest

from weightsync.transports.distributed.sharded import RECEIVE_DEPTH, Flight


class _Events:
    """A stand-in group that only records when work is waited for."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []

    def wait(self, work: Any) -> None:
        self.log.append(("wait", work))


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_an_operation_starts_only_after_the_one_depth_back_finished_its_follow_up(depth: int) -> None:
    group = _Events()
    flight = Flight(group, depth=depth)  # type: ignore[arg-type]

    def start(k: int) -> int:
        group.log.append(("start", k))
        return k

    for k in range(8):
        flight.add(lambda k=k: start(k), lambda k=k: group.log.append(("then", k)))
        assert len(flight.pending) <= depth
    flight.drain()
    log = group.log
    for k in range(depth, 8):
        # the operation `depth` back (which used the same buffer at depth 2) is done first
        assert log.index(("then", k - depth)) < log.index(("start", k))
    assert [e for e in log if e[0] == "then"] == [("then", k) for k in range(8)]


def test_the_worker_keeps_two_receives_in_flight() -> None:
    assert RECEIVE_DEPTH == 2
