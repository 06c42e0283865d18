"""A foreign trainer that lies about its sizes on a bare stream, against a real ``weightsync
serve`` process over a real gloo group: more bytes than declared (gloo aborts whoever posted
the receive: here the worker's helper process, never the worker), fewer bytes, and a
different dtype than declared.  The worker survives, answers with a code, keeps its weights
(or is torn, if the lie came after the first tensor), and then takes a good update."""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests
import torch
import torch.distributed as dist

from tests.helpers import TINY, WorkerProcess, free_port, perturbed
from weightsync.engines.reference import ReferenceEngine
from weightsync.transports.distributed.group import Group, create_group
from weightsync.transports.hashing import tensor_hash, tensor_hashes

pytestmark = [pytest.mark.hostile, pytest.mark.slow]

GROUP = "foreign"


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    w = WorkerProcess()
    try:
        yield w.wait_ready()
    finally:
        w.stop()


def post(
    w: WorkerProcess, route: str, body: dict[str, Any] | None = None, timeout: float = 60
) -> requests.Response:
    return requests.post(f"{w.url}/engine/{route}", json=body or {}, timeout=timeout)


def state(w: WorkerProcess) -> dict[str, Any]:
    return post(w, "get_weight_version").json()


def served_hashes(w: WorkerProcess) -> dict[str, str]:
    return post(w, "engine_rpc", {"method": "weight_hashes"}).json()["result"]


def join(w: WorkerProcess, receiver: str = "process") -> Group:
    """Host a gloo group as the trainer (rank 0) and have the worker join it as rank 1."""
    port = free_port()
    store = dist.TCPStore(
        "127.0.0.1", port, None, True, datetime.timedelta(seconds=60), wait_for_workers=False
    )
    with ThreadPoolExecutor(1) as pool:
        trainer = pool.submit(
            create_group, GROUP, master_address="127.0.0.1", master_port=port, rank=0,
            world_size=2, backend="gloo", timeout_s=60, store=store,
        )  # fmt: skip
        r = post(w, "init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": GROUP, "backend": "gloo", "timeout_s": 30, "receiver": receiver,
        }, timeout=180)  # fmt: skip
        assert r.status_code == 200, r.text
        return trainer.result(timeout=60)


def metadata(weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {
        "names": list(weights),
        "dtypes": [str(t.dtype).removeprefix("torch.") for t in weights.values()],
        "shapes": [list(t.shape) for t in weights.values()],
        "group_name": GROUP,
    }


def push(w: WorkerProcess, group: Group, body: dict[str, Any], sent: list[torch.Tensor]) -> requests.Response:
    """Post the update and broadcast ``sent`` (what the trainer really sends), one by one."""
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(post, w, "update_weights_from_distributed", body, 120)
        for t in sent:
            group.wait(group.broadcast(t.contiguous()))
        return reply.result(timeout=120)


def good_update(w: WorkerProcess, seed: int, version: str) -> dict[str, torch.Tensor]:
    new = perturbed(ReferenceEngine(TINY).model.weights(), seed=seed)
    group = join(w)
    try:
        body = {**metadata(new), "weight_version": version, "hashes": [tensor_hash(t) for t in new.values()]}
        r = push(w, group, body, list(new.values()))
        assert r.status_code == 200, r.text
    finally:
        group.close()
        post(w, "destroy_weights_update_group", {"group_name": GROUP})
    s = state(w)
    assert s["version"] == version and not s["torn"] and s["verified"] is True
    assert served_hashes(w) == tensor_hashes(new.items())
    return new


@pytest.fixture
def paused(worker: WorkerProcess) -> WorkerProcess:
    assert post(worker, "pause_generation", {"mode": "abort"}).status_code == 200
    assert post(worker, "set_weight_version", {"weight_version": "before"}).status_code == 200
    assert not state(worker)["torn"]
    return worker


def bigger(t: torch.Tensor, extra: int = 64) -> torch.Tensor:
    return torch.cat(
        [t.contiguous().reshape(-1).view(torch.uint8), torch.full((extra,), 7, dtype=torch.uint8)]
    )


def test_more_bytes_than_declared_on_the_first_tensor_kill_only_the_helper_and_change_nothing(
    paused: WorkerProcess,
) -> None:
    w = paused
    before = served_hashes(w)
    lie = perturbed(ReferenceEngine(TINY).model.weights(), seed=2)
    group = join(w)
    try:
        r = push(w, group, {**metadata(lie), "weight_version": "lie"}, [bigger(next(iter(lie.values())))])
    finally:
        group.close()
    assert w.proc.poll() is None, "the worker process died"
    assert r.status_code == 503 and r.json()["code"] == "peer_failed", r.text
    s = state(w)
    assert s["version"] == "before" and not s["torn"] and s["paused"]
    assert served_hashes(w) == before
    assert post(w, "destroy_weights_update_group", {"group_name": GROUP}).json()["code"] == "unknown_group"
    good_update(w, seed=3, version="after")


def test_more_bytes_than_declared_after_the_first_tensor_tear_honestly_then_heal(
    paused: WorkerProcess,
) -> None:
    w = paused
    lie = perturbed(ReferenceEngine(TINY).model.weights(), seed=4)
    first, second = list(lie.values())[:2]
    group = join(w)
    try:
        r = push(w, group, {**metadata(lie), "weight_version": "lie"}, [first, bigger(second)])
    finally:
        group.close()
    assert w.proc.poll() is None, "the worker process died"
    assert r.status_code == 500 and r.json()["code"] == "weights_torn", r.text
    assert "helper process receiving the stream was killed by SIGABRT" in r.json()["message"]
    s = state(w)
    assert s["torn"] and s["version"] == "before"
    assert post(w, "resume_generation").status_code == 409
    good_update(w, seed=5, version="healed")
    assert post(w, "resume_generation").status_code == 200
    assert post(w, "pause_generation", {"mode": "abort"}).status_code == 200


def test_fewer_bytes_on_a_tensor_received_while_the_one_before_is_copied_tear_honestly_then_heal(
    paused: WorkerProcess,
) -> None:
    """The helper receives the next broadcast while the worker copies one out: a short send
    there is still caught (its region's sentinel) after the tensor before it was written."""
    w = paused
    lie = perturbed(ReferenceEngine(TINY).model.weights(), seed=9)
    first, second = list(lie.values())[:2]
    short = second.contiguous().reshape(-1).view(torch.uint8)[:-16]
    group = join(w)
    try:
        r = push(w, group, {**metadata(lie), "weight_version": "lie"}, [first, short])
    finally:
        group.close()
    assert w.proc.poll() is None, "the worker process died"
    assert r.status_code == 500 and r.json()["code"] == "weights_torn", r.text
    assert "fewer bytes than" in r.json()["message"]
    s = state(w)
    assert s["torn"] and s["version"] == "before"
    good_update(w, seed=10, version="healed after a short send")


@pytest.mark.parametrize(
    "sent",
    [
        pytest.param(lambda t: t.contiguous().reshape(-1).view(torch.uint8)[:-16], id="fewer-bytes"),
        pytest.param(lambda t: t.to(torch.bfloat16), id="smaller-dtype"),
        pytest.param(lambda t: t.to(torch.float64), id="bigger-dtype"),
    ],
)
def test_a_first_tensor_of_another_size_or_dtype_is_refused_and_changes_nothing(
    paused: WorkerProcess, sent: Any
) -> None:
    w = paused
    before = served_hashes(w)
    lie = perturbed(ReferenceEngine(TINY).model.weights(), seed=6)
    first = next(iter(lie.values()))
    assert first.dtype == torch.float32 and first.numel() >= 8
    group = join(w)
    try:
        r = push(w, group, {**metadata(lie), "weight_version": "lie"}, [sent(first)])
    finally:
        group.close()
    assert w.proc.poll() is None, "the worker process died"
    wire = sent(first)
    code = "peer_failed" if wire.numel() * wire.element_size() > first.numel() * 4 else "short_send"
    assert r.json()["code"] == code, r.text
    assert r.status_code == (503 if code == "peer_failed" else 400)
    s = state(w)
    assert s["version"] == "before" and not s["torn"]
    assert served_hashes(w) == before


def test_a_bare_stream_on_a_group_the_worker_joined_itself_is_refused_before_any_collective(
    paused: WorkerProcess,
) -> None:
    w = paused
    before = served_hashes(w)
    new = perturbed(ReferenceEngine(TINY).model.weights(), seed=8)
    group = join(w, receiver="inline")
    try:
        r = post(w, "update_weights_from_distributed", {**metadata(new), "weight_version": "x"})
        assert r.status_code == 400 and r.json()["code"] == "unsafe_stream", r.text
    finally:
        group.close()
        post(w, "destroy_weights_update_group", {"group_name": GROUP})
    assert state(w)["version"] == "before" and served_hashes(w) == before
