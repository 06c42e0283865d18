"""A real loopback worker parsing a plan part of real size (1,000 tensors, 64 FSDP ranks into
TP=8: about a second and a half of parsing) keeps answering on its event loop meanwhile, and
a refused request leaves no parse of its part behind (the same part posted again is parsed
again).  The real parser runs; it is only watched, to know when it starts and ends."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.unit.test_plan_wire import real_sized_specs
from tests.workers import Worker
from weightsync.core import errors
from weightsync.core.plan.build import make_plan
from weightsync.core.plan.layouts import FleetLayout, TrainerLayout, WorkerLayout, tp_dims
from weightsync.core.plan.value import PlanPart

pytestmark = pytest.mark.integration


def real_sized_wire(worker: str) -> dict[str, Any]:
    """The compact wire form of a real-sized part for ``worker`` (a name no other test's part
    has, so no part kept from another test is this one)."""
    specs = real_sized_specs()
    layout = WorkerLayout.tensor_parallel(worker, specs, 8, tp_dims(specs, shard_embeddings=False))
    return make_plan(TrainerLayout.fsdp(specs, 64), FleetLayout((layout,))).part(0).to_wire()


class Watched:
    """``PlanPart``'s parser, run as it is, counting its runs and saying when one started and
    when it ended."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.started, self.ended = threading.Event(), threading.Event()
        self.runs = 0
        real = PlanPart._parse.__func__  # type: ignore[attr-defined]

        def parse(cls: type[PlanPart], value: Any) -> PlanPart:
            self.runs += 1
            self.started.set()
            try:
                return real(cls, value)
            finally:
                self.ended.set()

        monkeypatch.setattr(PlanPart, "_parse", classmethod(parse))


@pytest.fixture
def watched(monkeypatch: pytest.MonkeyPatch) -> Iterator[Watched]:
    yield Watched(monkeypatch)


def post_refused(worker: Worker, wire: dict[str, Any], order: list[str]) -> Callable[[], None]:
    def post() -> None:
        with pytest.raises(errors.NotFound) as exc:  # read whole, then: no group of that name
            worker.client.update_weights_from_plan("no-such-group", "s1", wire, dry_run=True)
        assert exc.value.code == "unknown_group"
        order.append("plan")

    return post


def test_a_worker_answers_health_and_status_while_it_parses_a_real_sized_plan_part(
    make_worker: Callable[..., Worker], watched: Watched
) -> None:
    worker = make_worker()
    wire = real_sized_wire("w-parsing")
    order: list[str] = []
    poster = threading.Thread(target=post_refused(worker, wire, order))
    poster.start()
    try:
        assert watched.started.wait(120), "the worker never parsed the part"
        health = httpx.get(f"{worker.url}/health", timeout=120)
        parsing_at_health = not watched.ended.is_set()
        order.append("health")
        status = httpx.post(f"{worker.url}/engine/get_weight_version", json={}, timeout=120)
        parsing_at_status = not watched.ended.is_set()
        order.append("status")
    finally:
        poster.join(120)
    assert health.status_code == 200 and health.json()["alive"]
    assert status.status_code == 200 and status.json()["version_declared"] is False
    # both answered while the part was still being parsed, so before the plan's refusal
    assert (parsing_at_health, parsing_at_status) == (True, True)
    assert order == ["health", "status", "plan"]
    assert watched.runs == 1


def test_a_refused_plan_request_leaves_no_parse_of_its_part_behind(
    make_worker: Callable[..., Worker], watched: Watched
) -> None:
    worker = make_worker()
    wire = real_sized_wire("w-refused")
    order: list[str] = []
    post_refused(worker, wire, order)()
    post_refused(worker, wire, order)()
    assert order == ["plan", "plan"]
    assert watched.runs == 2  # parsed anew: the refused request kept nothing
    assert worker.client.liveness_probe()["alive"]
