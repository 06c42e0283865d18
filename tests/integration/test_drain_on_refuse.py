"""Drain on refuse: a trainer that posts its update and starts broadcasting at once, and a worker
that refuses the update (a name the model lacks, a running worker, the version rule) or fails it
part-way.  The trainer's broadcast returns within a bound far under the group's timeout, its HTTP
reply is the refusal with its code, the worker holds what it held, and the next update on the
same group commits.

Each trainer makes the calls of the peer it stands for, on gloo (a CPU here):

* SGLang (``test/srt/rl/test_update_weights_from_distributed.py``'s ``init_process_hf``): its
  group from ``init_custom_process_group`` (:mod:`tests.peers.sglang_calls`), then
  ``/update_weights_from_distributed`` posted while rank 0 broadcasts every tensor, or the
  ``FlattenedTensorBucket`` of them all (``load_format: "flattened_bucket"``);
* OpenRLHF (``openrlhf/trainer/ray/ppo_actor.py`` ``_broadcast_to_vllm``): the same group, one
  ``/engine/update_weights_from_distributed`` and a broadcast per parameter;
* vLLM's packed stream, as TRL's ``VLLMClient.update_named_params`` drives it
  (:mod:`tests.peers.test_vllm_trl_client`): ``/start_weight_update``, ``/update_weights`` while
  ``packed_nccl_broadcast_producer``'s chunks (vLLM's own ``pack_tensors``) are broadcast,
  ``/finish_weight_update``; and vLLM's per-tensor stream (its ``trainer_send_weights``
  without ``packed``), one broadcast per tensor;
* weightsync's own :class:`~weightsync.trainer.Broadcaster`.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import attrs
import pytest
import requests
import torch
import torch.distributed as dist

from tests.helpers import TINY, free_port, hashes, perturbed
from tests.peers.sglang_calls import init_custom_process_group
from tests.peers.test_vllm_trl_client import packed_chunks
from tests.peers.torch_trainer import PlainTrainer
from weightsync.core import Controller, errors
from weightsync.engines.reference import ReferenceEngine
from weightsync.serve import ServerThread, create_app
from weightsync.trainer import Broadcaster, PushFailed, weights_digest
from weightsync.transports.distributed import foreign, packed

pytestmark = pytest.mark.slow

GROUP = "drain"
TIMEOUT = datetime.timedelta(seconds=120)
"""The trainer's group timeout: a trainer left waiting for a worker would block this long."""
BOUND_S = 30.0
"""How long a trainer's broadcast of a refused update may take here (the tensors are small)."""


@attrs.define
class Worker:
    url: str
    engine: ReferenceEngine
    controller: Controller

    def post(self, path: str, body: Any = None) -> requests.Response:
        return requests.post(f"{self.url}{path}", json={} if body is None else body, timeout=180)

    def held(self) -> tuple[Any, ...]:
        """What the worker holds: its version, digest, torn flag and the served hashes."""
        snap = self.controller.snapshot()
        return snap.version_value, snap.digest, snap.torn, hashes(self.engine)


@contextmanager
def served(paused: bool = True, require_version: bool = False, **app: Any) -> Iterator[Worker]:
    engine = ReferenceEngine(TINY)
    controller = Controller(engine, paused=paused, require_version=require_version)
    with ServerThread(create_app(controller, **app)) as server:
        yield Worker(server.url, engine, controller)


@contextmanager
def peer_group(w: Worker, init: Callable[[int], requests.Response]) -> Iterator[Any]:
    """Rank 0 of ``init_custom_process_group`` (SGLang's, and OpenRLHF's copy of it) while the
    worker joins through ``init`` (given the port); destroyed at the end."""
    port = free_port()
    with ThreadPoolExecutor(1) as pool:
        forming = pool.submit(
            init_custom_process_group, "gloo", f"tcp://127.0.0.1:{port}", 2, 0, GROUP, TIMEOUT
        )
        r = init(port)
        assert r.status_code == 200, r.text
        group = forming.result(timeout=120)
    try:
        yield group
    finally:
        dist.destroy_process_group(group)


def joined_at(w: Worker, path: str, **extra: Any) -> Callable[[int], requests.Response]:
    """The worker's join of rank 0's group at a port, through ``path`` (``extra`` beside the
    fields SGLang's ``init_process_sgl`` and OpenRLHF send)."""
    return lambda port: w.post(
        path,
        {
            "master_address": "127.0.0.1",
            "master_port": port,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": GROUP,
            "backend": "gloo",
            **extra,
        },
    )


def sglang_init(w: Worker) -> Callable[[int], requests.Response]:
    return joined_at(w, "/init_weights_update_group")  # SGLang's dialect joins gloo through a helper


def engine_init(w: Worker) -> Callable[[int], requests.Response]:
    return joined_at(w, "/engine/init_weights_update_group", receiver="process")


def metadata(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {
        "names": list(tensors),
        "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
        "shapes": [list(t.shape) for t in tensors.values()],
        "group_name": GROUP,
    }


def post_and_broadcast(
    post: Callable[[], requests.Response], broadcast: Callable[[torch.Tensor], None], sent: list[torch.Tensor]
) -> tuple[requests.Response, float]:
    """The update posted and, at once, every tensor of ``sent`` broadcast from rank 0 (without
    waiting for the reply); returns the reply and how long the broadcasts took."""
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(post)
        t0 = time.monotonic()
        for t in sent:
            broadcast(t.contiguous())
        took = time.monotonic() - t0
        return reply.result(timeout=180), took


def on(group: Any) -> Callable[[torch.Tensor], None]:
    return lambda t: dist.broadcast(t, 0, group=group)


def flattened(tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """SGLang's ``FlattenedTensorBucket`` of ``tensors``: one broadcast of them all."""
    return [torch.cat([t.flatten().view(torch.uint8) for t in tensors.values()])]


def weights(seed: int) -> dict[str, torch.Tensor]:
    return perturbed(ReferenceEngine(TINY).model.weights(), seed=seed)


def with_unknown(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with one more the model lacks, in the middle of the stream."""
    items = list(tensors.items())
    half = len(items) // 2
    return dict([*items[:half], ("model.not_a_weight", torch.ones(1000)), *items[half:]])


# ------------------------------------------------------------------ SGLang


@pytest.mark.parametrize("flat", [False, True], ids=["per-tensor", "flattened-bucket"])
def test_sglang_update_naming_a_tensor_the_model_lacks_is_drained_and_the_next_one_commits(
    flat: bool,
) -> None:
    with served() as w, peer_group(w, sglang_init(w)) as group:
        before = w.held()
        bad = with_unknown(weights(1))
        body = {
            **metadata(bad),
            "weight_version": "refused",
            **({"load_format": "flattened_bucket"} if flat else {}),
        }
        reply, took = post_and_broadcast(
            lambda: w.post("/update_weights_from_distributed", body),
            on(group),
            flattened(bad) if flat else list(bad.values()),
        )
        assert reply.status_code == 400 and reply.json()["code"] == "unknown_tensor", reply.text
        assert took < BOUND_S, f"the trainer's broadcast took {took:.1f}s"
        assert w.held() == before
        good = weights(2)
        body = {
            **metadata(good),
            "weight_version": "next",
            **({"load_format": "flattened_bucket"} if flat else {}),
        }
        reply, _ = post_and_broadcast(
            lambda: w.post("/update_weights_from_distributed", body),
            on(group),
            flattened(good) if flat else list(good.values()),
        )
        assert reply.status_code == 200 and reply.json()["success"] is True, reply.text
        assert w.held()[:3] == ("next", weights_digest(good), False)


def test_sglang_flattened_bucket_refused_by_the_version_rule_is_drained_and_the_next_one_commits() -> None:
    with served(require_version=True) as w, peer_group(w, sglang_init(w)) as group:
        before = w.held()
        new = weights(3)
        body = {**metadata(new), "load_format": "flattened_bucket"}  # no weight_version: refused
        reply, took = post_and_broadcast(
            lambda: w.post("/update_weights_from_distributed", body), on(group), flattened(new)
        )
        assert reply.status_code == 400 and reply.json()["code"] == "version_required", reply.text
        assert took < BOUND_S and w.held() == before
        reply, _ = post_and_broadcast(
            lambda: w.post("/update_weights_from_distributed", {**body, "weight_version": "v1"}),
            on(group),
            flattened(new),
        )
        assert reply.status_code == 200, reply.text
        assert w.held()[:3] == ("v1", weights_digest(new), False)


def test_sglang_body_refused_by_the_dialect_is_drained_when_its_stream_parses() -> None:
    with served() as w, peer_group(w, sglang_init(w)) as group:
        before = w.held()
        new = weights(4)
        body = {**metadata(new), "selector": "draft"}  # SGLang's dialect refuses a draft model
        reply, took = post_and_broadcast(
            lambda: w.post("/update_weights_from_distributed", body), on(group), list(new.values())
        )
        assert reply.status_code >= 400 and reply.json()["success"] is False, reply.text
        assert took < BOUND_S and w.held() == before
        reply, _ = post_and_broadcast(
            lambda: w.post("/update_weights_from_distributed", {**metadata(new), "weight_version": "v2"}),
            on(group),
            list(new.values()),
        )
        assert reply.status_code == 200, reply.text
        assert w.held()[:3] == ("v2", weights_digest(new), False)


def test_a_body_whose_stream_does_not_parse_leaves_the_group_so_the_trainer_fails_fast() -> None:
    with served() as w, peer_group(w, sglang_init(w)) as group:
        before = w.held()
        new = weights(5)
        body = {**metadata(new), "shapes": "not a list"}
        t0 = time.monotonic()
        with ThreadPoolExecutor(1) as pool:
            reply = pool.submit(w.post, "/update_weights_from_distributed", body)
            with pytest.raises(RuntimeError):  # its peer left the group: the collective fails
                for t in new.values():
                    dist.broadcast(t.contiguous(), 0, group=group)
            assert reply.result(timeout=60).status_code == 400
        assert time.monotonic() - t0 < BOUND_S
        assert w.held() == before
        assert w.post("/engine/get_weight_version").json()["torn"] is False


# ------------------------------------------------------------------ failures part-way


def test_a_bare_stream_failing_part_way_drains_the_rest_and_the_group_takes_the_next_update(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    handed = foreign.hand_over
    count = {"n": 0}

    def failing(*args: Any, **kwargs: Any) -> str:
        count["n"] += 1
        if count["n"] == 3:
            raise RuntimeError("the engine failed on the third tensor")
        return handed(*args, **kwargs)

    with served() as w, peer_group(w, sglang_init(w)) as group:
        new = weights(6)
        monkeypatch.setattr(foreign, "hand_over", failing)
        reply, took = post_and_broadcast(
            lambda: w.post("/update_weights_from_distributed", {**metadata(new), "weight_version": "x"}),
            on(group),
            list(new.values()),
        )
        monkeypatch.undo()
        assert reply.status_code >= 400 and reply.json()["success"] is False, reply.text
        assert took < BOUND_S
        assert count["n"] == 3  # nothing was handed over after the failure: the rest was drained
        reply, _ = post_and_broadcast(
            lambda: w.post("/update_weights_from_distributed", {**metadata(new), "weight_version": "healed"}),
            on(group),
            list(new.values()),
        )
        assert reply.status_code == 200, reply.text
        assert w.held()[:3] == ("healed", weights_digest(new), False)


# ------------------------------------------------------------------ OpenRLHF, on weightsync's routes


def test_openrlhf_per_parameter_update_on_a_running_worker_is_drained_and_the_next_one_commits() -> None:
    with served(paused=False) as w, peer_group(w, engine_init(w)) as group:
        before = w.held()
        new = weights(7)
        body = {**metadata(new), "weight_version": "refused"}  # running, without allow_unpaused
        reply, took = post_and_broadcast(
            lambda: w.post("/engine/update_weights_from_distributed", body), on(group), list(new.values())
        )
        assert reply.status_code == 409 and reply.json()["code"] == "not_paused", reply.text
        assert took < BOUND_S and w.held() == before
        assert w.post("/engine/pause_generation").status_code == 200
        reply, _ = post_and_broadcast(
            lambda: w.post("/engine/update_weights_from_distributed", {**body, "weight_version": "v1"}),
            on(group),
            list(new.values()),
        )
        assert reply.status_code == 200, reply.text
        assert w.held()[:3] == ("v1", weights_digest(new), False)


def test_a_key_reused_for_another_update_is_drained_and_a_repeat_joins_nothing() -> None:
    with served() as w, peer_group(w, engine_init(w)) as group:
        first, other = weights(17), weights(18)
        body = {**metadata(first), "weight_version": "v1", "idempotency_key": "step-1"}
        reply, _ = post_and_broadcast(
            lambda: w.post("/engine/update_weights_from_distributed", body), on(group), list(first.values())
        )
        assert reply.status_code == 200, reply.text
        held = w.held()
        repeat = w.post("/engine/update_weights_from_distributed", body)  # TRL's retry: no broadcast
        assert repeat.status_code == 200 and repeat.json()["replayed"] is True
        reused = {**metadata(other), "weight_version": "v2", "idempotency_key": "step-1"}
        reply, took = post_and_broadcast(
            lambda: w.post("/engine/update_weights_from_distributed", reused), on(group), list(other.values())
        )
        assert reply.status_code == 409 and reply.json()["code"] == "idempotency_key_reused", reply.text
        assert took < BOUND_S and w.held() == held
        reply, _ = post_and_broadcast(
            lambda: w.post(
                "/engine/update_weights_from_distributed", {**reused, "idempotency_key": "step-2"}
            ),
            on(group),
            list(other.values()),
        )
        assert reply.status_code == 200, reply.text
        assert w.held()[:3] == ("v2", weights_digest(other), False)


# ------------------------------------------------------------------ vLLM's packed stream


@contextmanager
def vllm_trainer(w: Worker, packed: bool = True) -> Iterator[PlainTrainer]:
    """TRL's ``init_communicator`` (``packed``; vLLM's own trainer sends per tensor without it),
    with a plain gloo group for its NCCL one."""
    trainer = PlainTrainer(2)
    try:
        with ThreadPoolExecutor(1) as pool:
            posted = pool.submit(
                w.post, "/init_weight_transfer_engine", {"init_info": trainer.init_info(packed=packed)}
            )
            trainer.joined()
            assert posted.result(timeout=120).status_code == 200
        yield trainer
    finally:
        trainer.close()


def update_info(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    m = metadata(tensors)
    return {"update_info": {"names": m["names"], "dtype_names": m["dtypes"], "shapes": m["shapes"]}}


def broadcast_vllm(trainer: PlainTrainer) -> Callable[[torch.Tensor], None]:
    return lambda chunk: trainer.wait(trainer.broadcast(chunk))


def vllm_stream(tensors: dict[str, torch.Tensor], packed: bool) -> list[torch.Tensor]:
    """What vLLM's trainer broadcasts: ``packed_nccl_broadcast_producer``'s chunks, or each tensor."""
    return packed_chunks(tensors) if packed else list(tensors.values())


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per-tensor"])
def test_vllm_update_naming_a_tensor_the_model_lacks_is_drained_and_the_next_round_commits(
    packed: bool,
) -> None:
    with served(auto_pause_updates=True) as w, vllm_trainer(w, packed) as trainer:
        before = w.held()
        bad = with_unknown(weights(8))
        assert w.post("/start_weight_update").status_code == 200
        reply, took = post_and_broadcast(
            lambda: w.post("/update_weights", update_info(bad)),
            broadcast_vllm(trainer),
            vllm_stream(bad, packed),
        )
        assert reply.status_code == 400 and reply.json()["error"]["type"] == "unknown_tensor", reply.text
        assert took < BOUND_S
        assert w.post("/finish_weight_update").status_code == 200  # nothing was written
        assert w.held()[1:] == before[1:]
        good = weights(9)
        assert w.post("/start_weight_update").status_code == 200
        reply, _ = post_and_broadcast(
            lambda: w.post("/update_weights", update_info(good)),
            broadcast_vllm(trainer),
            vllm_stream(good, packed),
        )
        assert reply.status_code == 200, reply.text
        assert w.post("/finish_weight_update", {"weight_version": "v1"}).status_code == 200
        assert w.held()[:3] == ("v1", weights_digest(good), False)


def test_vllm_update_outside_a_session_is_drained_and_the_next_round_commits() -> None:
    with served(auto_pause_updates=True) as w, vllm_trainer(w) as trainer:
        before = w.held()
        new = weights(10)
        reply, took = post_and_broadcast(  # no /start_weight_update first
            lambda: w.post("/update_weights", update_info(new)), broadcast_vllm(trainer), packed_chunks(new)
        )
        assert reply.status_code == 409 and reply.json()["error"]["type"] == "no_session", reply.text
        assert took < BOUND_S and w.held() == before
        assert w.post("/start_weight_update").status_code == 200
        reply, _ = post_and_broadcast(
            lambda: w.post("/update_weights", update_info(new)), broadcast_vllm(trainer), packed_chunks(new)
        )
        assert reply.status_code == 200, reply.text
        assert w.post("/finish_weight_update", {"weight_version": "v1"}).status_code == 200
        assert w.held()[:3] == ("v1", weights_digest(new), False)


# ------------------------------------------------------------------ weightsync's own stream


def test_weightsyncs_own_stream_refused_by_a_running_worker_keeps_the_group_for_the_next_push() -> None:
    with served(paused=False) as w, Broadcaster([w.url], timeout_s=120, bucket_bytes=64 << 10) as b:
        before = w.held()
        t0 = time.monotonic()
        with pytest.raises(PushFailed) as err:
            b.push(weights(11), version="refused")
        assert time.monotonic() - t0 < BOUND_S
        assert [e.code for e in err.value.failures.values()] == ["not_paused"]
        assert w.held() == before
        assert w.post("/engine/pause_generation").status_code == 200
        new = weights(12)
        b.push(new, version="v1")
        assert w.held()[:3] == ("v1", weights_digest(new), False)


def test_weightsyncs_own_stream_failing_part_way_drains_the_rest_and_takes_the_next_push(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    unpacked = packed.unpack
    count = {"n": 0}

    def failing(*args: Any, **kwargs: Any) -> None:
        count["n"] += 1
        if count["n"] == 2:
            raise RuntimeError("the engine failed on the second bucket")
        unpacked(*args, **kwargs)

    with served() as w, Broadcaster([w.url], timeout_s=120, bucket_bytes=16 << 10) as b:
        before = w.held()
        monkeypatch.setattr(packed, "unpack", failing)
        t0 = time.monotonic()
        with pytest.raises(PushFailed) as err:
            b.push(weights(13), version="failed")
        monkeypatch.undo()
        assert time.monotonic() - t0 < BOUND_S
        assert count["n"] == 2 and [e.code for e in err.value.failures.values()] == ["stream_failed"]
        assert w.held() == before  # written into a staging copy, discarded
        assert b.group is not None  # the trainer's stream ran to its end: its group is in step
        new = weights(14)
        b.push(new, version="healed")
        assert w.held()[:3] == ("healed", weights_digest(new), False)


def test_a_packed_stream_refused_before_its_go_is_answered_at_once() -> None:
    with served(paused=False) as w, Broadcaster([w.url], timeout_s=120) as b:
        assert b.group is not None
        t0 = time.monotonic()
        r = w.post(
            "/engine/update_weights_from_distributed",
            {
                **metadata({"model.norm.weight": torch.ones(TINY.hidden_size)}),
                "group_name": "weightsync",
                "packing": {"bucket_bytes": 1024, "stream_id": "nobody-sends"},
            },
        )
        assert r.status_code == 409 and r.json()["code"] == "not_paused"
        assert time.monotonic() - t0 < 5  # no drain: this stream's trainer waits for the go
        with pytest.raises(errors.WeightSyncError):
            b.push(weights(15), version="still-running")  # refused, and the group still in step
        assert w.post("/engine/pause_generation").status_code == 200
        b.push(weights(16), version="v1")
        assert w.held()[0] == "v1"
