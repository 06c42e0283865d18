"""Every dtype name the request parser accepts round-trips, bit for bit, through every weight
channel: a safetensors checkpoint (written by the trainer's writer, read by the disk reader),
a shared-memory segment (``share_tensors`` and the shm reader) and the distributed stream
layout (the trainer's packing, the worker's unpacking).  A channel that cannot carry a dtype
refuses it with a 4xx error of the family, before anything is written."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from weightsync.core.dtypes import DTYPES, NAMES
from weightsync.core.errors import InvalidRequest, LoadFailed, WeightSyncError
from weightsync.core.requests import UpdateRequest
from weightsync.core.validation import known_dtype
from weightsync.trainer import save_checkpoint, share_tensors
from weightsync.transports.disk.reader import DiskReader
from weightsync.transports.distributed import layout
from weightsync.transports.distributed.packed import direct_done, unpack
from weightsync.transports.hashing import tensor_hash
from weightsync.transports.loading import load
from weightsync.transports.sink import TensorSink, torch_dtype
from weightsync.transports.tensor.shm import SharedReader

SHAPES = {"small": (3,), "large": (4, 40)}
"""With ``BUCKET_BYTES`` below, every ``large`` tensor travels alone and every ``small`` one
is packed: both halves of the distributed layout see every dtype."""
BUCKET_BYTES = 128


def weights(name: str) -> dict[str, torch.Tensor]:
    """Tensors of dtype ``name`` whose bytes are arbitrary (every bit pattern the dtype has:
    NaN payloads, negative zeros, subnormals), except ``bool``, whose only bytes are 0 and 1."""
    dtype = torch_dtype(name)
    gen = torch.Generator().manual_seed(NAMES.index(name))
    out = {}
    for kind, shape in SHAPES.items():
        count = torch.Size(shape).numel()
        if dtype == torch.bool:
            t = torch.randint(0, 2, shape, generator=gen).bool()
        else:
            raw = torch.randint(0, 256, (count * DTYPES[name].itemsize,), dtype=torch.uint8, generator=gen)
            t = raw.view(dtype).reshape(shape)
        out[f"{kind}.{name}"] = t
    return out


def zeros_like(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: torch.zeros(t.shape, dtype=t.dtype) for n, t in named.items()}


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def raw(t: torch.Tensor) -> bytes:
    return bytes(as_bytes(t).numpy())


def assert_bit_exact(sink: TensorSink, sent: dict[str, torch.Tensor]) -> None:
    for n, t in sent.items():
        got = sink.targets[n]
        assert got.dtype == t.dtype and raw(got) == raw(t), f"{n} changed in transit"
    assert sink.written_hashes() == {n: tensor_hash(t) for n, t in sent.items()}


def test_the_parser_accepts_exactly_the_dtype_table() -> None:
    assert {known_dtype("dtype", n) for n in NAMES} == set(DTYPES)
    assert known_dtype("dtype", "torch.bfloat16") == "bfloat16"
    for other in ("uint64", "float8_e8m0fnu", "complex32", "BF16"):
        with pytest.raises(InvalidRequest) as err:
            known_dtype("dtype", other)
        assert err.value.code == "invalid_value"


@pytest.mark.parametrize("name", NAMES)
def test_every_dtype_round_trips_through_a_checkpoint_or_is_refused_by_the_writer(
    name: str, tmp_path: Path
) -> None:
    sent = weights(name)
    if DTYPES[name].safetensors is None:
        with pytest.raises(WeightSyncError) as err:
            save_checkpoint(sent, tmp_path / "ckpt")
        assert err.value.code == "unsupported_dtype" and 400 <= err.value.http_status < 500
        assert list(tmp_path.iterdir()) == []  # not even a temporary directory is left
        return
    path = save_checkpoint(sent, tmp_path / "ckpt")
    source = UpdateRequest.from_disk_body({"model_path": str(path)}).source
    sink = TensorSink(zeros_like(sent))
    stats = load(DiskReader(source, allowed_roots=[tmp_path]), sink)  # type: ignore[arg-type]
    assert stats.tensors == len(sent)
    assert_bit_exact(sink, sent)


@pytest.mark.parametrize("name", NAMES)
def test_every_dtype_round_trips_through_shared_memory(name: str) -> None:
    sent = weights(name)
    with share_tensors(sent) as shared:
        source = UpdateRequest.from_tensor_body({"tensors": shared.tensors}).source
        sink = TensorSink(zeros_like(sent))
        stats = load(SharedReader(source), sink)  # type: ignore[arg-type]
    assert stats.tensors == len(sent)
    assert_bit_exact(sink, sent)


@pytest.mark.parametrize("name", NAMES)
def test_every_dtype_round_trips_through_the_distributed_layout(name: str) -> None:
    sent = weights(name)
    body = {
        "names": list(sent),
        "dtypes": [str(t.dtype) for t in sent.values()],  # as a trainer sends them: "torch.x"
        "shapes": [list(t.shape) for t in sent.values()],
        "group_name": "g",
        "packing": {"bucket_bytes": BUCKET_BYTES, "stream_id": "s"},
    }
    specs = UpdateRequest.from_distributed_body(body).source.tensors  # type: ignore[union-attr]
    chunks = layout.plan_chunks(specs, BUCKET_BYTES)
    assert {type(c) for c in chunks} == {layout.Bucket, layout.Direct}
    sizes = [c.size if isinstance(c, layout.Bucket) else c.nbytes for c in chunks]
    assert layout.manifest(chunks) == b"".join(n.to_bytes(8, "little") for n in sizes)

    sink = TensorSink(zeros_like(sent))
    hashes: dict[str, str] = {}
    later: dict[str, Future[str]] = {}
    cpu = torch.device("cpu")
    with ThreadPoolExecutor(1) as hasher:
        for chunk in chunks:
            # A broadcast hands the worker the very bytes the trainer put on the wire.
            if isinstance(chunk, layout.Direct):
                into = sink.buffer(chunk.spec, cpu)
                assert into is not None  # same dtype and shape: received straight into the engine
                into.reshape(-1).view(torch.uint8).copy_(as_bytes(sent[chunk.spec.name]))
                direct_done(sink, later, hasher, chunk, into)  # the worker's receive of a lone tensor
                continue
            buf = torch.zeros(chunk.size, dtype=torch.uint8)
            for slot in chunk.slots:  # the trainer's packing
                assert slot.offset % layout.ALIGN == 0
                buf[slot.offset : slot.offset + slot.nbytes].copy_(as_bytes(sent[slot.spec.name]))
            unpack(sink, hashes, buf, chunk, cpu)  # the worker's unpacking
        hashes.update((n, f.result()) for n, f in later.items())
    sink.hashes.update(hashes)
    assert hashes == {n: tensor_hash(t) for n, t in sent.items()}
    assert_bit_exact(sink, sent)


def test_a_dtype_outside_the_table_is_refused_by_the_writer(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest) as err:
        save_checkpoint({"w": torch.zeros(2, dtype=torch.uint64)}, tmp_path / "ckpt")
    assert err.value.code == "unsupported_dtype"
    assert list(tmp_path.iterdir()) == []


def test_a_segment_of_an_unsupported_dtype_is_a_clean_refusal() -> None:
    with share_tensors({"w": torch.zeros(2)}) as shared:
        handles = [{**shared.tensors[0], "dtype": "uint64"}]
        with pytest.raises(InvalidRequest) as err:
            UpdateRequest.from_tensor_body({"tensors": handles})
    assert err.value.code == "invalid_value"
    # and one the parser accepts but the engine's tensor does not match writes nothing
    with share_tensors({"w": torch.zeros(2, dtype=torch.complex128)}) as shared:
        source = UpdateRequest.from_tensor_body({"tensors": shared.tensors}).source
        sink = TensorSink({"w": torch.zeros(2)})
        with pytest.raises(LoadFailed) as failed:
            load(SharedReader(source), sink)  # type: ignore[arg-type]
    assert not failed.value.wrote and failed.value.cause is not None
    assert 400 <= failed.value.cause.http_status < 500 and not sink.wrote
