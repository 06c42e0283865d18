"""Which legal trigger fires next: a pure decider beside the table in ``_state.py``.

Built like etcd's ``raft``: :class:`Progress` is a frozen value; :func:`step` takes it with
the :class:`Outcome` of the step the driver just ran (which workers did what was asked,
which refused, which did not answer) and returns the next :class:`Progress` — its phase,
the trigger that led there and the workers the next step acts on.  The driver journals the
new value, sends what that phase sends to those workers (each call built as data by
:mod:`weightsync.fleet.calls`), reads the replies into the next :class:`Outcome`
(:mod:`weightsync.fleet.outcomes`), then calls :func:`step` again.  Nothing here touches a
worker, a clock or the journal, so the tests drive it exhaustively.  :class:`Frame` is a
transaction's fixed part: its workers, policy, quorum and batch size.

Rules (each one is a row of the truth table in the tests):

* ``preparing``: any refusal aborts (the source is bad somewhere).  A worker that did not
  answer aborts under ``rollback``; under ``fence`` it is fenced when the others still make
  the quorum.  Then the workers are cut into batches of ``max_unavailable``.
* ``applying`` / ``verifying`` / ``committing``: everyone did it → the next phase on the
  same workers.  Someone failed → under ``rollback`` a rollback of every worker touched so
  far (earlier batches included); under ``fence`` the failed workers are fenced and the rest
  go on, while the quorum can still be met or an earlier batch already committed (those
  keep the new version); otherwise a rollback.
* ``committing`` → ``resuming`` is the commit point: the workers that declared join
  ``committed``.
* ``resuming``: the next batch, or the end (``committed``, or ``fenced`` when any worker
  was fenced).
* ``rolling_back`` → ``rolled_back`` when every touched worker is back, else
  ``rollback_failed`` (the result's phase names what happened).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final

import attrs

from weightsync.fleet._state import TERMINAL, TransactionMachine
from weightsync.fleet.records import POLICIES, SCHEMA, TransactionSpec, bad_journal

_NEXT: Final = {
    "applying": ("applied", "verifying"),
    "verifying": ("verified", "committing"),
    "committing": ("declared", "resuming"),
}


def _urls(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


def _set(value: Iterable[str]) -> frozenset[str]:
    return frozenset(value)


def _batches(value: Iterable[Iterable[str]]) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(b) for b in value)


def _counts_workers(frame: Frame, field: attrs.Attribute[int], value: int) -> None:
    if not 1 <= value <= len(frame.workers):
        raise ValueError(f"{field.name} {value} is not between 1 and {len(frame.workers)}")


@attrs.frozen
class Frame:
    """A transaction's fixed part: every worker in order, the policy, the quorum and the
    batch size."""

    workers: tuple[str, ...] = attrs.field(converter=_urls)
    policy: str = attrs.field(validator=attrs.validators.in_(POLICIES))
    quorum: int = attrs.field(validator=_counts_workers)
    max_unavailable: int = attrs.field(validator=_counts_workers)

    @classmethod
    def of(cls, spec: TransactionSpec) -> Frame:
        """The fixed part of ``spec`` (its quorum is ``min_workers``)."""
        return cls(spec.urls, spec.policy, spec.min_workers, spec.max_unavailable)


@attrs.frozen
class Outcome:
    """What the last step did on each of the workers it acted on.

    ``refused``: the worker answered no (a bad source, a digest that differs, a declaration
    that did not read back).  ``unreachable``: no answer in time.
    """

    ok: frozenset[str] = attrs.field(default=frozenset(), converter=_set)
    refused: frozenset[str] = attrs.field(default=frozenset(), converter=_set)
    unreachable: frozenset[str] = attrs.field(default=frozenset(), converter=_set)

    @property
    def failed(self) -> frozenset[str]:
        return self.refused | self.unreachable

    @property
    def all(self) -> frozenset[str]:
        return self.ok | self.refused | self.unreachable


@attrs.frozen
class Progress:
    """Where one transaction is.  ``active``: the workers the current phase acts on, in
    worker order; ``batches``: the rolling-update batches (set when prepared); ``batch``:
    the index of the current one; ``fenced`` and ``committed`` only ever grow."""

    phase: str
    trigger: str = "begin"
    active: tuple[str, ...] = attrs.field(default=(), converter=_urls)
    batches: tuple[tuple[str, ...], ...] = attrs.field(default=(), converter=_batches)
    batch: int = 0
    fenced: frozenset[str] = attrs.field(default=frozenset(), converter=_set)
    committed: frozenset[str] = attrs.field(default=frozenset(), converter=_set)

    @property
    def finished(self) -> bool:
        return self.phase in TERMINAL

    def touched(self) -> tuple[str, ...]:
        """Every worker an update may have reached: the batches up to the current one."""
        return tuple(u for b in self.batches[: self.batch + 1] for u in b)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "phase": self.phase,
            "trigger": self.trigger,
            "active": list(self.active),
            "batches": [list(b) for b in self.batches],
            "batch": self.batch,
            "fenced": sorted(self.fenced),
            "committed": sorted(self.committed),
        }

    @classmethod
    def from_json(cls, data: Any) -> Progress:
        """Raises ``InvalidRequest`` (``bad_journal``) for any other form or schema."""
        if not isinstance(data, Mapping) or data.get("schema") != SCHEMA:
            raise bad_journal(f"a transaction's progress is not a schema-{SCHEMA} object")
        try:
            progress = cls(
                phase=str(data["phase"]),
                trigger=str(data["trigger"]),
                active=[str(u) for u in data["active"]],
                batches=[[str(u) for u in b] for b in data["batches"]],
                batch=int(data["batch"]),
                fenced=[str(u) for u in data["fenced"]],
                committed=[str(u) for u in data["committed"]],
            )
            TransactionMachine(progress.phase)
        except (KeyError, TypeError, ValueError) as exc:
            raise bad_journal(f"a transaction's progress does not validate: {exc!r}") from None
        return progress


def start(frame: Frame) -> Progress:
    """The first step: every worker dry-runs the update."""
    return Progress("preparing", "begin", frame.workers)


def _move(progress: Progress, trigger: str, **changes: Any) -> Progress:
    phase = TransactionMachine(progress.phase).fire(trigger)
    return attrs.evolve(progress, phase=phase, trigger=trigger, **changes)


def _ordered(frame: Frame, urls: Iterable[str]) -> tuple[str, ...]:
    chosen = set(urls)
    return tuple(u for u in frame.workers if u in chosen)


def _rollback(progress: Progress) -> Progress:
    return _move(progress, "fail", active=progress.touched())


def step(frame: Frame, progress: Progress, outcome: Outcome) -> Progress:
    """The next :class:`Progress` after ``outcome`` of ``progress``'s step.

    Raises ``ValueError`` when ``outcome`` does not account for exactly the active workers
    (each once), and ``IllegalState`` from a finished transaction.
    """
    parts = (outcome.ok, outcome.refused, outcome.unreachable)
    if sum(map(len, parts)) != len(outcome.all) or outcome.all != set(progress.active):
        raise ValueError("an outcome must name each active worker exactly once")
    phase = progress.phase
    if phase == "preparing":
        if outcome.refused:
            return _move(progress, "refuse", active=())
        fenced = outcome.unreachable
        if fenced and (frame.policy != "fence" or len(outcome.ok) < frame.quorum):
            return _move(progress, "refuse", active=())
        live = [u for u in frame.workers if u not in fenced]
        k = frame.max_unavailable
        batches = tuple(tuple(live[i : i + k]) for i in range(0, len(live), k))
        return _move(progress, "prepared", active=batches[0], batches=batches, fenced=fenced)
    if phase in _NEXT:
        trigger, _ = _NEXT[phase]
        survivors = _ordered(frame, outcome.ok)
        if outcome.failed:
            fenced = progress.fenced | outcome.failed
            if frame.policy == "rollback":
                return _rollback(progress)
            untried = sum(len(b) for b in progress.batches[progress.batch + 1 :])
            reachable = len(progress.committed) + len(survivors) + untried
            if reachable < frame.quorum and not progress.committed:
                return _rollback(progress)
            progress = attrs.evolve(progress, fenced=fenced)
        committed = progress.committed | set(survivors) if phase == "committing" else progress.committed
        return _move(progress, trigger, active=survivors, committed=committed)
    if phase == "resuming":
        if progress.batch + 1 < len(progress.batches):
            nxt = progress.batch + 1
            return _move(progress, "next_batch", batch=nxt, active=progress.batches[nxt])
        return _move(progress, "resumed_fenced" if progress.fenced else "resumed", active=())
    if phase == "rolling_back":
        return _move(progress, "rollback_incomplete" if outcome.failed else "rollback_done", active=())
    TransactionMachine(phase).fire("fail")  # no row from a finished (or idle) phase: IllegalState
    raise AssertionError(phase)  # pragma: no cover - every other phase is handled above


def recover(frame: Frame, progress: Progress) -> Progress:
    """What a new coordinator does with a transaction whose coordinator died in ``progress``.

    Raises ``IllegalState`` for a finished transaction (there is nothing to recover).
    """
    phase = progress.phase
    if phase == "preparing":
        return _move(progress, "recover_abort", active=())
    if phase == "resuming":
        # Past the commit point: the batch is committed; bring all of it back onto it.
        batch = progress.batches[progress.batch]
        return _move(progress, "recover_forward", active=[u for u in batch if u in progress.committed])
    if phase in _NEXT and frame.policy == "fence" and progress.committed:
        batch = tuple(u for u in progress.batches[progress.batch] if u not in progress.fenced)
        return _move(progress, "recover_retry", active=batch)
    return _move(progress, "recover_rollback", active=progress.touched())
