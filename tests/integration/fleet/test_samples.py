"""Sample certificates: completions from real workers checked against the fleet's journal
with :func:`weightsync.fleet.verify_samples`.

The workers are real loopback servers over reference engines, the journal a real SQLite
file, the samples what ``/v1/completions`` answered.  Each reason a sample is dropped is produced the
way it happens in a loop: a commit the sample predates (staleness), weights changed behind
the fleet (``uncommitted``, ``not_current``), a forged digest, a version the journal never
committed, tokens from two commits, no stamps; a rollback's re-commit is recognised, and a
peer's label-only spans (vLLM 0.33's ``weight_versions``) are matched by label.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import perturbed
from tests.workers import Worker
from weightsync.fleet import FleetCoordinator, verify_samples
from weightsync.fleet.journal import Journal
from weightsync.fleet.samples import Commit, commits_of
from weightsync.trainer import save_checkpoint, weights_digest

pytestmark = pytest.mark.slow


class Fleet:
    """Two real workers, two checkpoints each can load, and a journal."""

    def __init__(self, make_worker: Callable[..., Worker], root: Path) -> None:
        self.workers = [make_worker(), make_worker()]
        self.urls = [w.url for w in self.workers]
        old = {k: v.clone() for k, v in self.workers[0].engine.model.weights().items()}
        new = perturbed(old, seed=5)
        self.old = {w.url: str(save_checkpoint(old, w.root / "old")) for w in self.workers}
        self.new = {w.url: str(save_checkpoint(new, w.root / "new")) for w in self.workers}
        self.old_digest, self.new_digest = weights_digest(old), weights_digest(new)
        self.journal = root / "j.db"

    def update(self, source: dict[str, str], version: str, **kw: Any) -> Any:
        coordinator = FleetCoordinator(self.urls, journal=self.journal, initial_source=self.old, **kw)
        return asyncio.run(coordinator.update(source, version))

    def complete(self, i: int, **extra: Any) -> dict[str, Any]:
        return dict(self.workers[i].client.complete("hello", max_tokens=4, **extra))


@pytest.fixture
def fleet(make_worker: Callable[..., Worker], tmp_path: Path) -> Fleet:
    return Fleet(make_worker, tmp_path)


def test_samples_of_committed_weights_are_kept_and_staleness_counts_later_commits(fleet: Fleet) -> None:
    assert fleet.update(fleet.new, "v1").ok
    on_v1 = [fleet.complete(0), fleet.complete(1)]
    (span,) = on_v1[0]["choices"][0]["weight_version_spans"]
    assert (span["version"], span["epoch"], span["digest"]) == ("v1", 1, fleet.new_digest)
    report = verify_samples(on_v1, fleet.journal, max_staleness=0)
    assert report.counts["kept"] == 2 and [v.staleness for v in report.verdicts] == [0, 0]
    assert fleet.update(fleet.old, "v2").ok
    on_v2 = [fleet.complete(0), fleet.complete(1)]
    both = on_v1 + on_v2
    strict = verify_samples(both, fleet.journal, max_staleness=0)
    assert [v.kept for v in strict.verdicts] == [False, False, True, True]
    assert [v.reasons for v in strict.verdicts[:2]] == [("stale",), ("stale",)]
    assert [v.staleness for v in strict.verdicts] == [1, 1, 0, 0]
    assert verify_samples(both, fleet.journal, max_staleness=1).counts["kept"] == 4
    assert strict.keep(both) == on_v2
    assert strict.counts == {
        "samples": 4, "kept": 2, "dropped": 2, "unstamped": 0, "uncommitted": 0, "not_current": 0,
        "mixed": 0, "stale": 2, "version_only": 0,
    }  # fmt: skip
    # the caller's own step bounds staleness too: as of epoch 1, the v1 samples are current
    assert verify_samples(on_v1, fleet.journal, max_staleness=0, current_epoch=1).counts["kept"] == 2


def test_forged_unknown_and_uncommitted_weights_are_dropped(fleet: Fleet) -> None:
    assert fleet.update(fleet.new, "v1").ok
    good = fleet.complete(0)
    forged = copy.deepcopy(good)
    forged["choices"][0]["weight_version_spans"][0]["digest"] = "0" * 32
    renamed = copy.deepcopy(good)
    renamed["choices"][0]["weight_version_spans"][0]["version"] = "v9"
    # weights changed behind the fleet's back, the label kept: not what v1 committed
    worker = fleet.workers[1]
    worker.client.pause_generation(mode="wait")
    worker.client.update_weights_from_disk(model_path=fleet.old[worker.url])
    worker.client.resume_generation()
    behind = fleet.complete(1)
    (span,) = behind["choices"][0]["weight_version_spans"]
    assert span["version"] == "v1" and span["version_current"] is False and span["digest"] == fleet.old_digest
    unstamped = {"choices": [good["choices"][0], {"text": "x"}]}  # one choice without a certificate
    report = verify_samples([good, forged, renamed, behind, unstamped], fleet.journal)
    assert [v.reasons for v in report.verdicts] == [
        (), ("uncommitted",), ("uncommitted",), ("uncommitted", "not_current"), ("unstamped",),
    ]  # fmt: skip
    assert report.counts["kept"] == 1 and report.counts["uncommitted"] == 3


def test_tokens_from_two_commits_are_mixed_when_one_commit_is_asked(fleet: Fleet) -> None:
    assert fleet.update(fleet.new, "v1").ok
    first = fleet.complete(0)["choices"][0]["weight_version_spans"][0]
    assert fleet.update(fleet.old, "v2").ok
    second = fleet.complete(0)["choices"][0]["weight_version_spans"][0]
    sample = {
        "weight_version_spans": [{**first, "last_token": 1}, {**second, "first_token": 2, "last_token": 3}]
    }
    assert verify_samples([sample], fleet.journal).counts["kept"] == 1  # each span committed
    (mixed,) = verify_samples([sample], fleet.journal, one_commit=True).verdicts
    assert mixed.reasons == ("mixed",) and mixed.staleness == 1  # its oldest span is one commit behind


def test_a_rollbacks_re_commit_is_a_commit(fleet: Fleet) -> None:
    assert fleet.update(fleet.new, "v1").ok
    victim = fleet.workers[1]

    def tamper(event: Any) -> None:  # weights changed behind the control plane: verify fails
        if event.worker == victim.url and event.what == "loaded":
            with torch.no_grad():
                next(iter(victim.engine.model.parameters())).add_(1.0)

    back = fleet.update(fleet.old, "v2", on_event=tamper, live_verify=True)
    assert back.phase == "rolled_back", back.to_json()
    sample = fleet.complete(0)
    (span,) = sample["choices"][0]["weight_version_spans"]
    assert (span["version"], span["epoch"]) == ("v1", back.epoch) and back.epoch != 1
    opened = Journal(fleet.journal)
    try:
        assert Commit("v1", back.epoch, fleet.new_digest) in commits_of(opened)
    finally:
        opened.close()
    assert verify_samples([sample], fleet.journal, max_staleness=0).counts["kept"] == 1


def test_a_peers_label_only_spans_are_matched_by_label(fleet: Fleet) -> None:
    assert fleet.update(fleet.new, "v1").ok
    reply = fleet.complete(0, return_weight_versions=True)
    choice = {k: v for k, v in reply["choices"][0].items() if k != "weight_version_spans"}
    assert choice["weight_versions"] == [{"version": "v1", "start": 0, "end": 4}]
    (verdict,) = verify_samples([choice], fleet.journal).verdicts
    assert verdict.kept and verdict.version_only
    unknown = {"weight_versions": [{"version": "v0-never", "start": 0, "end": 4}]}
    assert verify_samples([unknown], fleet.journal).verdicts[0].reasons == ("uncommitted",)


def test_malformed_samples_are_verdicts_not_exceptions(fleet: Fleet) -> None:
    assert fleet.update(fleet.new, "v1").ok
    hostile: list[Any] = [
        None, 3, "x", [], {"weight_version_spans": "no"}, {"weight_version_spans": [1, None]},
        {"weight_version_spans": [{"version": {"a": [1]}, "version_declared": True, "epoch": "1"}]},
        {"choices": [None, {"weight_versions": [[]]}]}, {"meta_info": {"weight_versions": "x"}},
    ]  # fmt: skip
    report = verify_samples(hostile, fleet.journal)
    assert report.counts["kept"] == 0 and len(report.verdicts) == len(hostile)
    with pytest.raises(ValueError, match="max_staleness"):
        verify_samples([], fleet.journal, max_staleness=-1)
