"""Fleet: one call to many real workers, one error naming each failure."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.helpers import perturbed
from tests.workers import Worker
from weightsync.trainer import Fleet, FleetError, save_checkpoint


def test_fleet_updates_every_worker_and_names_each_failure(make_worker: Callable[..., Worker]) -> None:
    workers = [make_worker() for _ in range(3)]
    fleet = Fleet([w.url for w in workers])
    assert all(r["version_declared"] is False for r in fleet.get_weight_version().values())
    fleet.pause_generation("wait")
    paths = [save_checkpoint(perturbed(w.engine.model.weights(), seed=4), w.root / "c") for w in workers]
    assert len({str(p.parent) for p in paths}) == 3  # each worker only reads its own allowed root
    replies = [
        Fleet([w.url]).update_weights_from_disk(str(p), weight_version="s1")[w.url]
        for w, p in zip(workers, paths, strict=True)
    ]
    assert all(r["version"] == "s1" for r in replies)
    # one worker cannot read the path (outside its allowed root): one error names it, the others committed
    with pytest.raises(FleetError) as err:
        fleet.update_weights_from_disk(str(paths[0]), weight_version="s2")
    assert set(err.value.failures) == {workers[1].url, workers[2].url}
    assert {e.code for e in err.value.failures.values()} == {"path_not_allowed"}
    assert list(err.value.replies) == [workers[0].url]
    fleet.resume_generation()
    versions = {url: r["version"] for url, r in fleet.get_weight_version().items()}
    assert versions == {workers[0].url: "s2", workers[1].url: "s1", workers[2].url: "s1"}
