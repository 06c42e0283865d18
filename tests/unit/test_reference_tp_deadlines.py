"""How long the tensor-parallel runner waits for its ranks on a weight-update group: long
enough for any valid request, since a rank that overruns the wait fails the whole engine.
(The runner is not started: its ``call`` is replaced by one that records the deadline.)"""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers import TINY
from weightsync.core.plan.boxes import Box
from weightsync.core.plan.value import Piece, PlanPart, Transfer
from weightsync.core.requests import InitGroupRequest
from weightsync.core.snapshot import TensorSpec
from weightsync.core.sources import PlanSource
from weightsync.engines.reference.tp_plan import receive_budget_s
from weightsync.engines.reference.tp_runner import TPRunner
from weightsync.transports.distributed.receiver import START_GRACE_S

GROUP_TIMEOUT_S = 10.0
RUNNER_TIMEOUT_S = 7.0


class _Registry:
    timeout_s = GROUP_TIMEOUT_S

    def get(self, name: str) -> _Registry:
        return self

    def plan_group(self, name: str) -> _Registry:
        return self

    def names(self) -> list[str]:
        return []


def _runner(monkeypatch: pytest.MonkeyPatch, answer: Any) -> tuple[TPRunner, list[float]]:
    runner = TPRunner(TINY, 2, slots=1, timeout_s=RUNNER_TIMEOUT_S)
    waited: list[float] = []

    def call(op: str, *args: Any, local: Any = None, timeout_s: float | None = None) -> Any:
        assert timeout_s is not None
        waited.append(timeout_s)
        return answer

    monkeypatch.setattr(runner, "call", call)
    return runner, waited


def _part(per_rank: list[int], sources: int) -> PlanPart:
    """A part whose rank ``r`` receives ``per_rank[r]`` one-element transfers, from
    ``sources`` trainer ranks in turn."""
    n = sum(per_rank)
    spec = TensorSpec("w", "float32", (n,))
    transfers, k = [], 0
    for rank, count in enumerate(per_rank):
        for _ in range(count):
            piece = Piece("w", Box(((k, k + 1),)), 0, 4)
            transfers.append(Transfer(k, k, k % sources, 0, rank, sources + rank, -1, 4, (piece,)))
            k += 1
    return PlanPart("w0", 0, sources, sources, sources + len(per_rank), 64, (spec,), tuple(transfers))


def test_the_budget_counts_every_blocking_step_of_the_slowest_rank() -> None:
    part = _part([1, 20], sources=2)
    # rank 1: the go, 20 messages, the hashes of 2 sources; plus 2 for slack
    assert receive_budget_s(part, 2, GROUP_TIMEOUT_S) == (1 + 20 + 2 + 2) * GROUP_TIMEOUT_S
    assert receive_budget_s(_part([0, 0], sources=1), 2, GROUP_TIMEOUT_S) == 3 * GROUP_TIMEOUT_S


def test_a_long_plan_gets_a_deadline_that_covers_every_message(monkeypatch: pytest.MonkeyPatch) -> None:
    runner, waited = _runner(monkeypatch, ({"ok": True}, [{"ok": True}]))
    part = _part([2, 30], sources=1)
    runner.receive_plan(_Registry(), PlanSource("g", "s", part), staged=False)  # type: ignore[arg-type]
    # each of rank 1's 30 receives may take a whole group timeout
    assert waited == [receive_budget_s(part, 2, GROUP_TIMEOUT_S) + RUNNER_TIMEOUT_S]
    assert waited[0] >= 30 * GROUP_TIMEOUT_S


@pytest.mark.parametrize(("receiver", "grace"), [("inline", 0.0), ("process", START_GRACE_S)])
def test_joining_waits_out_a_helper_process_start(
    monkeypatch: pytest.MonkeyPatch, receiver: str, grace: float
) -> None:
    runner, waited = _runner(monkeypatch, (None, [None]))
    req = InitGroupRequest("127.0.0.1", 1, 1, 3, "g", "gloo", GROUP_TIMEOUT_S, receiver)
    runner.join_update_group(_Registry(), req)  # type: ignore[arg-type]
    assert waited == [GROUP_TIMEOUT_S + grace + RUNNER_TIMEOUT_S]
    assert runner.joined_by_all("g")
