"""Wire codecs: errors and weight sources cross a process boundary and come back as they were;
optional engine features are found with isinstance; the update choreography is one list of steps."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weightsync.core import Controller, DiskSource, DistributedSource, TensorSource, errors
from weightsync.core._state import REFUSED, SUCCEEDED, TORE, UpdateSteps
from weightsync.core.diagram import COMMANDS
from weightsync.core.dtypes import BY_SAFETENSORS, DTYPES, NAMES
from weightsync.core.requests import InitGroupRequest, UpdateRequest
from weightsync.core.snapshot import TensorSpec
from weightsync.core.sources import TensorHandle, source_from_wire
from weightsync.testing import ScriptableEngine

FAMILY = (
    errors.InvalidRequest, errors.Unauthorized, errors.Forbidden, errors.NotFound, errors.IllegalState,
    errors.PayloadTooLarge, errors.UnsupportedMediaType, errors.NotSupported, errors.EngineFailure,
    errors.WeightsTorn, errors.EngineUnavailable,
)  # fmt: skip

texts = st.text(st.characters(codec="utf-8"), min_size=1, max_size=20)
details = st.dictionaries(
    texts.filter(lambda k: k not in ("message", "code", "wrote", "cause")), st.integers(), max_size=3
)


@given(st.sampled_from(FAMILY), texts, details)
def test_every_error_class_round_trips_through_its_reply(
    cls: type[errors.WeightSyncError], message: str, info: dict[str, Any]
) -> None:
    exc = cls(message, **info)
    # a reply crosses as JSON: what comes back is what was sent
    back = errors.WeightSyncError.from_reply(json.loads(json.dumps(exc.to_reply())), exc.http_status)
    assert type(back) is cls
    assert (back.code, back.message, back.details) == (exc.code, exc.message, exc.details)
    wired = errors.WeightSyncError.from_wire(json.loads(json.dumps(exc.to_wire())))
    assert type(wired) is cls and wired.code == exc.code


@given(st.sampled_from(FAMILY), texts, st.booleans(), details)
def test_a_load_failure_keeps_wrote_and_its_cause_through_the_wire(
    cls: type[errors.WeightSyncError], message: str, wrote: bool, info: dict[str, Any]
) -> None:
    cause = cls(message, **info)
    back = errors.WeightSyncError.from_wire(
        json.loads(json.dumps(errors.LoadFailed(message, wrote=wrote, cause=cause).to_wire()))
    )
    assert isinstance(back, errors.LoadFailed) and back.wrote is wrote
    assert back.cause is not None and back.cause.http_status == cause.http_status
    assert (back.code, back.cause.details) == (cause.code, cause.details)


def test_a_load_failure_without_cause_comes_back_without_one() -> None:
    back = errors.WeightSyncError.from_wire(errors.LoadFailed("disk died", wrote=True).to_wire())
    assert isinstance(back, errors.LoadFailed) and back.wrote is True and back.cause is None


def test_a_409_weights_torn_is_a_refusal_and_a_500_is_a_tear() -> None:
    reply = {"status": "error", "code": "weights_torn", "message": "m"}
    assert type(errors.WeightSyncError.from_reply(reply, 409)) is errors.IllegalState
    assert type(errors.WeightSyncError.from_reply(reply, 500)) is errors.WeightsTorn


@pytest.mark.parametrize(
    "reply", [None, [], {"code": 5, "message": 7, "details": "x"}, {"details": {"code": 1}}]
)
def test_a_malformed_reply_still_becomes_a_family_error(reply: Any) -> None:
    exc = errors.WeightSyncError.from_reply(reply, 418)
    assert isinstance(exc, errors.EngineFailure) and isinstance(exc.message, str)


def test_from_reply_without_a_status_takes_the_replys_own_else_the_codes_owner_else_500() -> None:
    from_reply = errors.WeightSyncError.from_reply
    refused = from_reply({"code": "weights_torn", "message": "m", "http_status": 409})
    assert type(refused) is errors.IllegalState and refused.reply_status == 409
    assert type(from_reply({"code": "not_supported", "message": "m"})) is errors.NotSupported
    assert type(from_reply({"code": "weights_torn", "message": "m"})) is errors.WeightsTorn
    assert type(from_reply({"code": "payload_too_large"})) is errors.PayloadTooLarge
    assert type(from_reply({"code": "not_paused", "message": "m"})) is errors.EngineFailure  # no owner: 500
    assert type(from_reply({"code": "not_supported", "http_status": True})) is errors.NotSupported
    assert type(from_reply({"code": ["x"]})) is errors.EngineFailure
    for cls in FAMILY:  # the one-argument form round-trips every class through its wire form
        assert type(from_reply(cls("m").to_wire())) is cls
    assert type(from_reply({"code": "not_supported"}, 400)) is errors.InvalidRequest  # a status still wins


# ---------------------------------------------------------------------- sources

names = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=12)
store_names = st.text(st.sampled_from("abcXYZ019._-"), min_size=1, max_size=12)
tensor_specs = st.builds(
    TensorSpec, names, st.sampled_from(NAMES), st.lists(st.integers(0, 2**40), max_size=4).map(tuple)
)
spec_lists = st.lists(tensor_specs, min_size=1, max_size=4, unique_by=lambda t: t.name)
packings = st.none() | st.tuples(st.integers(1, 2**40), store_names)
handles = st.fixed_dictionaries({"shm": names, "offset": st.integers(0, 2**40)})
sources = st.one_of(
    st.builds(DiskSource, names, st.booleans(), st.booleans()),
    st.builds(
        lambda group, tensors, packing: DistributedSource(group, tensors, *(packing or ())),
        store_names, spec_lists, packings,
    ),
    st.builds(TensorSource, spec_lists.flatmap(lambda ts: st.tuples(*(st.builds(TensorHandle, st.just(t), handles) for t in ts)))),
)  # fmt: skip


@given(sources)
def test_every_source_round_trips_through_its_wire_form(source: Any) -> None:
    wire = json.loads(json.dumps(source.to_wire()))  # plain JSON: nothing typed crosses
    back = source_from_wire(wire)
    assert type(back) is type(source) and back == source and back.to_wire() == source.to_wire()
    assert type(source).from_wire(wire).to_wire() == source.to_wire()


@given(sources)
def test_a_sources_wire_form_is_its_body_form_tagged_with_its_kind(source: Any) -> None:
    wire = json.loads(json.dumps(source.to_wire()))
    body = {k: v for k, v in wire.items() if k != "kind"}
    parse = {"disk": UpdateRequest.from_disk_body, "distributed": UpdateRequest.from_distributed_body,
             "tensor": UpdateRequest.from_tensor_body}[wire["kind"]]  # fmt: skip
    assert parse(body).source == source_from_wire(wire) == source


_DIST = {"kind": "distributed", "names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "g"}


@pytest.mark.parametrize(
    "wire",
    [
        None, {}, {"kind": "carrier-pigeon"}, {"kind": "disk"}, {"kind": "disk", "model_path": 3},
        {**_DIST, "names": ["x", "y"]},
        {**_DIST, "shapes": 5},
        {**_DIST, "dtypes": ["float99"]},
        {**_DIST, "names": [], "dtypes": [], "shapes": []},
        {**_DIST, "names": ["x", "x"], "dtypes": ["float32"] * 2, "shapes": [[1]] * 2},
        {**_DIST, "packing": {"bucket_bytes": 0, "stream_id": "s"}},
        {**_DIST, "packing": {"bucket_bytes": 8, "stream_id": None}},
        {"kind": "tensor", "tensors": [{"name": "x", "dtype": "float32", "shape": [1], "handle": "no"}]},
        {"kind": "tensor", "tensors": []},
        {"kind": "tensor", "tensors": [], "extra": 1},
    ],
)  # fmt: skip
def test_a_malformed_wire_source_is_a_400_refusal(wire: Any) -> None:
    with pytest.raises(errors.InvalidRequest):
        source_from_wire(wire)


@pytest.mark.parametrize("name", ["", "a b", "g" * 129, "naïve", "a/b"])
def test_the_wire_form_bounds_group_names_and_stream_ids_as_the_body_does(name: str) -> None:
    for wire in ({**_DIST, "group_name": name}, {**_DIST, "packing": {"bucket_bytes": 8, "stream_id": name}}):
        with pytest.raises(errors.InvalidRequest) as err:
            source_from_wire(wire)
        assert err.value.code in ("invalid_value", "wrong_type")
        body = {k: v for k, v in wire.items() if k != "kind"}
        with pytest.raises(errors.InvalidRequest):
            UpdateRequest.from_distributed_body(body)


def test_a_group_request_round_trips_through_its_wire_form() -> None:
    group = InitGroupRequest("::1", 29500, 1, 3, "grp-1", "gloo", 5.5)
    assert InitGroupRequest.from_wire(json.loads(json.dumps(group.to_wire()))) == group
    assert InitGroupRequest.from_wire(group.to_wire()) == InitGroupRequest.from_body(group.to_wire())


@pytest.mark.parametrize(
    "change",
    [{"group_name": "a b"}, {"world_size": 1}, {"rank_offset": 3}, {"master_port": 0},
     {"backend": "mpi"}, {"timeout_s": -1}, {"surprise": 1}, {"world_size": True}],
)  # fmt: skip
def test_a_malformed_wire_group_request_is_refused_as_its_body_would_be(change: dict[str, Any]) -> None:
    wire = {**InitGroupRequest("127.0.0.1", 1234, 1, 2, "g", "gloo").to_wire(), **change}
    with pytest.raises(errors.InvalidRequest) as by_wire:
        InitGroupRequest.from_wire(wire)
    with pytest.raises(errors.InvalidRequest) as by_body:
        InitGroupRequest.from_body(wire)
    assert by_wire.value.code == by_body.value.code


# ---------------------------------------------------------------------- dtypes


def test_the_parser_accepts_exactly_the_dtype_table() -> None:
    body = {"names": ["x"], "shapes": [[1]], "group_name": "g"}
    for name in DTYPES:
        assert UpdateRequest.from_distributed_body({**body, "dtypes": [name]}).source.tensors[0].dtype == name
    with pytest.raises(errors.InvalidRequest):
        UpdateRequest.from_distributed_body({**body, "dtypes": ["float4"]})
    assert all(DTYPES[name].safetensors == code for code, name in BY_SAFETENSORS.items())


# ---------------------------------------------------------------------- optional features


def test_isinstance_finds_the_optional_features_an_engine_has() -> None:
    from weightsync.core.engine import GroupEngine, RpcEngine, StampingEngine

    class Grouped(ScriptableEngine):
        async def init_group(self, request: InitGroupRequest) -> None: ...

        async def destroy_group(self, group_name: str) -> None: ...

    assert isinstance(Grouped(), GroupEngine) and not isinstance(ScriptableEngine(), GroupEngine)
    assert isinstance(ScriptableEngine(), RpcEngine) and not isinstance(ScriptableEngine(), StampingEngine)


def test_an_engine_without_a_feature_gets_501_for_its_routes() -> None:
    controller = Controller(ScriptableEngine())
    group = InitGroupRequest("127.0.0.1", 1234, 1, 2, "g", "gloo")
    for call in (
        controller.init_group(group),
        controller.destroy_group("g"),
        controller.dry_run(UpdateRequest(DiskSource("ok:a"), dry_run=True)),
        controller.verify_weights(),
        controller.rpc("weight_hashes", (), {}),
    ):
        with pytest.raises(errors.NotSupported) as err:
            asyncio.run(call)
        assert err.value.http_status == 501
    assert controller.journal == type(controller.journal)()  # nothing ran


# ---------------------------------------------------------------------- the update steps


def test_the_update_steps_fire_begin_then_the_ending_and_declares_only_a_versioned_success() -> None:
    assert UpdateSteps(declares=True).triggers(SUCCEEDED) == ("begin_update", "update_succeeded", "declare")
    assert UpdateSteps().triggers(SUCCEEDED) == ("begin_update", "update_succeeded")
    assert UpdateSteps(declares=True).triggers(TORE) == ("begin_update", "update_tore")
    assert UpdateSteps(declares=True).triggers(REFUSED) == ("begin_update",)
    assert UpdateSteps(dry_run=True).triggers(SUCCEEDED) == ("dry_run",)
    drawn = {c.triggers for c in COMMANDS}
    assert {UpdateSteps(declares=True).triggers(SUCCEEDED), UpdateSteps().triggers(TORE)} <= drawn
