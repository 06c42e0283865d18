"""The RL demo's figures: one row per step, the run's summary, the table and plot it prints
and the JSON object ``--json`` prints.  Pure."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any, Final

import attrs

from weightsync.rl_demo.rollouts import Sample
from weightsync.rl_demo.staleness import History, stamp_problems

EDGE_STEPS: Final = 3
"""The initial and final reward are the means over this many steps at each end of the run."""
RISE: Final = 0.2
"""How much the final reward must exceed the initial one for the run to count as learning."""
HEADER: Final = (
    f"{'step':>4}  {'reward':>6}  {'used':>4}  {'dropped':>7}  {'crossed':>7}  {'versions':<17}  {'s':>5}"
)


@attrs.frozen
class StepRow:
    """One training step: the mean reward of the samples it received, how many trained the
    policy and how many were dropped as too stale, how many crossed a version mid-request,
    the versions their tokens came from, the version it committed (``None``: nothing to learn,
    no push), its loss, the log-probability gaps of :class:`~.grpo.UpdateFigures`, and the
    seconds it spent waiting for rollouts, training, and pushing (until the router routed the
    new weights)."""

    step: int
    reward: float
    used: int
    dropped: int
    crossed: int
    versions: tuple[str, ...]
    pushed: str | None
    loss: float
    fresh_gap: float | None
    stale_gap: float | None
    split: tuple[float, float, float]

    @property
    def seconds(self) -> float:
        return sum(self.split)

    def to_json(self) -> dict[str, Any]:
        out = attrs.asdict(self, filter=lambda field, _: field.name != "split")
        rollout, train, push = (round(s, 3) for s in self.split)
        return {
            **out,
            "seconds": round(self.seconds, 3),
            "rollout_s": rollout,
            "train_s": train,
            "push_s": push,
        }

    def line(self) -> str:
        versions = ",".join(v.removeprefix("step-") for v in self.versions)
        return (
            f"{self.step:>4}  {self.reward:>6.3f}  {self.used:>4}  {self.dropped:>7}  {self.crossed:>7}  "
            f"{'step-' + versions:<17}  {self.seconds:>5.2f}"
        )


@attrs.frozen
class Summary:
    """The run: its rows, what the fleet committed, the workers that served rollouts, the
    stamps checked and what was wrong with them, and its seconds.  ``labels``: each distinct
    (version, epoch, digest) a reply was labelled with (its first span's version and digest,
    the epoch the router routed it at); ``spans``: each distinct (version, epoch, digest) of a
    span (its epoch ``None`` where the worker names none)."""

    rows: tuple[StepRow, ...]
    history: History
    workers: tuple[str, ...]
    stamps: int
    problems: tuple[str, ...]
    labels: tuple[tuple[Any, int | None, str | None], ...]
    spans: tuple[tuple[Any, int | None, str | None], ...]
    seconds: float

    @property
    def initial_reward(self) -> float:
        return statistics.fmean(r.reward for r in self.rows[:EDGE_STEPS])

    @property
    def final_reward(self) -> float:
        return statistics.fmean(r.reward for r in self.rows[-EDGE_STEPS:])

    @property
    def reward_rose(self) -> bool:
        return self.final_reward >= self.initial_reward + RISE

    def to_json(self) -> dict[str, Any]:
        rows = [r.to_json() for r in self.rows]
        committed = sorted(self.history.by_version.values(), key=lambda c: c.step)
        return {
            "steps": rows,
            "rewards": [r.reward for r in self.rows],
            "initial_reward": self.initial_reward,
            "final_reward": self.final_reward,
            "reward_rose": self.reward_rose,
            "samples": sum(r.used + r.dropped for r in self.rows),
            "used": sum(r.used for r in self.rows),
            "dropped": sum(r.dropped for r in self.rows),
            "crossed": sum(r.crossed for r in self.rows),
            "workers": list(self.workers),
            "committed": [attrs.asdict(c) for c in committed],
            "labels": [{"version": v, "epoch": e, "digest": d} for v, e, d in self.labels],
            "spans": [{"version": v, "epoch": e, "digest": d} for v, e, d in self.spans],
            "stamps_checked": self.stamps,
            "stamp_problems": list(self.problems[:20]),
            "every_stamp_committed": self.stamps > 0 and not self.problems,
            "seconds": round(self.seconds, 2),
        }


@attrs.define
class Ledger:
    """The run so far: its rows, and every sample's stamps checked as they arrive."""

    rows: list[StepRow] = attrs.field(factory=list)
    problems: list[str] = attrs.field(factory=list)
    workers: set[str] = attrs.field(factory=set)
    labels: set[tuple[Any, int | None, str | None]] = attrs.field(factory=set)
    spans: set[tuple[Any, int | None, str | None]] = attrs.field(factory=set)
    stamps: int = 0

    def check(self, samples: Sequence[Sample], history: History) -> None:
        """Check the stamps of ``samples`` against ``history`` and note what they named."""
        self.problems += stamp_problems(samples, history)
        self.stamps += sum(len(s.spans) for s in samples)
        self.workers |= {s.worker for s in samples}
        self.labels |= {(s.spans[0].version, s.epoch, s.spans[0].digest) for s in samples if s.spans}
        self.spans |= {(span.version, span.epoch, span.digest) for s in samples for span in s.spans}

    def summary(self, history: History, seconds: float) -> Summary:
        return Summary(
            tuple(self.rows),
            history,
            tuple(sorted(self.workers)),
            self.stamps,
            tuple(self.problems),
            tuple(sorted(self.labels, key=repr)),
            tuple(sorted(self.spans, key=repr)),
            seconds,
        )


def plot(rewards: Sequence[float], width: int = 40) -> list[str]:
    """``rewards`` (each in [0, 1]) as one bar per step."""
    return [f"{n:>4} {'#' * round(r * width):<{width}} {r:.2f}" for n, r in enumerate(rewards, start=1)]


def closing_lines(summary: Summary) -> list[str]:
    """What the demo says at the end, under the table."""
    s = summary
    verdict = "rose" if s.reward_rose else f"did NOT rise by {RISE}"
    stamps = (
        f"all {s.stamps} version stamps named weights the fleet committed (version, epoch, digest)"
        if not s.problems
        else f"{len(s.problems)} stamp problem(s), first: {s.problems[0]}"
    )
    figures = s.to_json()
    return [
        "",
        "mean reward per step:",
        *plot(figures["rewards"]),
        "",
        f"reward {verdict}: {s.initial_reward:.3f} over the first {EDGE_STEPS} steps, "
        f"{s.final_reward:.3f} over the last {EDGE_STEPS}",
        f"{figures['used']} samples trained the policy, {figures['dropped']} were dropped as too stale, "
        f"{figures['crossed']} crossed a version mid-request; rollouts came from {len(s.workers)} workers "
        f"through the router; {len(s.history)} versions committed",
        stamps,
        f"{s.seconds:.1f} s in all",
    ]
