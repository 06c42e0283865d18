"""`weightsync.trainer.weights_digest` equals the digest a worker reports for the same weights."""

from __future__ import annotations

import pytest

from tests.helpers import perturbed
from tests.workers import Worker
from weightsync.trainer import save_checkpoint, weights_digest

pytestmark = pytest.mark.integration


def test_trainer_digest_of_a_state_dict_equals_the_workers_after_an_update(worker: Worker) -> None:
    new = perturbed(dict(worker.engine.model.weights()), seed=3)
    assert weights_digest(new) != worker.client.get_weight_version()["digest"]
    path = save_checkpoint(new, worker.root / "step-3", version="step-3")
    worker.client.pause_generation()
    worker.client.update_weights_from_disk(str(path), weight_version="step-3")
    assert worker.client.get_weight_version()["digest"] == weights_digest(new)
    # pairs in another order are the same weights
    assert weights_digest(reversed(list(new.items()))) == weights_digest(new)
    # and one changed element is not
    changed = dict(new)
    name = next(iter(changed))
    changed[name] = changed[name].clone()
    changed[name].view(-1)[0] += 1
    assert weights_digest(changed) != weights_digest(new)
