"""Hostile shared-memory handles: every one a 4xx refusal before any write, never a torn or
dead worker.  Real POSIX segments (``/dev/shm``), real servers, a real ``weightsync serve``."""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import WorkerProcess, hashes, perturbed
from tests.workers import Worker
from weightsync.core import errors
from weightsync.core.requests import UpdateRequest
from weightsync.engines.reference import ModelConfig, ReferenceEngine
from weightsync.trainer import WorkerClient, share_tensors
from weightsync.transports.hashing import tensor_hash, tensor_hashes
from weightsync.transports.loading import load
from weightsync.transports.sink import PullTarget, TensorSink, pull, weight_info
from weightsync.transports.tensor import shm as shm_mod
from weightsync.transports.tensor.shm import SharedReader

SHM = Path("/dev/shm")


def pulled(source: Any, weights: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """The shared-memory reader as a pulling engine (vLLM) uses it: validate, then pull."""
    reader = SharedReader(source)
    reader.validate(weight_info(weights.items()).by_name())
    target = PullTarget()
    return pull(reader.stream(target), target)


@pytest.fixture
def planted() -> Iterator[list[Path]]:
    """Files the test plants under /dev/shm, removed afterwards."""
    paths: list[Path] = []
    yield paths
    for p in paths:
        p.unlink(missing_ok=True)


def _refused(worker: Worker, tensors: list[dict[str, Any]], status: int, code: str) -> None:
    before, state = hashes(worker.engine), worker.client.get_weight_version()
    with pytest.raises(errors.WeightSyncError) as err:
        worker.client.update_weights_from_tensor(tensors, weight_version="hostile")
    assert (err.value.http_status, err.value.code) == (status, code), err.value
    after = worker.client.get_weight_version()
    assert not after["torn"] and after == state
    assert hashes(worker.engine) == before


def _source(tensors: list[dict[str, Any]]) -> Any:
    return UpdateRequest.from_tensor_body({"tensors": tensors}).source


def test_hostile_segments_are_refused_with_4xx_and_change_nothing(
    worker: Worker, planted: list[Path]
) -> None:
    worker.client.pause_generation()
    new = perturbed(worker.engine.model.weights(), seed=21)
    empty = SHM / f"weightsync_empty_{secrets.token_hex(4)}"
    fifo = SHM / f"weightsync_fifo_{secrets.token_hex(4)}"
    planted += [empty, fifo]
    empty.touch()
    os.mkfifo(fifo)
    with share_tensors(new) as shared:
        first = shared.tensors[0]

        def at(name: str, offset: int = 0) -> dict[str, Any]:
            return {**first, "handle": {"shm": name, "offset": offset}}

        _refused(worker, [at("weightsync_a/../b")], 400, "invalid_value")
        _refused(worker, [at("weightsync_" + "x" * 300)], 400, "invalid_value")
        _refused(worker, [at(empty.name)], 400, "invalid_segment")
        _refused(worker, [at(fifo.name)], 400, "invalid_segment")  # and does not block
        _refused(worker, [at("weightsync_missing")], 404, "segment_not_found")
        _refused(worker, [at(shared.shm.name, shared.shm.size - 1)], 400, "invalid_value")
        _refused(worker, [at(shared.shm.name, 2**70)], 400, "invalid_value")
        for dtype in ("float8_e4m3fnuz", "float8_e5m2fnuz"):  # parsed, then a KeyError in the old table
            _refused(worker, [{**first, "dtype": dtype}], 400, "dtype_mismatch")
        # a bad handle anywhere refuses the whole update, nothing of the good ones is written
        _refused(worker, [*shared.tensors[:-1], {**shared.tensors[-1], "handle": {"shm": empty.name, "offset": 0}}],
                 400, "invalid_segment")  # fmt: skip
        worker.client.update_weights_from_tensor(shared.tensors, weight_version="after")  # still healthy
    assert hashes(worker.engine) == tensor_hashes(new.items())


def test_the_pull_path_validates_every_handle_before_the_first_tensor(planted: list[Path]) -> None:
    weights = ReferenceEngine(ModelConfig.tiny()).model.weights()
    empty = SHM / f"weightsync_empty_{secrets.token_hex(4)}"
    planted.append(empty)
    empty.touch()
    with share_tensors(weights) as shared:
        good = shared.tensors
        cases: list[tuple[dict[str, Any], type[errors.WeightSyncError], str]] = [
            ({"shm": "weightsync_missing", "offset": 0}, errors.NotFound, "segment_not_found"),
            ({"shm": empty.name, "offset": 0}, errors.InvalidRequest, "invalid_segment"),
            ({"shm": "weightsync_/etc/passwd", "offset": 0}, errors.InvalidRequest, "invalid_value"),
            ({"shm": shared.shm.name, "offset": shared.shm.size}, errors.InvalidRequest, "invalid_value"),
        ]
        for handle, cls, code in cases:
            tensors = [*good[:-1], {**good[-1], "handle": handle}]
            with pytest.raises(cls) as err:  # raised by the call itself: no tensor was handed out
                pulled(_source(tensors), weights)
            assert err.value.code == code
        got = dict(pulled(_source(good), weights))
    assert tensor_hashes(got.items()) == tensor_hashes(weights.items())


def test_unexpected_validation_errors_become_a_4xx_refusal_that_wrote_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    weights = ReferenceEngine(ModelConfig.tiny()).model.weights()
    sink = TensorSink({n: t.clone() for n, t in weights.items()})

    def broken_table(dtype: str) -> int:
        raise KeyError(dtype)

    monkeypatch.setattr(shm_mod, "itemsize", broken_table)
    with share_tensors(perturbed(weights, seed=3)) as shared:
        with pytest.raises(errors.LoadFailed) as err:
            load(SharedReader(_source(shared.tensors)), sink)
        assert not err.value.wrote and not sink.wrote
        assert isinstance(err.value.cause, errors.InvalidRequest) and err.value.code == "invalid_handle"
        with pytest.raises(errors.InvalidRequest):
            pulled(_source(shared.tensors), weights)


def test_fnuz_float8_tensors_load_and_are_hashed() -> None:
    targets = {
        "a": torch.zeros(4, 8, dtype=torch.float8_e4m3fnuz),
        "b": torch.zeros(16, dtype=torch.float8_e5m2fnuz),
    }
    new = {
        "a": torch.randn(4, 8).to(torch.float8_e4m3fnuz),
        "b": torch.randn(16).to(torch.float8_e5m2fnuz),
    }
    sink = TensorSink(targets)
    with share_tensors(new) as shared:
        load(SharedReader(_source(shared.tensors)), sink)
    for name, t in new.items():
        assert torch.equal(targets[name].view(torch.uint8), t.view(torch.uint8))
        assert sink.hashes[name] == tensor_hash(t)


def _fds_to(pid: int, name: str) -> bool:
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        for fd in fd_dir.iterdir():
            try:
                if os.readlink(fd).endswith("/" + name):
                    return True
            except OSError:
                continue
    except OSError:
        pass
    return False


@pytest.mark.slow
def test_a_segment_shrunk_during_the_copy_is_a_clean_failure_not_sigbus() -> None:
    worker = WorkerProcess(model_config="default").wait_ready()
    client = WorkerClient(worker.url)
    try:
        client.set_weight_version("before")
        client.pause_generation()
        weights = perturbed(ReferenceEngine(ModelConfig()).model.weights(), seed=5)
        outcomes: list[str] = []
        for _ in range(3):
            # one segment per tensor: the worker opens them all, then copies in order; the last
            # one is shrunk as soon as the worker holds it open, i.e. while it copies the others
            shared = [share_tensors({n: t}) for n, t in weights.items()]
            last = shared[-1].shm.name

            def shrink(last: str = last) -> None:
                deadline = time.monotonic() + 30
                while not _fds_to(worker.proc.pid, last) and time.monotonic() < deadline:
                    pass
                fd = os.open(SHM / last, os.O_RDWR)
                os.ftruncate(fd, 0)
                os.close(fd)

            shrinker = threading.Thread(target=shrink)
            shrinker.start()
            try:
                client.update_weights_from_tensor(
                    [t for s in shared for t in s.tensors], weight_version="shrunk"
                )
                outcomes.append("committed")
            except errors.WeightSyncError as exc:
                outcomes.append("segment_shrunk" if "shrank" in exc.message else exc.code)
            shrinker.join()
            for s in shared:
                s.close()
            assert worker.proc.poll() is None, f"worker died: {worker.proc.returncode}"
            assert client.liveness_probe()["alive"]
            state = client.get_weight_version()
            assert state["version"] == "before"
            if outcomes[-1] == "segment_shrunk":
                assert state["torn"]  # honestly: the tensors copied before the shrink were written
                break
            assert outcomes[-1] == "invalid_value" and not state["torn"]  # shrunk before the bounds check
        assert outcomes[-1] == "segment_shrunk", outcomes
        healed = perturbed(weights, seed=6)
        with share_tensors(healed) as good:
            client.update_weights_from_tensor(good.tensors, weight_version="healed")
        assert client.engine_rpc("weight_hashes")["result"] == tensor_hashes(healed.items())
    finally:
        client.close()
        worker.stop()


def test_a_dtype_mismatch_suggests_allow_dtype_cast_only_on_the_route_that_has_it(worker: Worker) -> None:
    from safetensors.torch import save_file

    worker.client.pause_generation()
    halves = {n: t.half() for n, t in worker.engine.model.weights().items()}
    with share_tensors(halves) as shared, pytest.raises(errors.InvalidRequest) as tensor_err:
        worker.client.update_weights_from_tensor(shared.tensors, weight_version="halves")
    assert tensor_err.value.code == "dtype_mismatch" and "allow_dtype_cast" not in tensor_err.value.message
    save_file(halves, str(worker.root / "model.safetensors"))
    with pytest.raises(errors.InvalidRequest) as disk_err:
        worker.client.update_weights_from_disk(str(worker.root), weight_version="halves")
    assert disk_err.value.code == "dtype_mismatch" and "pass allow_dtype_cast=true" in disk_err.value.message
