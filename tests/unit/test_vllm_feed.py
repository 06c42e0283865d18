"""`engines.vllm.feed`: the scratch pool lends memory again only once nothing refers to it,
and `feed` hands tensors on in order and ends its reading thread however the consumer ends."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from weightsync.core.snapshot import TensorSpec
from weightsync.engines.vllm.feed import FeedTarget, ScratchPool, feed

SPEC = TensorSpec("w", "float32", (4, 8))


def _specs(n: int) -> list[TensorSpec]:
    return [TensorSpec(f"t{i}", "float32", (4, 8)) for i in range(n)]


def _feeders() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "weightsync-feed"]


def test_scratch_is_lent_again_only_once_nothing_refers_to_it() -> None:
    pool = ScratchPool()
    first = pool.lend(SPEC)
    address = first.data_ptr()
    view = first.narrow(0, 1, 2)  # what a weight loader may keep of a tensor
    del first
    other = pool.lend(SPEC)
    assert other.data_ptr() != address  # the view still refers to the first buffer
    array = view.numpy()
    del view, other
    assert pool.lend(SPEC).data_ptr() != address  # so does a numpy array over it
    del array
    assert pool.lend(SPEC).data_ptr() == address


def test_trim_forgets_memory_something_kept() -> None:
    pool = ScratchPool()
    kept = pool.lend(SPEC)  # say a loader made it a parameter
    pool.lend(TensorSpec("x", "float32", (2,)))
    pool.trim()
    assert pool.nbytes == 2 * 4  # only the free buffer stays
    assert pool.lend(SPEC).data_ptr() != kept.data_ptr()


def _stream(target: FeedTarget, specs: list[TensorSpec], fail_after: int | None = None) -> Iterator[None]:
    for i, spec in enumerate(specs):
        if fail_after is not None and i == fail_after:
            raise OSError("short read")
        t = target.buffer(spec, torch.device("cpu"))
        assert t is not None
        t.fill_(i)
        target.accept(spec, t, f"h{i}")
        yield


def test_feed_hands_every_tensor_on_in_order_with_its_hash() -> None:
    specs = _specs(6)
    target = FeedTarget(ScratchPool(), ahead=3 * 4 * 8 * 4)
    got = [(name, float(t[0, 0])) for name, t in feed(_stream(target, specs), target)]
    assert got == [(s.name, float(i)) for i, s in enumerate(specs)]
    assert (
        target.wrote
        and target.tensors == 6
        and target.hashes == {s.name: f"h{i}" for i, s in enumerate(specs)}
    )
    assert _feeders() == []


def test_a_reader_failure_reaches_the_consumer_after_what_was_read_before_it() -> None:
    target = FeedTarget(ScratchPool())
    taken = []
    with pytest.raises(OSError, match="short read"):
        for name, _ in feed(_stream(target, _specs(5), fail_after=2), target):
            taken.append(name)
    # Those read before the failure are handed on first, as a reader in vLLM's thread would.
    assert taken == ["t0", "t1"] and isinstance(target.error, OSError)
    assert target.tensors == 2 and set(target.hashes) == set(taken)
    assert _feeders() == []


def test_a_consumer_that_stops_pulling_ends_the_reading_thread() -> None:
    target = FeedTarget(ScratchPool(), ahead=0)  # the reader waits for the consumer
    stream = feed(_stream(target, _specs(50)), target)
    next(stream)
    stream.close()
    assert _feeders() == [] and target.tensors == 1


def test_a_consumer_failure_ends_the_reading_thread() -> None:
    target = FeedTarget(ScratchPool(), ahead=0)
    with pytest.raises(RuntimeError):
        for _ in feed(_stream(target, _specs(50)), target):
            raise RuntimeError("vLLM broke")
    assert _feeders() == []
