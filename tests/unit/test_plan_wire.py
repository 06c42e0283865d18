"""A plan part's wire forms: the compact one (``weightsync.plan_part/2``, what the trainer
posts) and the first one (``/1``, still read), read as strictly as each other, and a part of
real size (1,000 tensors, 64 FSDP ranks into TP=8) under the default body limit."""

from __future__ import annotations

import asyncio
import copy
import json

import pytest

from weightsync.core.errors import InvalidRequest
from weightsync.core.plan.build import make_plan
from weightsync.core.plan.check import check_part
from weightsync.core.plan.layouts import FleetLayout, TrainerLayout, WorkerLayout, tp_dims
from weightsync.core.plan.value import PART_FORMAT, PART_FORMAT_V1, PlanPart, kept_if_accepted
from weightsync.core.snapshot import TensorSpec
from weightsync.core.validation import strict_loads
from weightsync.planner import fleet_layout, reference_specs, trainer_layout
from weightsync.serve.app import DEFAULT_MAX_BODY

pytestmark = pytest.mark.unit

TINY = reference_specs("tiny")


def real_sized_specs() -> list[TensorSpec]:
    names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "input_layernorm"]
    return [
        TensorSpec(
            f"model.layers.{i // 8}.x.{names[i % 8]}.weight", "bfloat16", (512, 512) if i % 8 != 7 else (512,)
        )
        for i in range(1000)
    ]


def small_part() -> PlanPart:
    return make_plan(trainer_layout(TINY, 3, "fsdp"), fleet_layout(TINY, (2,))).part(0)


def wire_of(part: PlanPart, compact: bool = True) -> dict:
    return json.loads(json.dumps(part.to_wire(compact=compact)))


def test_the_trainer_writes_the_compact_form_and_both_forms_read_back_to_the_same_part():
    part = small_part()
    new, old = wire_of(part), wire_of(part, compact=False)
    assert new["format"] == PART_FORMAT == "weightsync.plan_part/2"
    assert old["format"] == PART_FORMAT_V1 == "weightsync.plan_part/1"
    t = new["transfers"][0]
    assert set(t) == {"index", "round", "src", "rank", "dst", "buffer", "size", "tensor", "offset", "box"}
    assert len(t["tensor"]) == len(t["offset"]) == len(part.transfers[0].pieces)
    assert PlanPart.from_wire(new) == part
    assert PlanPart.from_wire(old) == part
    # every piece's byte size, which the compact form leaves out, is its box's
    assert [p.nbytes for t in PlanPart.from_wire(new).transfers for p in t.pieces] == [
        p.nbytes for t in part.transfers for p in t.pieces
    ]


def _first(w: dict) -> dict:
    return w["transfers"][0]


def _nested(depth: int) -> list:
    v: list = [0]
    for _ in range(depth):
        v = [v]
    return v


HOSTILE = {
    "offsets_shorter_than_pieces": lambda w: _first(w)["offset"].pop(),
    "tensor_indices_shorter_than_offsets": lambda w: _first(w)["tensor"].pop(),
    "box_one_bound_short": lambda w: _first(w)["box"].pop(),
    "box_one_bound_long": lambda w: _first(w)["box"].append(0),
    "tensor_index_out_of_range": lambda w: _first(w)["tensor"].__setitem__(0, len(w["tensors"])),
    "tensor_index_negative": lambda w: _first(w)["tensor"].__setitem__(0, -1),
    "tensor_index_a_bool": lambda w: _first(w)["tensor"].__setitem__(0, True),
    "tensor_index_a_float": lambda w: _first(w)["tensor"].__setitem__(0, 0.0),
    "tensor_index_a_string": lambda w: _first(w)["tensor"].__setitem__(0, "0"),
    "tensor_index_a_name": lambda w: _first(w)["tensor"].__setitem__(0, w["tensors"][0]["name"]),
    "offset_negative": lambda w: _first(w)["offset"].__setitem__(0, -64),
    "offset_overflowing": lambda w: _first(w)["offset"].__setitem__(0, 1 << 64),
    "offset_a_bool": lambda w: _first(w)["offset"].__setitem__(0, False),
    "box_start_negative": lambda w: _first(w)["box"].__setitem__(0, -1),
    "box_stop_past_the_tensor": lambda w: _first(w)["box"].__setitem__(1, 10**9),
    "box_stop_overflowing": lambda w: _first(w)["box"].__setitem__(1, 1 << 80),
    "box_stop_before_start": lambda w: _first(w)["box"].__setitem__(0, _first(w)["box"][1] + 1),
    "box_a_bool": lambda w: _first(w)["box"].__setitem__(0, False),
    "box_nested_deeply": lambda w: _first(w)["box"].__setitem__(0, _nested(500)),
    "box_pairs_not_flat": lambda w: _first(w).update(box=[[0, 1]] * (len(_first(w)["box"]) // 2)),
    "box_an_object": lambda w: _first(w).update(box={"0": 0}),
    "tensor_missing": lambda w: _first(w).pop("tensor"),
    "tensor_null": lambda w: _first(w).update(tensor=None),
    "pieces_beside_the_compact_lists": lambda w: _first(w).update(pieces=[]),
    "nbytes_field": lambda w: _first(w).update(nbytes=[1]),
    "huge_tensor_list": lambda w: _first(w).update(tensor=[0] * ((1 << 20) + 1)),
    "huge_box_list": lambda w: _first(w).update(box=[0] * (32 * len(_first(w)["tensor"]) + 2)),
    "huge_box_list_of_junk": lambda w: _first(w).update(box=["x"] * (1 << 22)),
    "v1_pieces_under_the_v2_format": lambda w: w.update(
        transfers=[dict(t, pieces=[]) for t in wire_of(small_part(), compact=False)["transfers"]]
    ),
    "unknown_format": lambda w: w.update(format="weightsync.plan_part/3"),
    "format_missing": lambda w: w.pop("format"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_compact_part_is_refused_with_a_code(name):
    wire = wire_of(small_part())
    HOSTILE[name](wire)
    with pytest.raises(InvalidRequest) as exc:
        PlanPart.from_wire(wire)
    assert exc.value.code == "invalid_layout", exc.value


def test_the_compact_form_speaks_of_boxes_in_each_tensors_own_dims():
    """A box is read with its own tensor's rank: a 1-D tensor's piece takes 2 numbers, a
    2-D one's 4, so moving a 2-D piece's index onto a 1-D tensor breaks the count."""
    part = small_part()
    wire = wire_of(part)
    dims = [len(s["shape"]) for s in wire["tensors"]]
    t = next(t for t in wire["transfers"] if any(dims[k] == 2 for k in t["tensor"]))
    one_d = dims.index(1)
    t["tensor"][next(i for i, k in enumerate(t["tensor"]) if dims[k] == 2)] = one_d
    with pytest.raises(InvalidRequest) as exc:
        PlanPart.from_wire(wire)
    assert exc.value.code == "invalid_layout"


def test_a_well_formed_compact_part_that_is_not_the_workers_is_a_layout_mismatch():
    """The wire form decides nothing the part check did: a piece re-pointed at another tensor
    of the same shape still parses and is refused by the check."""
    fleet = fleet_layout(TINY, (2,))
    part = make_plan(trainer_layout(TINY, 3, "fsdp"), fleet).part(0)
    w = fleet.workers[0]
    served = [w.served(r) for r in range(w.world_size)]
    wire = wire_of(part)
    check_part(PlanPart.from_wire(wire), served, w.tensors)
    shapes = [tuple(s["shape"]) for s in wire["tensors"]]
    t = wire["transfers"][0]
    k = t["tensor"][0]
    other = next(i for i, s in enumerate(shapes) if s == shapes[k] and i != k)
    t["tensor"][0] = other
    moved = PlanPart.from_wire(wire)
    assert moved.transfers[0].pieces[0].name == wire["tensors"][other]["name"]
    with pytest.raises(InvalidRequest) as exc:
        check_part(moved, served, w.tensors)
    assert exc.value.code == "layout_mismatch"


def test_a_real_sized_part_fits_the_default_body_and_reads_back_equal_in_both_forms():
    specs = real_sized_specs()
    trainer = TrainerLayout.fsdp(specs, 64)
    worker = WorkerLayout.tensor_parallel("w0", specs, 8, tp_dims(specs, shard_embeddings=False))
    part = make_plan(trainer, FleetLayout((worker,))).part(0)
    assert sum(len(t.pieces) for t in part.transfers) == 232_000
    new = json.dumps(part.to_wire(), separators=(",", ":"))
    old = json.dumps(part.to_wire(compact=False), separators=(",", ":"))
    assert len(new.encode()) < DEFAULT_MAX_BODY < len(old.encode())
    got = PlanPart.from_wire(strict_loads(new))
    assert got == PlanPart.from_wire(strict_loads(old)) == part
    check_part(got, [worker.served(r) for r in range(worker.world_size)], worker.tensors)


def test_the_same_compact_wire_is_parsed_once_and_a_changed_copy_is_not():
    wire = wire_of(small_part())
    first = PlanPart.from_wire(wire)
    assert PlanPart.from_wire(copy.deepcopy(wire)) is first
    changed = copy.deepcopy(wire)
    changed["transfers"][0]["offset"][0] = float(changed["transfers"][0]["offset"][0])  # equal under ==
    with pytest.raises(InvalidRequest) as exc:
        PlanPart.from_wire(changed)
    assert exc.value.code == "invalid_layout"


def test_a_part_listing_more_pieces_than_the_part_cap_is_refused_before_any_is_built():
    """Each transfer under its own cap, together over the part's: refused by the count alone
    (their offsets and boxes are never read), so a body of small integers cannot make the
    worker build millions of pieces."""
    from weightsync.core.plan.value import MAX_PART_PIECES, MAX_TRANSFER_PIECES

    wire = wire_of(small_part())
    many = [0] * MAX_TRANSFER_PIECES
    wire["transfers"] = [
        dict(_first(wire), tensor=many) for _ in range(MAX_PART_PIECES // MAX_TRANSFER_PIECES + 1)
    ]
    with pytest.raises(InvalidRequest) as exc:
        PlanPart.from_wire(wire)
    assert exc.value.code == "invalid_layout" and f"more than {MAX_PART_PIECES} pieces" in exc.value.message


def test_a_part_parsed_for_a_request_is_kept_only_when_the_request_is_accepted():
    accepted = wire_of(small_part())
    refused = wire_of(make_plan(trainer_layout(TINY, 2, "fsdp"), fleet_layout(TINY, (1,))).part(0))

    async def request(wire: dict, refuse: bool) -> PlanPart:
        with kept_if_accepted():
            part = await asyncio.to_thread(PlanPart.from_wire, wire)  # as dispatch parses an update
            if refuse:
                raise InvalidRequest("refused after parsing", code="unknown_group")
        return part

    kept = asyncio.run(request(accepted, refuse=False))
    assert PlanPart.from_wire(json.loads(json.dumps(accepted))) is kept  # kept: not parsed anew
    with pytest.raises(InvalidRequest):
        asyncio.run(request(refused, refuse=True))
    # the refused request's parse was not kept, and the accepted one's still is
    assert PlanPart.from_wire(json.loads(json.dumps(accepted))) is kept
    with kept_if_accepted():
        first = PlanPart.from_wire(refused)
        assert PlanPart.from_wire(accepted) is kept  # replaced only once the request ends well
    assert PlanPart.from_wire(refused) is first
