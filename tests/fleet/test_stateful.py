"""Hypothesis drives the coordinator against fake workers with injected faults.

After every transaction (and every recovery) the workers that serve requests agree on
version, epoch and digest, and a refused prepare changed nothing anywhere.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.fleet.fakes import FakeFleet, checkpoint
from weightsync.core.digest import weights_digest
from weightsync.fleet import Event, FleetCoordinator, Journal

PATHS = [f"/ckpt/{i}" for i in range(3)]
N = 3
FAULTS = ("none", "refuse_prepare", "crash_on_apply", "hang_on_apply", "tamper_on_apply", "corrupt")


class Crash(BaseException):
    pass


class FleetMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.TemporaryDirectory()
        self.journal_path = Path(self.dir.name) / "fleet.db"
        self.fleet = FakeFleet(N, {p: checkpoint(i) for i, p in enumerate(PATHS)}, PATHS[0])
        self.step = 0
        self.crashed = False
        self.txn_workers: list[str] = []
        self.last_committed: tuple[Any, int | None, str] = ("v0", None, weights_digest(checkpoint(0)))

    def teardown(self) -> None:
        self.dir.cleanup()

    def alive(self) -> list[str]:
        return [u for u, w in self.fleet.workers.items() if not w.dead]

    def coordinator(self, urls: list[str], **kw: Any) -> FleetCoordinator:
        return FleetCoordinator(
            urls,
            journal=Journal(self.journal_path, synchronous="NORMAL"),
            transport=self.fleet.transport,
            initial_source=PATHS[0],
            backoff_s=0.001,
            cleanup_s=0.5,
            **kw,
        )

    @precondition(lambda self: not self.crashed and len(self.alive()) >= 1)
    @rule(
        path=st.sampled_from(PATHS),
        fault=st.sampled_from(FAULTS),
        victim=st.integers(0, N - 1),
        policy=st.sampled_from(["rollback", "fence"]),
        crash_phase=st.sampled_from([None, "applying", "verifying", "committing", "rolling_back"]),
    )
    def transaction(self, path: str, fault: str, victim: int, policy: str, crash_phase: str | None) -> None:
        self.step += 1
        workers = [self.fleet.workers[u] for u in self.alive()]
        target = workers[victim % len(workers)]
        paths: Any = path
        if fault == "corrupt":
            paths = {w.url: path for w in workers} | {target.url: "/ckpt/corrupt"}
        elif fault != "none":
            setattr(target, fault, True)
        before = [w.snapshot() for w in workers]

        def hook(event: Event) -> None:
            if crash_phase is not None and event.phase == crash_phase and event.worker is None:
                raise Crash

        version = f"v{self.step}"
        self.txn_workers = [w.url for w in workers]
        try:
            result = self.coordinator([w.url for w in workers], on_event=hook).update_sync(
                paths, version, policy=policy, min_workers=max(1, len(workers) - 1), deadline_s=1.0
            )
        except Crash:
            self.crashed = True
            return
        finally:
            target.hang_on_apply = target.refuse_prepare = target.tamper_on_apply = False
        if result.phase == "aborted":
            assert [w.snapshot() for w in workers] == before, "a refused prepare changed something"
        assert result.phase in ("committed", "fenced", "rolled_back", "aborted")
        for outcome in result.workers:  # each worker is where the result says it is
            w = self.fleet.workers[outcome.url]
            old = before[workers.index(w)]
            if outcome.outcome == "committed":
                assert (w.version, w.paused, w.dead) == (version, False, False), outcome
            elif outcome.outcome in ("rolled_back", "unchanged"):  # back as it was, serving if it was
                assert (w.version, w.epoch, w.paused, w.digest) == (old[0], old[2], old[3], old[5]), outcome
        if result.phase in ("committed", "fenced"):
            self.last_committed = (version, result.epoch, weights_digest(checkpoint(PATHS.index(path))))

    @precondition(lambda self: not self.crashed and len(self.alive()) < N)
    @rule(data=st.data())
    def restart_a_crashed_worker(self, data: st.DataObject) -> None:
        dead = [w for w in self.fleet.workers.values() if w.dead]
        worker = data.draw(st.sampled_from(dead))
        worker.dead = worker.crash_on_apply = False  # back up, still torn from the crash

    @precondition(lambda self: self.crashed)
    @rule()
    def recover(self) -> None:
        # recovery speaks to the transaction's workers, dead ones included
        result = self.coordinator(self.txn_workers).recover_sync()
        self.crashed = False
        if result is not None and result.phase == "committed":
            spec_digest = result.expected_digest
            assert spec_digest is not None
            self.last_committed = (result.version, result.epoch, spec_digest)

    @invariant()
    def serving_workers_agree_on_version_epoch_and_digest(self) -> None:
        if self.crashed:
            return
        serving = {(w.version, w.epoch, w.digest) for w in self.fleet.serving()}
        assert len(serving) <= 1, serving
        if serving:
            version, epoch, digest = serving.pop()
            assert not any(w.torn for w in self.fleet.serving())
            assert (version, digest) == (self.last_committed[0], self.last_committed[2])
            assert epoch == self.last_committed[1] or self.last_committed[1] is None


FleetMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=6, deadline=None)
TestFleetTransactions = FleetMachine.TestCase
