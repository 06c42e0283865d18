"""Where a plan's piece lies in a tensor's bytes (run_start), and the streaming hash of a
tensor fed by its pieces (Streams): checked against torch's own views and a one-shot hash."""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync.core.plan.boxes import Box
from weightsync.transports.hashing import tensor_hash
from weightsync.transports.plan.pieces import flat_bytes, run_start
from weightsync.transports.plan.streams import Streams


@st.composite
def boxes(draw: st.DrawFn) -> tuple[tuple[int, ...], Box, Box]:
    """A tensor shape, the box a rank serves of it, and a box inside that."""
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=4)))
    served, box = [], []
    for n in shape:
        a = draw(st.integers(0, n - 1))
        b = draw(st.integers(a + 1, n))
        c = draw(st.integers(a, b - 1))
        d = draw(st.integers(c + 1, b))
        served.append((a, b))
        box.append((c, d))
    return shape, Box(tuple(served)), Box(tuple(box))


@settings(max_examples=300, deadline=None)
@given(boxes())
def test_run_start_is_where_torch_puts_a_contiguous_box(case: tuple[tuple[int, ...], Box, Box]) -> None:
    _, served, box = case
    local = torch.arange(served.numel, dtype=torch.float32).reshape(served.shape)
    rel = box.relative_to(served)
    view = local[tuple(slice(a, b) for a, b in rel.bounds)]
    start = run_start(local.shape, served, box, local.element_size())
    if view.is_contiguous():
        assert start == view.data_ptr() - local.data_ptr()
    else:
        assert start is None


def test_a_tensor_streamed_in_pieces_in_any_order_hashes_as_a_whole() -> None:
    t = torch.randn(64, 8)
    flat = flat_bytes(t)
    assert flat is not None
    rows = [(i * 8, (i + 1) * 8) for i in range(8)]  # eight dim-0 pieces of eight rows
    for seed in range(5):
        order = rows[:]
        random.Random(seed).shuffle(order)
        s = Streams()
        for a, b in order:
            s.feed("w", flat, a * 32, (b - a) * 32)
        assert s.result("w", flat.nbytes) == tensor_hash(t)


def test_pieces_that_overlap_or_leave_a_gap_give_no_stream_hash() -> None:
    t = torch.randn(16, 4)
    flat = flat_bytes(t)
    assert flat is not None
    overlap = Streams()
    for start, n in [(0, 128), (64, 128), (128, 128)]:  # the middle piece rewrites fed bytes
        overlap.feed("w", flat, start, n)
    assert overlap.result("w", flat.nbytes) is None
    gap = Streams()
    for start, n in [(0, 64), (128, 128)]:
        gap.feed("w", flat, start, n)
    assert gap.result("w", flat.nbytes) is None
    twice = Streams()
    for start, n in [(128, 128), (128, 128), (0, 128)]:
        twice.feed("w", flat, start, n)
    assert twice.result("w", flat.nbytes) is None
    broken = Streams()
    broken.feed("w", flat, 0, 128)
    broken.broken("w")  # a piece that was not one run
    broken.feed("w", flat, 128, 128)
    assert broken.result("w", flat.nbytes) is None
