"""A plan part of real size (1,000 tensors, 64 FSDP ranks into one TP=8 worker: 232,000
pieces) reaches a real worker over loopback through the default 16 MiB body limit in the
compact form the trainer posts, is read and answered on its merits; the first form of the
same part is refused at the door (413), and a hostile compact part is a 400 that changes
nothing."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest

from tests.unit.test_plan_wire import real_sized_specs
from tests.workers import Worker
from weightsync.core import errors
from weightsync.core.plan.build import make_plan
from weightsync.core.plan.layouts import FleetLayout, TrainerLayout, WorkerLayout, tp_dims
from weightsync.serve.app import DEFAULT_MAX_BODY

pytestmark = pytest.mark.integration


def test_a_real_sized_part_is_delivered_in_the_compact_form_and_the_old_form_is_too_large(
    make_worker: Callable[..., Worker],
) -> None:
    specs = real_sized_specs()
    layout = WorkerLayout.tensor_parallel("w0", specs, 8, tp_dims(specs, shard_embeddings=False))
    part = make_plan(TrainerLayout.fsdp(specs, 64), FleetLayout((layout,))).part(0)
    worker = make_worker()  # the default body limit
    before = (worker.client.engine_rpc("weight_hashes")["result"], worker.client.get_weight_version())

    # the compact part is read (a malformed one would be 400 invalid_layout) and the worker
    # answers what comes next: it has no group of that name
    with pytest.raises(errors.NotFound) as exc:
        worker.client.update_weights_from_plan("no-such-group", "s1", part.to_wire(), dry_run=True)
    assert exc.value.code == "unknown_group"

    old = json.dumps({"group_name": "g", "stream_id": "s2", "plan": part.to_wire(compact=False)}).encode()
    assert len(old) > DEFAULT_MAX_BODY
    reply = httpx.post(
        f"{worker.url}/engine/update_weights_from_plan",
        content=old,
        headers={"content-type": "application/json"},
        timeout=120,
    )
    assert reply.status_code == 413 and reply.json()["code"] == "payload_too_large"

    hostile = part.to_wire()
    hostile["transfers"][-1]["tensor"][-1] = len(specs)  # one index out of range, at the very end
    with pytest.raises(errors.InvalidRequest) as bad:
        worker.client.update_weights_from_plan("no-such-group", "s3", hostile, dry_run=True)
    assert bad.value.code == "invalid_layout" and "tensor" in str(bad.value)
    assert (worker.client.engine_rpc("weight_hashes")["result"], worker.client.get_weight_version()) == before
    assert worker.client.liveness_probe()["alive"]
