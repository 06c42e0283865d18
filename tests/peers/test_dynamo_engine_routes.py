"""Dynamo's own tests of its worker's ``/engine/*`` routes, replayed against a weightsync worker.

Dynamo's package cannot be installed here (its worker needs a GPU build of vLLM and Dynamo's
runtime), so each test below sends, one for one, the bodies a Dynamo test sends and checks
what that test checks, against a real loopback worker on the reference engine; the
docstring names Dynamo's file and test function.  Where Dynamo's test body is one a real vLLM
worker method would refuse (its tests mock ``collective_rpc``), the exact body is shown to be
refused with a code and nothing changed, and the complete body a Dynamo caller sends (NeMo
RL's, whose wire shapes Dynamo documents as its distributed path) is run end to end over a
real gloo group: the trainer side broadcasts the stream vLLM's stock trainer sends (one
broadcast per tensor, or its packed chunks).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import requests
import torch

from tests.dialect_worker import Served, served
from tests.helpers import free_port, perturbed
from tests.peers.torch_trainer import PlainTrainer
from weightsync.trainer import save_checkpoint, weights_digest

__all__ = ["served"]


def engine(served: Served, route: str, body: Any) -> requests.Response:
    return served.post(f"/engine/{route}", json=body)


def ok(reply: requests.Response) -> dict[str, Any]:
    """Dynamo's ``_post_json`` + ``_status_is_ok``: HTTP 200 and ``status`` ok."""
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert isinstance(body, dict) and body.get("status") in {"ok", "success"}, body
    return body


def refused(reply: requests.Response, status: int, code: str) -> dict[str, Any]:
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert body["status"] == "error" and body["code"] == code, body
    return body


def new_weights(served: Served, seed: int) -> dict[str, torch.Tensor]:
    return perturbed(served.engine.model.weights(), seed=seed)


def vllm_update_info(weights: dict[str, torch.Tensor], **extra: Any) -> dict[str, Any]:
    """vLLM's ``update_info`` as NeMo RL's ``DynamoGeneration.prepare_refit_info`` builds it."""
    return {
        "names": list(weights),
        "dtype_names": [str(t.dtype).removeprefix("torch.") for t in weights.values()],
        "shapes": [list(t.shape) for t in weights.values()],
        **extra,
    }


class Trainer(PlainTrainer):
    """Rank 0 of a plain gloo ``init_process_group`` (:mod:`tests.peers.torch_trainer`): the
    worker dials its store and joins once it does."""

    def init_info(self, **extra: Any) -> dict[str, Any]:
        """NeMo RL's ``init_info`` (``DynamoGeneration.init_collective``), on gloo."""
        return super().init_info(**extra)

    def send(self, served: Served, body: dict[str, Any], chunks: list[torch.Tensor]) -> dict[str, Any]:
        """POST ``body`` to ``update_weights_from_distributed`` while broadcasting ``chunks``."""
        self.joined()
        sent = self.pool.submit(engine, served, "update_weights_from_distributed", body)
        for chunk in chunks:
            self.wait(self.broadcast(chunk))
        return ok(sent.result(timeout=120))


@pytest.fixture
def trainer() -> Iterator[Trainer]:
    t = Trainer()
    try:
        yield t
    finally:
        t.close()


def joined(served: Served, trainer: Trainer) -> None:
    ok(
        engine(
            served,
            "init_weights_update_group",
            {"engine_rpc": "init_weight_transfer_engine", "init_info": trainer.init_info()},
        )
    )
    trainer.joined()


# ---------------------------------------------------------------- tests/rl/test_worker_discovery.py


@pytest.mark.parametrize("method", ["update_weights_from_path", "reload_weights"])
def test_rl_worker_discovery_and_engine_admin_routes(served: Served, method: str) -> None:
    """Dynamo's ``tests/rl/test_worker_discovery.py::test_rl_worker_discovery_and_engine_admin_routes``:
    the worker lists its admin routes; liveness, ``pause_generation {"mode": "keep",
    "clear_cache": false}``, ``update_weights_from_disk {"model_path", "weight_version":
    "smoke_v1", "engine_rpc": "update_weights_from_path"}``, ``get_weight_version`` answers
    ``smoke_v1``, ``resume_generation`` — each HTTP 200 with status ok.  Dynamo's test worker
    extension ignores the path (its ``model_path`` is an empty directory); here it is a real
    checkpoint and the weights served afterwards are its.  ``reload_weights`` is the
    handler's default method (vLLM's own), sent explicitly."""
    routes = set(served.get("/engine/routes").json()["routes"])
    assert {
        "liveness_probe", "pause_generation", "resume_generation", "get_weight_version",
        "update_weights_from_disk", "update_weights_from_distributed", "init_weights_update_group",
        "destroy_weights_update_group",
    } <= routes  # fmt: skip
    new = new_weights(served, seed=3)
    path = save_checkpoint(new, served.root / "smoke")
    assert ok(engine(served, "liveness_probe", {}))["alive"] is True
    ok(engine(served, "pause_generation", {"mode": "keep", "clear_cache": False}))
    update = ok(
        engine(
            served,
            "update_weights_from_disk",
            {"model_path": str(path), "weight_version": "smoke_v1", "engine_rpc": method},
        )
    )
    assert update["version"] == "smoke_v1" and update["digest"] == weights_digest(new)
    version = ok(engine(served, "get_weight_version", {}))
    assert version.get("version", version.get("weight_version")) == "smoke_v1"
    ok(engine(served, "resume_generation", {}))
    assert served.controller.snapshot().digest == weights_digest(new)
    assert not served.controller.snapshot().paused


# ---------------------------------------------------------------- TestRLAdminRouteHardening
# Dynamo's components/src/dynamo/vllm/tests/test_vllm_worker_handler.py::TestRLAdminRouteHardening


def test_admin_rejects_non_dict_body(served: Served) -> None:
    """``TestRLAdminRouteHardening::test_admin_rejects_non_dict_body``: ``[]``, ``"x"``, ``5``
    and ``["pause"]`` to pause, resume, flush and abort are each an error whose message says a
    JSON object is needed; here ``400 not_an_object``, and nothing changed."""
    before = served.state()
    for body in ([], "x", 5, ["pause"]):
        for route in ("pause_generation", "resume_generation", "flush_cache", "abort_request"):
            reply = refused(engine(served, route, body), 400, "not_an_object")
            assert "JSON object" in reply["message"], (route, body, reply)
    assert served.state() == before and not served.controller.snapshot().paused


def test_distributed_update_can_match_async_rl_semantics_exact_body_is_refused(served: Served) -> None:
    """``TestRLAdminRouteHardening::test_distributed_update_can_match_async_rl_semantics``
    sends ``{"allow_unpaused": true, "reset_prefix_cache": false, "engine_rpc":
    "update_weights", "weight_version": 7, "update_info": {"names": ["weight"]}}`` to a mocked
    engine.  vLLM's ``update_weights`` needs ``dtype_names`` and ``shapes`` too, so a real
    worker refuses it: here ``400 missing_field`` naming ``update_info.dtype_names``, before
    anything (version, digest, weights) changes."""
    before = served.state()
    body = {
        "allow_unpaused": True,
        "reset_prefix_cache": False,
        "engine_rpc": "update_weights",
        "weight_version": 7,
        "update_info": {"names": ["weight"]},
    }
    reply = refused(engine(served, "update_weights_from_distributed", body), 400, "missing_field")
    assert reply["details"]["field"] == "update_info.dtype_names"
    assert served.state() == before


@pytest.mark.slow
def test_distributed_update_can_match_async_rl_semantics(served: Served, trainer: Trainer) -> None:
    """``TestRLAdminRouteHardening::test_distributed_update_can_match_async_rl_semantics`` with
    a complete ``update_info``: the update with ``allow_unpaused``, no cache reset and
    ``weight_version: 7`` answers ``{"status": "ok", "version": 7}`` and leaves the prefix
    cache alone.  vLLM's ``update_weights`` streams into an update session
    (``start_weight_update`` ... ``finish_weight_update``, which a weightsync worker opens only
    paused), so the update runs inside one, each step carrying Dynamo's control keys; the
    finish commits version 7 and the trainer's bytes."""
    new = new_weights(served, seed=7)
    ok(engine(served, "pause_generation", {"mode": "keep", "clear_cache": False}))
    joined(served, trainer)
    control = {"allow_unpaused": True, "reset_prefix_cache": False}
    ok(engine(served, "update_weights_from_distributed", {**control, "engine_rpc": "start_weight_update"}))
    body = {
        **control,
        "engine_rpc": "update_weights",
        "weight_version": 7,
        "update_info": vllm_update_info(new),
    }
    reply = trainer.send(served, body, list(new.values()))
    assert reply["version"] == 7 and reply["session_open"] is True
    done = ok(
        engine(served, "update_weights_from_distributed", {**control, "engine_rpc": "finish_weight_update"})
    )
    assert done["version"] == 7 and done["prefix_cache_reset"] is False
    snap = served.controller.snapshot()
    assert snap.version_value == 7 and snap.digest == weights_digest(new) and not snap.session_open


def test_distributed_update_rejects_unpaused_cache_reset(served: Served) -> None:
    """``TestRLAdminRouteHardening::test_distributed_update_rejects_unpaused_cache_reset``:
    ``{"allow_unpaused": true, "engine_rpc": "update_weights"}`` is an error and nothing is
    called.  Here it is ``400 missing_field`` (no ``update_info``); with a complete
    ``update_info`` and ``reset_prefix_cache: true`` it is the rule Dynamo's test pins, ``400
    conflicting_options`` (a prefix cache cannot be reset under running requests) — on every
    step of a session too.  Nothing changed."""
    before = served.state()
    refused(
        engine(
            served,
            "update_weights_from_distributed",
            {"allow_unpaused": True, "engine_rpc": "update_weights"},
        ),
        400,
        "missing_field",
    )
    info = {"names": ["embed.weight"], "dtype_names": ["float32"], "shapes": [[4]]}
    for rpc, extra in (
        ("update_weights", {"update_info": info}),
        ("start_weight_update", {}),
        ("finish_weight_update", {}),
    ):
        body = {"allow_unpaused": True, "reset_prefix_cache": True, "engine_rpc": rpc, **extra}
        refused(engine(served, "update_weights_from_distributed", body), 400, "conflicting_options")
    assert served.state() == before and not served.controller.snapshot().session_open


def test_distributed_update_preserves_safe_defaults(served: Served) -> None:
    """``TestRLAdminRouteHardening::test_distributed_update_preserves_safe_defaults``: ``{}``
    on a running worker is an error and nothing is called; on a paused worker
    ``{"engine_rpc": "finish_weight_update"}`` is ok and resets the prefix cache (the default).
    vLLM's finish ends the session its ``start_weight_update`` opened, so one is opened first."""
    before = served.state()
    refused(engine(served, "update_weights_from_distributed", {}), 400, "missing_field")
    assert served.state() == before
    ok(engine(served, "pause_generation", {"mode": "keep", "clear_cache": False}))
    ok(engine(served, "update_weights_from_distributed", {"engine_rpc": "start_weight_update"}))
    assert served.controller.snapshot().session_open
    done = ok(engine(served, "update_weights_from_distributed", {"engine_rpc": "finish_weight_update"}))
    assert done["prefix_cache_reset"] is True and done["session_open"] is False
    after = served.state()  # a session that streamed nothing: version, digest and weights as they were
    assert (after[0], after[2], after[4]) == (before[0], before[2], before[4])


@pytest.mark.slow
def test_init_weights_update_group_succeeds_within_timeout(served: Served, trainer: Trainer) -> None:
    """``TestRLAdminRouteHardening::test_init_weights_update_group_succeeds_within_timeout``:
    ``{"engine_rpc": "init_weight_transfer_engine", "init_info": {"master_address": "trainer",
    "master_port": 29500}}`` answers ``{"status": "ok", ...}`` from a mocked engine.  vLLM's
    ``init_weight_transfer_engine`` also needs ``rank_offset`` and ``world_size``: that exact
    body is ``400 missing_field`` here.  The complete ``init_info`` (NeMo RL's, on gloo) joins
    the trainer's group, named ``vllm`` like vLLM's one transfer engine, and
    ``shutdown_weight_transfer_engine`` leaves it."""
    before = served.state()
    exact = {
        "engine_rpc": "init_weight_transfer_engine",
        "init_info": {"master_address": "trainer", "master_port": 29500},
    }
    reply = refused(engine(served, "init_weights_update_group", exact), 400, "missing_field")
    assert reply["details"]["field"] == "init_info.rank_offset"
    joined(served, trainer)
    again = {"engine_rpc": "init_weight_transfer_engine", "init_info": trainer.init_info()}
    refused(engine(served, "init_weights_update_group", again), 409, "group_exists")
    ok(engine(served, "destroy_weights_update_group", {"engine_rpc": "shutdown_weight_transfer_engine"}))
    refused(engine(served, "destroy_weights_update_group", {"group_name": "vllm"}), 404, "unknown_group")
    assert served.state() == before


def test_init_weights_update_group_without_init_info_or_trainer_leaves_the_worker_serving(
    served: Served,
) -> None:
    """``TestRLAdminRouteHardening``'s ``test_init_weights_update_group_timeout_exits_worker``,
    ``..._returns_inner_timeout_error``, ``..._engine_dead_exits_worker`` and
    ``..._returns_ordinary_errors`` send ``{"engine_rpc": "init_weight_transfer_engine"}``:
    here that is ``400 missing_field`` (``init_info``).  A rendezvous that never completes (no
    trainer listening) is an error after ``timeout_s``, and — unlike Dynamo, which exits the
    worker — the worker keeps serving with nothing changed."""
    before = served.state()
    bare = {"engine_rpc": "init_weight_transfer_engine"}
    assert refused(engine(served, "init_weights_update_group", bare), 400, "missing_field")["details"] == {
        "field": "init_info"
    }
    info = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
            "backend": "gloo", "timeout_s": 1}  # fmt: skip
    reply = engine(
        served, "init_weights_update_group", {"engine_rpc": "init_weight_transfer_engine", "init_info": info}
    )
    assert reply.status_code >= 400 and reply.json()["status"] == "error", reply.text
    assert ok(engine(served, "liveness_probe", {}))["alive"] is True
    assert served.state() == before


# ---------------------------------------------------------------- NeMo RL through Dynamo's routes


@pytest.mark.slow
def test_nemo_rl_native_vllm_refit_through_dynamos_routes(served: Served, trainer: Trainer) -> None:
    """NeMo RL's refit as Dynamo documents it (``nemo_rl/models/generation/dynamo/
    dynamo_generation.py``: ``init_collective`` then ``_update_dynamo_worker_weights_remote``):
    ``init_weights_update_group`` with ``init_weight_transfer_engine``, then
    ``start_weight_update`` / ``update_weights`` / ``finish_weight_update`` on
    ``update_weights_from_distributed``, each with ``allow_unpaused: true`` and
    ``reset_prefix_cache: false``, the ``update_info`` packed (vLLM's packed stream: one chunk
    of every tensor's bytes in order, under the 1 GiB buffer).  On a paused worker the
    trainer's bytes are committed; on a running one the start is ``409 not_paused`` and nothing
    changes (a weightsync session needs a paused worker)."""
    new = new_weights(served, seed=9)
    common = {"allow_unpaused": True, "reset_prefix_cache": False}
    before = served.state()
    start = {**common, "engine_rpc": "start_weight_update", "is_checkpoint_format": True}
    refused(engine(served, "update_weights_from_distributed", start), 409, "not_paused")
    assert served.state() == before
    ok(engine(served, "pause_generation", {"mode": "wait", "clear_cache": False}))
    joined(served, trainer)
    ok(engine(served, "update_weights_from_distributed", start))
    update = {**common, "engine_rpc": "update_weights", "update_info": vllm_update_info(new, packed=True)}
    flat = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in new.values()])
    trainer.send(served, update, [flat])
    assert served.controller.snapshot().torn  # written, not committed: the session is open
    ok(engine(served, "update_weights_from_distributed", {**common, "engine_rpc": "finish_weight_update"}))
    snap = served.controller.snapshot()
    assert not snap.torn and not snap.session_open and snap.digest == weights_digest(new)
    assert snap.version_value is None  # NeMo RL sends no weight_version: the declaration is unchanged
    ok(engine(served, "resume_generation", {}))
