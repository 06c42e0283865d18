"""Tensor transport through real POSIX shared memory, into a live worker."""

from __future__ import annotations

from multiprocessing import shared_memory
from typing import Any

import pytest

from tests.helpers import hashes, perturbed
from tests.workers import Worker
from weightsync.core import errors
from weightsync.trainer import share_tensors
from weightsync.transports.hashing import tensor_hashes


def test_shared_tensors_update_the_worker_bit_for_bit(worker: Worker) -> None:
    new = perturbed(worker.engine.model.weights(), seed=8)
    worker.client.pause_generation()
    with share_tensors(new) as shared:
        reply = worker.client.update_weights_from_tensor(shared.tensors, weight_version="shm-1")
    assert reply["version"] == "shm-1" and reply["stats"]["tensors"] == len(new)
    assert hashes(worker.engine) == tensor_hashes(new.items())
    worker.client.resume_generation()
    assert worker.client.complete("x", max_tokens=2)["weight_version"] == "shm-1"


def test_a_subset_may_be_shared(worker: Worker) -> None:
    weights = worker.engine.model.weights()
    before = hashes(worker.engine)
    new = perturbed({"model.norm.weight": weights["model.norm.weight"]}, seed=9)
    worker.client.pause_generation()
    with share_tensors(new) as shared:
        worker.client.update_weights_from_tensor(shared.tensors)
    after = hashes(worker.engine)
    assert [n for n in after if after[n] != before[n]] == ["model.norm.weight"]


def _bad(worker: Worker, tensors: list[dict[str, Any]], cls: type[errors.WeightSyncError], code: str) -> None:
    before, state = hashes(worker.engine), worker.client.get_weight_version()
    with pytest.raises(cls) as err:
        worker.client.update_weights_from_tensor(tensors, weight_version="bad")
    assert err.value.code == code
    assert hashes(worker.engine) == before and worker.client.get_weight_version() == state


def test_bad_handles_change_nothing(worker: Worker) -> None:
    worker.client.pause_generation()
    new = perturbed(worker.engine.model.weights(), seed=10)
    with share_tensors(new) as shared:
        good = shared.tensors
        first = good[0]
        _bad(
            worker,
            [{**first, "handle": {"shm": "psm_not_ours", "offset": 0}}],
            errors.InvalidRequest,
            "invalid_value",
        )
        _bad(
            worker,
            [{**first, "handle": {"shm": "weightsync_gone", "offset": 0}}],
            errors.NotFound,
            "segment_not_found",
        )
        _bad(worker, [{**first, "handle": {"shm": shared.shm.name, "offset": shared.shm.size}}],
             errors.InvalidRequest, "invalid_value")  # fmt: skip
        _bad(worker, [{**first, "shape": [1, 2, 3]}], errors.InvalidRequest, "shape_mismatch")
        _bad(worker, [{**first, "name": "model.nope"}], errors.InvalidRequest, "unknown_tensor")
        _bad(worker, [*good[:-1], {**good[-1], "handle": {"shm": "weightsync_gone", "offset": 0}}],
             errors.NotFound, "segment_not_found")  # fmt: skip
        _bad(worker, [{**first, "handle": {"cuda_ipc": "AAAA"}}], errors.NotSupported, "not_supported")


def test_the_trainer_owns_the_segment(worker: Worker) -> None:
    worker.client.pause_generation()
    shared = share_tensors(perturbed(worker.engine.model.weights(), seed=11))
    worker.client.update_weights_from_tensor(shared.tensors)
    name = shared.shm.name
    shared_memory.SharedMemory(name=name).close()  # still there after the worker read it
    shared.close()
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=name)
