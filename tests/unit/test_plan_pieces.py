"""The part check is near-linear in pieces, with a documented cap: fine tilings pass, any
overlap is found, and a part past the cap is refused with ``too_many_pieces``.

Failed on the previous code: ``overlapping`` compared boxes that differ on two dims pairwise,
so a 16,384-piece tiling took minutes and a 170k-piece part kept the update queue busy for
hours, with no cap to refuse it."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weightsync.core.errors import InvalidRequest
from weightsync.core.plan.boxes import MAX_TILE_PIECES, Box, overlapping
from weightsync.core.plan.check import check_part
from weightsync.core.plan.value import Piece, PlanPart, Transfer
from weightsync.core.snapshot import TensorSpec

pytestmark = pytest.mark.unit


def tiled_part(rows: int, cols: int, *, shift: tuple[int, int] | None = None) -> PlanPart:
    """One float32 tensor ``[rows, cols]`` cut into 1×1 pieces, all in one packed transfer;
    ``shift`` moves the last piece onto that cell (an overlap, and a hole)."""
    spec = TensorSpec("w", "float32", (rows, cols))
    cells = list(itertools.product(range(rows), range(cols)))
    if shift is not None:
        cells[-1] = shift
    pieces = tuple(Piece("w", Box(((r, r + 1), (c, c + 1))), 4 * i, 4) for i, (r, c) in enumerate(cells))
    size = 4 * len(pieces)
    transfer = Transfer(0, 0, 0, 0, 0, 1, 0, size, pieces)
    return PlanPart("http://w:80", 0, 1, 1, 2, max(size, 64), (spec,), (transfer,))


def check(part: PlanPart) -> None:
    spec = part.tensors[0]
    check_part(part, [{"w": Box.full(spec.shape)}], [spec])


def test_a_fine_tiling_passes_and_one_overlapping_piece_is_found() -> None:
    check(tiled_part(128, 128))  # 16,384 pieces
    with pytest.raises(InvalidRequest) as err:
        check(tiled_part(128, 128, shift=(5, 7)))
    assert err.value.code == "layout_mismatch" and "overlaps" in err.value.message


def test_a_tiling_at_the_cap_passes_and_a_170k_piece_part_is_refused_by_it() -> None:
    check(tiled_part(256, MAX_TILE_PIECES // 256))
    with pytest.raises(InvalidRequest) as err:
        check(tiled_part(425, 400))  # 170,000 pieces of one tensor on one rank
    assert err.value.code == "too_many_pieces" and str(MAX_TILE_PIECES) in err.value.message


def brute(boxes: list[Box]) -> bool:
    return any(a.intersect(b) is not None for a, b in itertools.combinations(boxes, 2))


bounds = st.tuples(st.integers(0, 6), st.integers(0, 3)).map(lambda t: (t[0], t[0] + t[1]))


@given(st.integers(1, 4).flatmap(lambda d: st.lists(st.tuples(*[bounds] * d), max_size=12)))
def test_overlapping_agrees_with_comparing_every_pair(raw: list[tuple[tuple[int, int], ...]]) -> None:
    boxes = [Box(b) for b in raw]
    found = overlapping(boxes)
    assert (found is not None) == brute(boxes)
    if found is not None:
        assert found[0].intersect(found[1]) is not None
