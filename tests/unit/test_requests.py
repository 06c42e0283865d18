"""Parsing at the edge: strict types, required and unknown fields, precise codes."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weightsync.core.errors import InvalidRequest
from weightsync.core.requests import (
    EngineRpcRequest,
    InitGroupRequest,
    PauseRequest,
    SetWeightVersion,
    UpdateRequest,
)
from weightsync.core.routes import ROUTES
from weightsync.core.snapshot import Declared, PauseMode
from weightsync.core.sources import DiskSource, DistributedSource
from weightsync.testing import json_values, not_booleans

PARSERS = {name: r.parser for name, r in ROUTES.items() if r.parser is not None}


def code_of(parse: Any, body: Any) -> str:
    with pytest.raises(InvalidRequest) as err:
        parse(body)
    assert err.value.http_status == 400
    assert err.value.message
    return err.value.code


@pytest.mark.parametrize("route", sorted(PARSERS))
@pytest.mark.parametrize("body", [[], "x", 3, None, True, [{"a": 1}]])
def test_every_route_refuses_a_body_that_is_not_an_object(route: str, body: Any) -> None:
    assert code_of(PARSERS[route], body) == "not_an_object"


@pytest.mark.parametrize("route", sorted(PARSERS))
def test_every_route_refuses_unknown_fields(route: str) -> None:
    assert code_of(PARSERS[route], {"surprise": 1}) == "unknown_field"


@given(value=json_values())
def test_any_json_value_is_a_version_and_null_is_distinct_from_undeclared(value: Any) -> None:
    req = SetWeightVersion.from_body({"weight_version": value})
    assert req.version == Declared(value)


def test_set_weight_version_requires_the_field() -> None:
    assert code_of(SetWeightVersion.from_body, {}) == "missing_field"
    assert SetWeightVersion.from_body({"weight_version": None}).version == Declared(None)


@given(bad=not_booleans)
def test_booleans_are_strict(bad: Any) -> None:
    assert code_of(PauseRequest.from_body, {"clear_cache": bad}) == "wrong_type"
    body = {"model_path": "/x", "allow_unpaused": bad}
    assert code_of(UpdateRequest.from_disk_body, body) == "wrong_type"


def test_pause_defaults_and_modes() -> None:
    assert PauseRequest.from_body({}) == PauseRequest(PauseMode.KEEP, False)
    assert PauseRequest.from_body({"mode": "abort", "clear_cache": True}).mode is PauseMode.ABORT
    assert code_of(PauseRequest.from_body, {"mode": "stop"}) == "invalid_value"
    assert code_of(PauseRequest.from_body, {"mode": 1}) == "wrong_type"


def test_update_defaults_reset_cache_only_when_paused_updates() -> None:
    req = UpdateRequest.from_disk_body({"model_path": "/ckpt"})
    assert req == UpdateRequest(DiskSource("/ckpt"), None, False, True)
    unpaused = UpdateRequest.from_disk_body({"model_path": "/ckpt", "allow_unpaused": True})
    assert unpaused.reset_prefix_cache is False


def test_update_refuses_allow_unpaused_with_explicit_cache_reset() -> None:
    body = {"model_path": "/ckpt", "allow_unpaused": True, "reset_prefix_cache": True}
    assert code_of(UpdateRequest.from_disk_body, body) == "conflicting_options"


def test_update_distinguishes_omitted_from_null_version() -> None:
    assert UpdateRequest.from_disk_body({"model_path": "/c"}).version is None
    assert UpdateRequest.from_disk_body({"model_path": "/c", "weight_version": None}).version == Declared(
        None
    )


def test_update_requires_a_non_empty_string_path() -> None:
    assert code_of(UpdateRequest.from_disk_body, {}) == "missing_field"
    assert code_of(UpdateRequest.from_disk_body, {"model_path": ""}) == "invalid_value"
    assert code_of(UpdateRequest.from_disk_body, {"model_path": 3}) == "wrong_type"


def test_distributed_update_metadata() -> None:
    body = {"names": ["a", "b"], "dtypes": ["bfloat16", "torch.float32"], "shapes": [[2, 3], []],
            "group_name": "g", "packing": {"bucket_bytes": 1024, "stream_id": "s1"}}  # fmt: skip
    req = UpdateRequest.from_distributed_body(body)
    assert isinstance(req.source, DistributedSource)
    assert [t.dtype for t in req.source.tensors] == ["bfloat16", "float32"]
    assert req.source.tensors[1].shape == () and req.source.bucket_bytes == 1024
    assert req.source.stream_id == "s1"
    unpacked = UpdateRequest.from_distributed_body({k: v for k, v in body.items() if k != "packing"})
    assert unpacked.source.bucket_bytes is None  # type: ignore[union-attr]
    for bad, code in [
        ({**body, "names": ["a"]}, "invalid_value"),
        ({**body, "names": ["a", "a"]}, "duplicate_tensor"),
        ({**body, "dtypes": ["bfloat16", "float33"]}, "invalid_value"),
        ({**body, "shapes": [[2, -3], []]}, "invalid_value"),
        ({**body, "shapes": [[2, 3.0], []]}, "wrong_type"),
        ({**body, "shapes": [[2, True], []]}, "wrong_type"),
        ({**body, "packing": {"bucket_bytes": 0, "stream_id": "s"}}, "invalid_value"),
        ({**body, "packing": {"buckets": 2}}, "unknown_field"),
        ({**body, "packing": {"bucket_bytes": 8}}, "missing_field"),
    ]:
        assert code_of(UpdateRequest.from_distributed_body, bad) == code, bad


def test_tensor_update_needs_handles() -> None:
    t = {"name": "w", "dtype": "float32", "shape": [2], "handle": {"shm": "x", "offset": 0}}
    req = UpdateRequest.from_tensor_body({"tensors": [t]})
    assert req.source.tensors[0].spec.name == "w"  # type: ignore[union-attr]
    assert code_of(UpdateRequest.from_tensor_body, {"tensors": []}) == "invalid_value"
    assert code_of(UpdateRequest.from_tensor_body, {"tensors": [{**t, "handle": 1}]}) == "wrong_type"


def test_init_group_fields_are_validated() -> None:
    ok = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2,
          "group_name": "g", "backend": "gloo", "timeout_s": 5}  # fmt: skip
    assert InitGroupRequest.from_body(ok).timeout_s == 5.0
    assert InitGroupRequest.from_body({k: v for k, v in ok.items() if k != "backend"}).backend == "nccl"
    for bad, code in [
        ({**ok, "master_port": 70000}, "invalid_value"),
        ({**ok, "master_port": "29500"}, "wrong_type"),
        ({**ok, "rank_offset": 0}, "invalid_value"),
        ({**ok, "rank_offset": 2}, "invalid_value"),
        ({**ok, "backend": "mpi"}, "invalid_value"),
        ({**ok, "timeout_s": 0}, "invalid_value"),
        ({**ok, "timeout_s": True}, "wrong_type"),
        ({k: v for k, v in ok.items() if k != "group_name"}, "missing_field"),
    ]:
        assert code_of(InitGroupRequest.from_body, bad) == code, bad


def test_engine_rpc_only_accepts_allow_listed_methods() -> None:
    req = EngineRpcRequest.from_body({"method": "weight_hashes"}, allowed=["weight_hashes"])
    assert req.method == "weight_hashes" and req.args == ()
    with pytest.raises(InvalidRequest) as err:
        EngineRpcRequest.from_body({"method": "__del__"}, allowed=["weight_hashes"])
    assert err.value.code == "method_not_allowed"


@given(body=st.dictionaries(st.text(max_size=8), json_values(max_leaves=3), max_size=4))
def test_parsers_only_ever_raise_invalid_request(body: dict[str, Any]) -> None:
    for parse in PARSERS.values():
        with contextlib.suppress(InvalidRequest):
            parse(body)


def test_a_disk_updates_label_comes_from_its_weight_version_never_from_the_caller() -> None:
    """The reader holds ``label`` against the checkpoint's manifest: only the update's own
    ``weight_version`` sets it (and it crosses a process boundary with the source)."""
    from weightsync.core.errors import InvalidRequest
    from weightsync.core.requests import UpdateRequest
    from weightsync.core.sources import source_from_wire

    with pytest.raises(InvalidRequest) as err:
        UpdateRequest.from_disk_body({"model_path": "/x", "label": ["forged"]})
    assert err.value.code == "unknown_field"
    labelled = UpdateRequest.from_disk_body({"model_path": "/x", "weight_version": None})
    assert labelled.source.label == [None]  # a declared null is a label too
    assert source_from_wire(labelled.source.to_wire()) == labelled.source
    assert UpdateRequest.from_disk_body({"model_path": "/x"}).source.label is None
