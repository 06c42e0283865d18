"""One pass over received bytes: :func:`~weightsync.transports.copying.copy_hashed` copies a
tensor into the memory an engine lends and hashes each chunk just written, and
:func:`~weightsync.transports.distributed.foreign.hand_over` gives a target a received
tensor that way (every foreign stream and every packed bucket slice goes through it).  The
hash must be exactly the one-shot :func:`tensor_hash` of the bytes, at every size around
the chunk, and the copy exact; what cannot be copied in one pass is refused untouched.  The
trainer packs its send buckets the same way (:func:`~weightsync.transports.copying.pack_digest`)."""

from __future__ import annotations

import pytest
import torch

from weightsync.core.snapshot import TensorSpec
from weightsync.transports.copying import HASHED_CHUNK, copy_hashed, pack_digest
from weightsync.transports.distributed.foreign import hand_over
from weightsync.transports.hashing import tensor_digest, tensor_hash
from weightsync.transports.sink import TensorSink, dtype_name

pytestmark = pytest.mark.unit

SIZES = [0, 1, 7, HASHED_CHUNK - 1, HASHED_CHUNK, HASHED_CHUNK + 1, 3 * HASHED_CHUNK + 5]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8, torch.float64])
@pytest.mark.parametrize("nbytes", SIZES)
def test_the_hash_is_the_one_shot_hash_and_the_copy_is_exact(dtype: torch.dtype, nbytes: int) -> None:
    size = torch.empty((), dtype=dtype).element_size()
    src = torch.randint(0, 256, (nbytes // size * size,), dtype=torch.uint8).view(dtype)
    dst = torch.zeros_like(src)
    assert copy_hashed(dst, src) == tensor_hash(src)
    assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))


def test_a_scalar_and_a_shaped_tensor() -> None:
    for src in (torch.tensor(3.5), torch.randn(33, 4097)):
        dst = torch.empty_like(src)
        assert copy_hashed(dst, src) == tensor_hash(src)
        assert torch.equal(dst, src)


@pytest.mark.parametrize(
    "dst, src",
    [
        (torch.zeros(4, 4).t(), torch.ones(4, 4)),  # not contiguous
        (torch.zeros(4, 4), torch.ones(4, 4).t()),
        (torch.zeros(16), torch.ones(4, 4)),  # another shape
        (torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float32)),  # a cast
    ],
)
def test_what_one_pass_cannot_copy_is_refused_untouched(dst: torch.Tensor, src: torch.Tensor) -> None:
    before = dst.clone()
    assert copy_hashed(dst, src) is None
    assert torch.equal(dst, before)


def _spec(t: torch.Tensor, name: str = "w") -> TensorSpec:
    return TensorSpec(name, dtype_name(t.dtype), tuple(t.shape))


def test_hand_over_copies_into_the_engines_tensor_and_hashes_it_there() -> None:
    engine = torch.zeros(300, 700, dtype=torch.bfloat16)
    sink = TensorSink({"w": engine})
    new = torch.randn(300, 700).to(torch.bfloat16)
    received = new.reshape(-1).view(torch.uint8).clone()  # a received buffer's slice
    digest = hand_over(sink, _spec(new), received, torch.device("cpu"))
    assert digest == tensor_hash(new) == sink.hashes["w"]
    assert torch.equal(engine, new)
    assert sink.wrote and sink.tensors == 1 and sink.bytes == new.numel() * 2
    received.zero_()  # the buffer is reused for the next broadcast: the engine keeps its copy
    assert torch.equal(engine, new)


def test_hand_over_without_lent_memory_hashes_and_hands_the_bytes_as_they_are() -> None:
    engine = torch.zeros(64, dtype=torch.float64)  # the stream sends float32: cast on write
    sink = TensorSink({"w": engine})
    new = torch.arange(64, dtype=torch.float32)
    digest = hand_over(sink, _spec(new), new.view(torch.uint8).clone(), torch.device("cpu"))
    assert digest == tensor_hash(new)
    assert torch.equal(engine, new.double())
    assert sink.hashes["w"] == tensor_hash(engine) != digest  # a cast tensor's is what it became


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
@pytest.mark.parametrize("nbytes", [0, 3, HASHED_CHUNK + 1, 2 * HASHED_CHUNK + 6])
def test_pack_digest_packs_a_tensor_into_its_bucket_slice_and_returns_its_digest(
    dtype: torch.dtype, nbytes: int
) -> None:
    size = torch.empty((), dtype=dtype).element_size()
    src = torch.randint(0, 256, (nbytes // size * size,), dtype=torch.uint8).view(dtype).reshape(-1, 1)
    n = src.numel() * size
    bucket = torch.zeros(n + 17, dtype=torch.uint8)
    assert pack_digest(bucket[9 : 9 + n], src) == tensor_digest(src)
    assert torch.equal(bucket[9 : 9 + n], src.reshape(-1).view(torch.uint8))
    assert not bucket[:9].any() and not bucket[9 + n :].any()  # nothing written beside its slice


def test_pack_digest_into_a_slice_one_pass_cannot_take_copies_then_hashes() -> None:
    src = torch.randn(1000)
    bucket = torch.zeros(2 * 4000, dtype=torch.uint8)
    strided = bucket[::2]  # not contiguous: copy_hashed refuses it
    assert copy_hashed(strided, src.view(torch.uint8)) is None
    assert pack_digest(strided, src) == tensor_digest(src)
    assert torch.equal(strided, src.view(torch.uint8)) and not bucket[1::2].any()
