"""What a refused update owes a trainer that posts and broadcasts at once, decided in core:
which bodies declare a stream to drain or a group to leave, which refusals the controller
settles (in the update's own turn, once), and which it leaves to the engine's channel."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from weightsync.core import Controller, Declared, DistributedSource, TensorSpec, UpdateRequest
from weightsync.core.engine import DrainingEngine, EngineCalls
from weightsync.core.errors import IllegalState, InvalidRequest, LoadFailed
from weightsync.core.routes import declared_stream, dispatch
from weightsync.core.snapshot import LoadStats
from weightsync.core.sources import WeightSource
from weightsync.testing import ScriptableEngine

pytestmark = pytest.mark.unit

ROUTE = "update_weights_from_distributed"
STREAM = {"names": ["a", "b"], "dtypes": ["float32", "bfloat16"], "shapes": [[4], [2, 3]], "group_name": "g"}


class Settles:
    """A ``load_context`` that records what it was asked to settle."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.fail = fail

    def drain(self, source: WeightSource) -> None:
        self.calls.append(("drain", source))
        if self.fail:
            raise RuntimeError("the drain failed")

    def abandon(self, group_name: str) -> None:
        self.calls.append(("abandon", group_name))


class DrainingFake(ScriptableEngine):
    """The scriptable engine with a ``load_context``; a distributed source is refused by its
    channel as an unknown tensor (the channel settles that one itself)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.load_context = Settles()

    async def load_weights(self, source: WeightSource) -> LoadStats:
        if isinstance(source, DistributedSource):
            self.calls.append(("load_weights", source))
            raise LoadFailed(
                "refused", wrote=False, cause=InvalidRequest("no such tensor", code="unknown_tensor")
            )
        return await super().load_weights(source)


def bare() -> DistributedSource:
    return DistributedSource("g", [TensorSpec("a", "float32", (4,))])


def test_a_body_refused_for_another_field_still_declares_its_stream() -> None:
    owed = declared_stream(ROUTE, {**STREAM, "weight_version": {"bad": float("nan")}, "surplus": 1})
    assert isinstance(owed, DistributedSource) and owed.group_name == "g"
    assert [(t.name, t.shape) for t in owed.tensors] == [("a", (4,)), ("b", (2, 3))]
    flat = declared_stream(ROUTE, {**STREAM, "packing": {"flat": True, "flat_bucket_bytes": 8}, "hashes": 3})
    assert isinstance(flat, DistributedSource) and flat.flat and flat.flat_bucket_bytes == 8


@pytest.mark.parametrize(
    "body",
    [
        {**STREAM, "shapes": "oops"},
        {**STREAM, "names": []},
        {"group_name": "g"},
        {**STREAM, "dtypes": ["int3"]},
    ],
    ids=["shapes-not-a-list", "no-names", "no-lists", "unknown-dtype"],
)
def test_a_body_whose_stream_does_not_parse_owes_its_group(body: dict[str, Any]) -> None:
    assert declared_stream(ROUTE, body) == "g"


@pytest.mark.parametrize(
    ("route", "body"),
    [
        (
            ROUTE,
            {**STREAM, "packing": {"bucket_bytes": 1024, "stream_id": "s"}},
        ),  # its trainer waits for the go
        (ROUTE, {**STREAM, "packing": {"stream_id": 5}}),
        (ROUTE, {**STREAM, "dry_run": True}),
        (ROUTE, {**STREAM, "delta": {"counts": [1, 1]}}),
        (ROUTE, {**STREAM, "group_name": "bad name!"}),
        (ROUTE, ["not", "an", "object"]),
        ("update_weights_from_disk", STREAM),
    ],
    ids=["packed", "packed-malformed", "dry-run", "delta", "bad-group", "not-an-object", "other-route"],
)
def test_nothing_is_owed_where_no_trainer_can_be_sending_a_bare_stream(route: str, body: Any) -> None:
    assert declared_stream(route, body) is None


def test_settle_drains_a_bare_stream_leaves_a_group_and_skips_the_rest() -> None:
    engine = DrainingFake()
    calls = EngineCalls(engine)
    packed = DistributedSource("g", [TensorSpec("a", "float32", (4,))], bucket_bytes=64, stream_id="s")

    async def main() -> None:
        for debt in (bare(), "g", packed, None):
            await calls.settle(debt)

    asyncio.run(main())
    assert engine.load_context.calls == [("drain", bare()), ("abandon", "g")]
    assert isinstance(engine, DrainingEngine) and not isinstance(ScriptableEngine(), DrainingEngine)
    asyncio.run(EngineCalls(ScriptableEngine()).settle(bare()))  # nothing to settle with: nothing done


def test_a_drain_that_fails_never_replaces_the_refusal() -> None:
    engine = DrainingFake()
    engine.load_context = Settles(fail=True)
    with pytest.raises(IllegalState) as err:  # running, without allow_unpaused
        asyncio.run(Controller(engine).update(UpdateRequest(bare())))
    assert err.value.code == "not_paused" and engine.load_context.calls == [("drain", bare())]


def test_a_state_or_version_refusal_is_settled_in_the_updates_turn() -> None:
    engine = DrainingFake()

    async def main() -> None:
        c = Controller(engine, require_version=True)
        with pytest.raises(IllegalState):
            await c.update(UpdateRequest(bare(), Declared("v")))  # running: not_paused
        await c.pause(_pause())
        with pytest.raises(InvalidRequest) as err:
            await c.update(UpdateRequest(bare()))  # no version
        assert err.value.code == "version_required"
        with pytest.raises(IllegalState) as no_session:
            await c.update(UpdateRequest(bare(), session=True))
        assert no_session.value.code == "no_session"
        assert [(e.command, e.outcome) for e in c.journal] == [
            ("update", "not_paused"),
            ("pause", "ok"),
            ("update", "version_required"),
            ("session_update", "no_session"),
        ]

    asyncio.run(main())
    assert engine.load_context.calls == [("drain", bare())] * 3
    assert not any(name == "load_weights" for name, _ in engine.calls)


def test_a_refusal_of_the_engines_channel_is_not_settled_twice() -> None:
    engine = DrainingFake()

    async def main() -> None:
        c = Controller(engine, paused=True)
        with pytest.raises(InvalidRequest) as err:
            await c.update(UpdateRequest(bare()))
        assert err.value.code == "unknown_tensor"

    asyncio.run(main())
    assert [name for name, _ in engine.calls] == ["load_weights"] and engine.load_context.calls == []


def test_a_body_refused_by_its_parser_is_settled_in_arrival_order() -> None:
    engine = DrainingFake()

    async def main() -> None:
        c = Controller(engine, paused=True)
        with pytest.raises(InvalidRequest):
            await dispatch(c, ROUTE, {**STREAM, "weight_version": 1, "allow_unpaused": "yes"})
        with pytest.raises(InvalidRequest):
            await dispatch(c, ROUTE, {**STREAM, "shapes": None})
        with pytest.raises(InvalidRequest):
            await dispatch(c, ROUTE, {**STREAM, "packing": {"bucket_bytes": 0, "stream_id": "s"}})
        assert [(e.command, e.outcome) for e in c.journal] == [("settle_refused", "ok")] * 2

    asyncio.run(main())
    stream = declared_stream(ROUTE, STREAM)
    assert engine.load_context.calls == [("drain", stream), ("abandon", "g")]


def _pause() -> Any:
    from weightsync.core import PauseMode, PauseRequest

    return PauseRequest(PauseMode.ABORT, False)
