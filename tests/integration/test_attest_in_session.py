"""``verify_weights`` with ``allow_load_digest`` while an update session is open: an update
inside the session writes the served weights, so the digest an earlier load took in place no
longer describes them; the worker hashes what it serves again (``live_weights``), which then
differs from the digest recorded before the session until the session finishes."""

from __future__ import annotations

from typing import Any

import httpx

from tests.helpers import hashes, perturbed
from tests.workers import Worker
from weightsync.core.held import weights_digest
from weightsync.trainer import save_checkpoint


def ok(worker: Worker, route: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    reply = httpx.post(f"{worker.url}/engine/{route}", json=body or {}, timeout=30)
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def load(worker: Worker, seed: int, **body: Any) -> dict[str, Any]:
    weights = perturbed(dict(worker.engine.model.weights()), seed=seed)
    path = save_checkpoint(weights, worker.root / f"ckpt-{seed}")
    return ok(worker, "update_weights_from_disk", {"model_path": str(path), **body})


def test_a_session_update_after_an_in_place_load_is_not_attested_by_the_old_digest(worker: Worker) -> None:
    ok(worker, "pause_generation")
    first = load(worker, seed=1)["digest"]
    assert ok(worker, "verify_weights", {"allow_load_digest": True})["scope"] == "load_in_place"
    ok(worker, "begin_weight_update")
    load(worker, seed=2, session=True)  # the served weights change now, before the finish
    served = weights_digest(hashes(worker.engine))
    assert served != first
    verified = ok(worker, "verify_weights", {"allow_load_digest": True})
    assert (verified["scope"], verified["digest"], verified["match"]) == ("live_weights", served, False)
    ok(worker, "end_weight_update")
    after = ok(worker, "verify_weights", {"allow_load_digest": True})
    assert (after["scope"], after["digest"], after["match"]) == ("live_weights", served, True)
