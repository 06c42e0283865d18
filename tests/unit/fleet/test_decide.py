"""The fleet decider: a truth table, an exhaustive hypothesis run, and a proof the run can fail."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from tests.unit.fleet.decider_machine import machine_for
from weightsync.core.errors import IllegalState
from weightsync.fleet import _decide
from weightsync.fleet._decide import Frame, Outcome, Progress

pytestmark = pytest.mark.unit

W = ("a", "b", "c")


def at(phase: str, active: tuple[str, ...] = W, **kw: Any) -> Progress:
    kw.setdefault("batches", (W,))
    return Progress(phase, "x", active, **kw)


# (policy, quorum, max_unavailable, progress, outcome) -> (trigger, active, fenced, committed)
# Written by hand from the rules in _decide's docstring, not derived from the code.
TRUTH = [
    # prepare
    ("rollback", 2, 3, Progress("preparing", "begin", W), Outcome(ok=W),
     ("prepared", W, set(), set())),
    ("rollback", 2, 3, Progress("preparing", "begin", W), Outcome(ok="ab", refused="c"),
     ("refuse", (), set(), set())),
    ("rollback", 1, 3, Progress("preparing", "begin", W), Outcome(ok="ab", unreachable="c"),
     ("refuse", (), set(), set())),
    ("fence", 2, 3, Progress("preparing", "begin", W), Outcome(ok="ab", unreachable="c"),
     ("prepared", ("a", "b"), {"c"}, set())),
    ("fence", 3, 3, Progress("preparing", "begin", W), Outcome(ok="ab", unreachable="c"),
     ("refuse", (), set(), set())),
    ("fence", 1, 3, Progress("preparing", "begin", W), Outcome(ok="ab", refused="c"),
     ("refuse", (), set(), set())),
    ("rollback", 2, 1, Progress("preparing", "begin", W), Outcome(ok=W),
     ("prepared", ("a",), set(), set())),
    # apply / verify / commit, one batch
    ("rollback", 2, 3, at("applying"), Outcome(ok=W), ("applied", W, set(), set())),
    ("rollback", 2, 3, at("applying"), Outcome(ok="ab", unreachable="c"), ("fail", W, set(), set())),
    ("fence", 2, 3, at("applying"), Outcome(ok="ab", unreachable="c"),
     ("applied", ("a", "b"), {"c"}, set())),
    ("fence", 3, 3, at("verifying"), Outcome(ok="ab", refused="c"), ("fail", W, set(), set())),
    ("fence", 2, 3, at("verifying"), Outcome(ok="a", refused="bc"), ("fail", W, set(), set())),
    ("rollback", 2, 3, at("verifying"), Outcome(ok=W), ("verified", W, set(), set())),
    ("rollback", 2, 3, at("committing"), Outcome(ok=W), ("declared", W, set(), set(W))),
    ("rollback", 2, 3, at("committing"), Outcome(ok="ab", refused="c"), ("fail", W, set(), set())),
    ("fence", 2, 3, at("committing"), Outcome(ok="ab", refused="c"),
     ("declared", ("a", "b"), {"c"}, {"a", "b"})),
    ("rollback", 2, 3, at("resuming", committed=W), Outcome(ok=W), ("resumed", (), set(), set(W))),
    ("fence", 2, 3, at("resuming", ("a", "b"), fenced="c", committed="ab"), Outcome(ok="ab"),
     ("resumed_fenced", (), {"c"}, {"a", "b"})),
    ("rollback", 2, 3, at("rolling_back"), Outcome(ok=W), ("rollback_done", (), set(), set())),
    ("rollback", 2, 3, at("rolling_back"), Outcome(ok="a", refused="bc"),
     ("rollback_incomplete", (), set(), set())),
    # rolling updates: batches of one
    ("rollback", 2, 1, at("resuming", ("a",), batches=(("a",), ("b",), ("c",)), committed="a"),
     Outcome(ok="a"), ("next_batch", ("b",), set(), {"a"})),
    ("rollback", 2, 1, at("applying", ("b",), batches=(("a",), ("b",), ("c",)), batch=1, committed="a"),
     Outcome(refused="b"), ("fail", ("a", "b"), set(), {"a"})),
    ("fence", 3, 1, at("applying", ("b",), batches=(("a",), ("b",), ("c",)), batch=1, committed="a"),
     Outcome(refused="b"), ("applied", (), {"b"}, {"a"})),
    ("fence", 3, 1, at("applying", ("a",), batches=(("a",), ("b",), ("c",))),
     Outcome(refused="a"), ("fail", ("a",), set(), set())),
    ("fence", 2, 1, at("applying", ("a",), batches=(("a",), ("b",), ("c",))),
     Outcome(refused="a"), ("applied", (), {"a"}, set())),
]  # fmt: skip


@pytest.mark.parametrize(("policy", "quorum", "k", "progress", "outcome", "expected"), TRUTH)
def test_truth_table(
    policy: str, quorum: int, k: int, progress: Progress, outcome: Outcome, expected: tuple[Any, ...]
) -> None:
    frame = Frame(W, policy, quorum, k)
    got = _decide.step(frame, progress, outcome)
    trigger, active, fenced, committed = expected
    assert (got.trigger, got.active, set(got.fenced), set(got.committed)) == (
        trigger, tuple(active), fenced, committed,
    )  # fmt: skip


RECOVER = [
    ("rollback", at("preparing"), ("recover_abort", ())),
    ("rollback", at("applying"), ("recover_rollback", W)),
    ("rollback", at("committing"), ("recover_rollback", W)),
    ("rollback", at("rolling_back"), ("recover_rollback", W)),
    ("rollback", at("resuming", committed="ab", fenced="c"), ("recover_forward", ("a", "b"))),
    ("fence", at("committing"), ("recover_rollback", W)),
    ("fence", at("applying", ("b", "c"), batches=(("a",), ("b", "c")), batch=1, committed="a"),
     ("recover_retry", ("b", "c"))),
]  # fmt: skip


@pytest.mark.parametrize(("policy", "progress", "expected"), RECOVER)
def test_recover_table(policy: str, progress: Progress, expected: tuple[str, tuple[str, ...]]) -> None:
    got = _decide.recover(Frame(W, policy, 2, 3), progress)
    assert (got.trigger, got.active) == expected


@pytest.mark.parametrize("phase", ["committed", "aborted", "rolled_back", "rollback_failed", "fenced"])
def test_a_finished_transaction_has_no_next_step_and_nothing_to_recover(phase: str) -> None:
    frame = Frame(W, "rollback", 2, 3)
    with pytest.raises(IllegalState):
        _decide.step(frame, at(phase, ()), Outcome())
    with pytest.raises(IllegalState):
        _decide.recover(frame, at(phase, ()))


def test_an_outcome_must_account_for_every_active_worker_once() -> None:
    frame = Frame(W, "rollback", 2, 3)
    with pytest.raises(ValueError, match="exactly once"):
        _decide.step(frame, at("applying"), Outcome(ok="ab"))
    with pytest.raises(ValueError, match="exactly once"):
        _decide.step(frame, at("applying"), Outcome(ok=W, refused="a"))


def test_progress_round_trips_through_its_versioned_json() -> None:
    p = at("resuming", ("a",), batches=(("a",), ("b", "c")), fenced="b", committed="a")
    assert Progress.from_json(p.to_json()) == p


@pytest.mark.parametrize(
    "bad", [None, [], {"schema": 1}, {**at("applying").to_json(), "phase": "limbo"},
            {**at("applying").to_json(), "batch": "x"}, {**at("applying").to_json(), "schema": 3}],
)  # fmt: skip
def test_progress_from_foreign_json_is_bad_journal(bad: Any) -> None:
    from weightsync.core.errors import InvalidRequest

    with pytest.raises(InvalidRequest) as err:
        Progress.from_json(bad)
    assert err.value.code == "bad_journal"


RUNS = settings(max_examples=150, stateful_step_count=20, deadline=None,
                suppress_health_check=list(HealthCheck))  # fmt: skip


def test_the_decider_keeps_the_commit_protocol_under_every_outcome() -> None:
    run_state_machine_as_test(machine_for(_decide.step), settings=RUNS)


def _continues_past_failures(frame: Frame, progress: Progress, outcome: Outcome) -> Progress:
    """Broken: treats a failure under rollback as if the policy were fence."""
    if progress.phase in ("applying", "verifying", "committing") and outcome.failed:
        frame = attrs.evolve(frame, policy="fence", quorum=1)
    return _decide.step(frame, progress, outcome)


def _resumes_before_everyone_declared(frame: Frame, progress: Progress, outcome: Outcome) -> Progress:
    """Broken: counts a declaration that did not read back as committed."""
    if progress.phase == "committing":
        outcome = Outcome(ok=outcome.all)
    return _decide.step(frame, progress, outcome)


def _fences_below_quorum(frame: Frame, progress: Progress, outcome: Outcome) -> Progress:
    """Broken: forgets the quorum at prepare."""
    return _decide.step(attrs.evolve(frame, quorum=1), progress, outcome)


@pytest.mark.parametrize(
    "broken", [_continues_past_failures, _resumes_before_everyone_declared, _fences_below_quorum]
)
def test_the_machine_fails_on_a_broken_decider(broken: Any) -> None:
    # A derandomized run draws from a seed hashed from the source, so any edit to the machine
    # draws other examples: 150 found the quorum bug in about two runs of three.  The search
    # stops at the first failure; 1000 examples miss none of these in practice (20 of 20 seeds
    # found each, after a couple of hundred examples on average).
    find = settings(
        RUNS, max_examples=1000, phases=[Phase.generate], report_multiple_bugs=False, derandomize=True
    )
    with pytest.raises(AssertionError):
        run_state_machine_as_test(machine_for(broken), settings=find)
