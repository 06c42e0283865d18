"""A hypothesis state machine that runs the fleet decider against a model of N workers.

No HTTP, no journal: each rule draws what every active worker did in the current step
(bounded by what the model says it could do: a worker whose weights are not the new ones
cannot verify), applies the step's effects to the model as the driver would, and asks the
decider what comes next.  The invariants are the commit protocol's promises.
``machine_for(step)`` builds the machine over any decider, so a test can prove it fails on
a broken one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from weightsync.fleet import _decide
from weightsync.fleet._decide import Frame, Outcome, Progress

Step = Callable[[Frame, Progress, Outcome], Progress]
KINDS = ("ok", "refused", "unreachable")


@attrs.define
class Model:
    weights: str = "old"  # old | new | torn
    label: str = "old"  # the version it declares
    serving: bool = True


def machine_for(step: Step, recover: Callable[[Frame, Progress], Progress] = _decide.recover) -> type:
    class DeciderMachine(RuleBasedStateMachine):
        frame: Frame
        progress: Progress

        @initialize(
            n=st.integers(1, 4),
            policy=st.sampled_from(("rollback", "fence")),
            data=st.data(),
        )
        def setup(self, n: int, policy: str, data: Any) -> None:
            workers = [f"w{i}" for i in range(n)]
            quorum = data.draw(st.integers(1, n), label="quorum")
            k = data.draw(st.integers(1, n), label="max_unavailable")
            self.frame = Frame(workers, policy, quorum, k)
            self.progress = _decide.start(self.frame)
            self.model = {u: Model() for u in workers}
            self.steps = 0
            self.ever_failed = False
            self.touched: set[str] = set()

        def _draw(self, data: Any, can_ok: Callable[[str], bool]) -> Outcome:
            kinds: dict[str, set[str]] = {k: set() for k in KINDS}
            smooth = data.draw(st.booleans(), label="no faults this step")  # reach the late phases often
            for url in self.progress.active:
                if smooth and can_ok(url):
                    kinds["ok"].add(url)
                    continue
                options = KINDS if can_ok(url) else KINDS[1:]
                kinds[data.draw(st.sampled_from(options), label=url)].add(url)
            return Outcome(kinds["ok"], kinds["refused"], kinds["unreachable"])

        @precondition(lambda self: not self.progress.finished)
        @rule(data=st.data())
        def run_step(self, data: Any) -> None:
            phase, m = self.progress.phase, self.model
            if phase == "preparing":
                outcome = self._draw(data, lambda u: True)
                for url in outcome.unreachable:
                    m[url].serving = False  # down
            elif phase == "applying":
                outcome = self._draw(data, lambda u: True)
                for url in self.progress.active:
                    self.touched.add(url)
                    m[url].serving = False
                    m[url].weights = (
                        "new" if url in outcome.ok else data.draw(st.sampled_from(("old", "new", "torn")))
                    )
            elif phase == "verifying":
                outcome = self._draw(data, lambda u: m[u].weights == "new")
            elif phase == "committing":
                outcome = self._draw(data, lambda u: m[u].weights == "new")
                for url in self.progress.active:
                    if url in outcome.ok or (m[url].weights == "new" and data.draw(st.booleans())):
                        m[url].label = "new"  # a declare may land though its read-back failed
            elif phase == "resuming":
                outcome = Outcome(ok=self.progress.active)
                for url in self.progress.active:
                    assert m[url].label == m[url].weights == "new", (url, m[url])
                    m[url].serving = True
            else:  # rolling_back: each restore works or leaves the worker paused
                outcome = self._draw(data, lambda u: True)
                for url in self.progress.active:
                    if url in outcome.ok:
                        m[url] = Model("old", "old", True)
                    else:
                        m[url].serving = False
            self.ever_failed |= bool(outcome.failed)
            self.progress = step(self.frame, self.progress, outcome)
            self.steps += 1

        @precondition(lambda self: self.progress.finished)
        @rule()
        def finished(self) -> None:
            """Nothing moves a finished transaction (the invariants keep checking it)."""

        @precondition(lambda self: not self.progress.finished)
        @rule(data=st.data())
        def coordinator_dies(self, data: Any) -> None:
            if data.draw(st.booleans(), label="die"):
                self.progress = recover(self.frame, self.progress)

        @invariant()
        def a_serving_worker_holds_what_its_label_says(self) -> None:
            for url, w in getattr(self, "model", {}).items():
                if w.serving:
                    assert w.label == w.weights, (url, w, self.progress)

        @invariant()
        def fenced_and_committed_are_disjoint_workers(self) -> None:
            if hasattr(self, "progress"):
                p = self.progress
                assert not (p.fenced & p.committed) and set(p.active) <= set(self.frame.workers)

        @invariant()
        def a_finished_transaction_says_where_the_fleet_is(self) -> None:
            if not hasattr(self, "progress") or not self.progress.finished:
                return
            p, m = self.progress, self.model
            serving = {u for u, w in m.items() if w.serving}
            if p.phase == "aborted":
                assert not self.touched and all(w.weights == w.label == "old" for w in m.values())
            elif p.phase == "committed":
                assert serving == set(self.frame.workers) == p.committed
                assert all(w.weights == "new" for w in m.values())
            elif p.phase == "fenced":
                assert self.frame.policy == "fence"
                assert {u for u in serving if m[u].label == "new"} == p.committed
                if self.frame.max_unavailable == len(self.frame.workers):
                    assert len(p.committed) >= self.frame.quorum
                    assert all(m[u].label == "new" for u in serving)
            elif p.phase == "rolled_back":  # the phase names what happened: every worker is back
                assert all(w.label == w.weights == "old" for w in m.values()), m
            elif p.phase == "rollback_failed":
                # a worker the rollback could not restore stays paused, whatever it holds
                assert all(m[u].label == m[u].weights == "old" for u in serving)

        @invariant()
        def rollback_policy_commits_only_when_nothing_failed(self) -> None:
            if (
                hasattr(self, "progress")
                and self.frame.policy == "rollback"
                and self.progress.phase == "committed"
            ):
                assert not self.ever_failed

        @invariant()
        def a_committed_worker_declared_the_new_weights(self) -> None:
            rolling = ("rolling_back", "rolled_back", "rollback_failed")
            if hasattr(self, "progress") and self.progress.phase not in rolling:
                for url in self.progress.committed:
                    assert self.model[url].label == self.model[url].weights == "new", url

        @invariant()
        def every_transaction_ends(self) -> None:
            if hasattr(self, "steps"):
                assert self.steps <= 4 * len(self.frame.workers) * 2 + 8

    return DeciderMachine
