"""What the trainer makes of a sample's stamps: which committed weights produced each token,
how far behind its own policy they are, and whether the sample may train it.  Pure.

The trainer knows what it committed: each push commits version ``step-k`` (``k`` optimizer
steps in) under a fleet epoch with the digest of the weights it sent, and the journal says so
(:class:`History`, read from the journal after every commit).  A sample's spans name the
version and digest of the weights that sampled each token; its reply names the epoch the
router routed it at.

Rules (``judge``):

1. A token's staleness is the trainer's step minus the step of the version that sampled it.
   A sample's staleness is its oldest token's.
2. A sample within ``max_staleness`` trains the policy, every token corrected by the
   importance ratio of the current policy over the weights that sampled *that token* (the
   rollout's own log-probability): a sample that crossed a version mid-request is corrected
   span by span.
3. A sample beyond it is dropped whole: its reward was earned in part by a policy too old to
   correct for.  So is a sample with a span naming weights the trainer never committed.

``stamp_problems`` checks every stamp against the history: the version was committed, the
span's digest (and its epoch, where the worker names one) is the one committed for it, the
label described the weights, and the epoch the router labelled the reply with is the one
committed for its first span's version.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from weightsync.rl_demo.rollouts import Sample


def _key(version: Any) -> str:
    return json.dumps(version, sort_keys=True)


@attrs.frozen
class Committed:
    """Weights the fleet committed: the trainer's ``step`` pushed as ``version``, committed
    under ``epoch`` with content digest ``digest``."""

    version: Any
    step: int
    epoch: int
    digest: str


@attrs.define
class History:
    """Every version the fleet committed during the run, by version."""

    by_version: dict[str, Committed] = attrs.field(factory=dict)

    def add(self, committed: Committed) -> None:
        self.by_version[_key(committed.version)] = committed

    def get(self, version: Any) -> Committed | None:
        return self.by_version.get(_key(version))

    def __len__(self) -> int:
        return len(self.by_version)


@attrs.frozen
class Judged:
    """A sample with the step of the version that sampled each of its tokens, its staleness
    (``None``: a span names weights never committed) and whether it trains the policy."""

    sample: Sample
    token_steps: tuple[int, ...]
    staleness: int | None
    kept: bool


def judge(samples: Iterable[Sample], history: History, step: int, max_staleness: int) -> list[Judged]:
    """Each of ``samples`` judged for a trainer whose policy is ``step`` optimizer steps in
    (see the module's rules)."""
    out = []
    for sample in samples:
        steps: list[int] = []
        for span in sample.spans:
            committed = history.get(span.version)
            if committed is None or committed.digest != span.digest:
                steps = []
                break
            steps += [committed.step] * (span.last - span.first + 1)
        if not steps:
            out.append(Judged(sample, (), None, False))
            continue
        staleness = step - min(steps)
        out.append(Judged(sample, tuple(steps), staleness, 0 <= staleness <= max_staleness))
    return out


def stamp_problems(samples: Sequence[Sample], history: History) -> list[str]:
    """What is wrong with the stamps of ``samples`` against ``history``: one line per
    problem, none when every stamp names committed (version, epoch, digest)."""
    problems = []
    for n, sample in enumerate(samples):
        if not sample.spans:
            problems.append(f"sample {n} has no version spans")
            continue
        for span in sample.spans:
            committed = history.get(span.version)
            if committed is None:
                problems.append(f"sample {n}: version {span.version!r} was never committed")
            elif span.digest != committed.digest:
                problems.append(
                    f"sample {n}: version {span.version!r} has digest {span.digest}, "
                    f"committed {committed.digest}"
                )
            elif span.epoch is not None and span.epoch != committed.epoch:
                problems.append(
                    f"sample {n}: version {span.version!r} names epoch {span.epoch}, "
                    f"committed at {committed.epoch}"
                )
            elif not (span.declared and span.current):
                problems.append(f"sample {n}: version {span.version!r}'s label did not describe its weights")
        first = history.get(sample.spans[0].version)
        if first is not None and sample.epoch != first.epoch:
            problems.append(
                f"sample {n}: routed at epoch {sample.epoch}, {first.version!r} committed at {first.epoch}"
            )
    return problems
