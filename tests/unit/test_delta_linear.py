"""The linear digest and the apply step, one module each: the O(changed) update equals a full
recomputation, any changed bit moves the digest, and apply undoes or re-raises honestly."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync.transports.delta import linear
from weightsync.transports.delta.apply import Patch, apply, bits
from weightsync.transports.delta.manifest import DeltaManifest, TensorDelta
from weightsync.transports.failures import Undone
from weightsync.transports.hashing import tensor_hash

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float64, torch.uint8]


def _tensor(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(
        0, 256, (n * torch.empty((), dtype=dtype).element_size(),), generator=gen, dtype=torch.uint8
    )
    return raw.view(dtype)


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    n=st.integers(1, 9000),
    seed=st.integers(0, 2**16),
    k=st.integers(1, 50),
)
def test_the_change_over_changed_elements_equals_a_full_recomputation(
    dtype: torch.dtype, n: int, seed: int, k: int
) -> None:
    a = _tensor(dtype, n, seed)
    b = a.clone()
    gen = torch.Generator().manual_seed(seed + 1)
    idx = torch.randperm(n, generator=gen)[: min(k, n)].sort().values
    b[idx] = _tensor(dtype, idx.numel(), seed + 2)
    positions, old = linear.element_words(idx, a[idx])
    _, new = linear.element_words(idx, b[idx])
    assert linear.change(positions, old, new) == linear.moved(
        linear.tensor_digest(a), linear.tensor_digest(b)
    )


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 20000), seed=st.integers(0, 2**16), bit=st.integers(0, 31))
def test_any_flipped_bit_moves_the_digest(n: int, seed: int, bit: int) -> None:
    a = _tensor(torch.float32, n, seed)
    b = a.clone()
    j = seed % n
    bits(b)[j] ^= torch.tensor(1 << bit if bit < 31 else -(1 << 31), dtype=torch.int32)
    assert linear.tensor_digest(a) != linear.tensor_digest(b)


def test_two_opposite_changes_do_not_cancel() -> None:
    """A structured error (+d at one word, -d at the next) is still caught."""
    a = torch.zeros(10000, dtype=torch.int16).view(torch.bfloat16)
    b = a.clone()
    bits(b)[4096] += 3
    bits(b)[4097] -= 3
    assert linear.tensor_digest(a) != linear.tensor_digest(b)


def _patch(t: torch.Tensor, name: str, idx: list[int], values: list[float]) -> Patch:
    new = t.clone()
    index = torch.tensor(idx, dtype=torch.int64)
    new[index] = torch.tensor(values, dtype=t.dtype)
    entry = TensorDelta(name, "float32", tuple(t.shape), len(idx), tensor_hash(t), tensor_hash(new),
                        tuple(linear.tensor_digest(t)), tuple(linear.tensor_digest(new)), "i", "v")  # fmt: skip
    return Patch(entry, index, torch.tensor(values, dtype=t.dtype))


def _fault(on: str, after: int = 0) -> object:
    seen: list[str] = []

    def fault(stage: str, name: str) -> None:
        seen.append(stage)
        if stage == on and seen.count(on) > after:
            raise RuntimeError(f"injected at {stage}")

    return fault


def test_a_fault_after_the_first_write_is_undone_and_proven() -> None:
    targets = {"a": torch.arange(10, dtype=torch.float32), "b": torch.arange(10, dtype=torch.float32) * 2}
    before = {n: t.clone() for n, t in targets.items()}
    patches = [_patch(targets["a"], "a", [1, 5], [9.0, 9.0]), _patch(targets["b"], "b", [0], [7.0])]
    with pytest.raises(Undone) as caught:
        apply(patches, targets, "sparse", fault=_fault("wrote", after=1))  # fails after writing "b"
    assert caught.value.tensors == 2
    assert all(torch.equal(targets[n], before[n]) for n in targets)


def test_a_restore_that_fails_reraises_so_the_worker_tears() -> None:
    targets = {"a": torch.arange(10, dtype=torch.float32)}
    patches = [_patch(targets["a"], "a", [1], [9.0])]

    def fault(stage: str, name: str) -> None:
        raise RuntimeError(f"injected at {stage}")

    with pytest.raises(RuntimeError, match="injected at wrote"):
        apply(patches, targets, "sparse", fault=fault)


def test_a_clean_apply_reaches_the_target_bit_for_bit() -> None:
    t = torch.arange(10, dtype=torch.float32)
    target = t.clone()
    target[3] = -1.0
    apply([_patch(t, "a", [3], [-1.0])], {"a": t}, "sparse")
    assert torch.equal(t, target)


def test_a_manifest_survives_its_json_round_trip() -> None:
    t = torch.arange(4, dtype=torch.float32)
    entry = _patch(t, "a", [1], [5.0]).entry
    from weightsync.core.held import weights_digest
    from weightsync.transports.delta.manifest import Point

    m = DeltaManifest("sparse", Point("A", weights_digest({"a": entry.base_hash})),
                      Point("B", weights_digest({"a": entry.target_hash})), {"a": entry})  # fmt: skip
    assert DeltaManifest.from_json(m.to_json()) == m


@pytest.mark.parametrize(("n", "check"), [(100_000, "linear"), (200, "rehash")])
def test_the_cheaper_check_is_chosen_and_both_catch_a_wrong_value(n: int, check: str) -> None:
    t = torch.zeros(n, dtype=torch.float32)
    good = _patch(t, "a", [3, 7], [1.0, 2.0])
    assert apply([good], {"a": t.clone()}, "sparse")[check] == 1
    bad = Patch(good.entry, good.indices, torch.tensor([1.0, 2.5]))
    target = t.clone()
    with pytest.raises(Undone) as caught:
        apply([bad], {"a": target}, "sparse")
    assert f"({check})" in str(caught.value.cause) and torch.equal(target, t)


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 20_000), st.integers(0, 40)), min_size=1, max_size=6),
    st.integers(0, 99),
)
def test_the_batched_change_of_many_tensors_equals_each_ones_own(
    shapes: list[tuple[int, int]], seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    segments, positions, olds, news, expected = [], [], [], [], []
    for i, (n, k) in enumerate(shapes):
        dtype = (torch.float32, torch.bfloat16, torch.uint8)[i % 3]
        old = torch.randint(0, 256, (n * 4,), dtype=torch.uint8, generator=gen).view(dtype)[:n]
        idx = torch.randperm(n, generator=gen)[: min(k, n)].sort().values
        new = old.clone()
        bits(new)[idx] = bits(new)[idx] ^ 1
        where, old_w = linear.element_words(idx, old[idx])
        _, new_w = linear.element_words(idx, new[idx])
        expected.append(linear.change(where, old_w, new_w))
        assert linear.change(where, old_w, new_w) == linear.moved(
            linear.tensor_digest(old), linear.tensor_digest(new)
        )
        segments.append(torch.full((where.numel(),), i, dtype=torch.int64))
        positions.append(where), olds.append(old_w), news.append(new_w)
    got = linear.changes(
        torch.cat(segments), torch.cat(positions), torch.cat(olds), torch.cat(news), len(shapes)
    )
    assert got == expected


def test_a_wrong_claim_among_many_linearly_checked_tensors_is_named_and_everything_undone() -> None:
    targets = {n: torch.zeros(100_000, dtype=torch.float32) for n in "abc"}
    before = {n: t.clone() for n, t in targets.items()}
    patches = [_patch(targets[n], n, [3, 7], [1.0, 2.0]) for n in "abc"]
    patches[1] = Patch(patches[1].entry, patches[1].indices, torch.tensor([1.0, 2.5]))
    with pytest.raises(Undone) as caught:
        apply(patches, targets, "sparse")
    assert (
        caught.value.tensors == 3
        and "b: " in str(caught.value.cause)
        and "(linear)" in str(caught.value.cause)
    )
    assert all(torch.equal(targets[n], before[n]) for n in targets)
    assert apply([_patch(targets[n], n, [3, 7], [1.0, 2.0]) for n in "abc"], targets, "sparse")["linear"] == 3
