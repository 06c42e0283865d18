"""The packed stream keeps more collectives in flight than it has bucket buffers (tensors
sent alone fill the rest of the window), yet a bucket buffer is never refilled while its
previous collective may still use it: the trainer never repacks a buffer before its
broadcast is done, and the worker never receives into a buffer before the bucket it held was
unpacked; and the thread that hashes beside the wire yields to it.  A stand-in process
group plays the wire at its most hostile timing: a send reads its bytes at the last moment
(when it is waited for), a receive lands at the first (when it is posted)."""

from __future__ import annotations

import datetime
import os
import sys
import threading
from collections.abc import Iterable
from typing import Any

import pytest
import torch

from weightsync.core.snapshot import TensorSpec
from weightsync.core.sources import DistributedSource
from weightsync.trainer.broadcast import Broadcaster
from weightsync.transports.distributed.group import HASHER_NICE, Group, stream_hasher
from weightsync.transports.distributed.keys import go_key, manifest_key, sums_key
from weightsync.transports.distributed.layout import STREAM_DEPTH, Bucket, Chunk, manifest, plan_chunks
from weightsync.transports.distributed.worker import GroupRegistry, StreamReader
from weightsync.transports.hashing import tensor_digest
from weightsync.transports.sink import TensorSink

pytestmark = pytest.mark.unit

BUCKET = 4096


class _Store:
    def __init__(self) -> None:
        self.kv: dict[str, bytes] = {}

    def set(self, key: str, value: bytes | str) -> None:
        self.kv[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        return self.kv[key]

    def check(self, keys: Iterable[str]) -> bool:
        return all(k in self.kv for k in keys)

    def wait(self, keys: Iterable[str], timeout: datetime.timedelta) -> None:
        missing = [k for k in keys if k not in self.kv]
        assert not missing, f"would block on {missing}"


class _Work:
    def __init__(self, on_wait: Any = None) -> None:
        self.on_wait = on_wait

    def wait(self, timeout: datetime.timedelta) -> bool:
        if self.on_wait is not None:
            self.on_wait()
        return True


class _SendingPG:
    """Rank 0's wire: each broadcast reads its tensor when it is waited for."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.in_flight = 0
        self.most_in_flight = 0

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> _Work:
        (t,) = tensors
        slot = len(self.sent)
        self.sent.append(b"")
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)

        def read() -> None:
            self.sent[slot] = t.numpy().tobytes()
            self.in_flight -= 1

        return _Work(read)


class _ReceivingPG:
    """A worker's wire: each broadcast's bytes land in its tensor as soon as it is posted."""

    def __init__(self, payloads: list[bytes]) -> None:
        self.payloads = list(payloads)
        self.in_flight = 0
        self.most_in_flight = 0

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> _Work:
        (t,) = tensors
        data = self.payloads.pop(0)
        assert len(data) == t.numel() * t.element_size()
        t.view(torch.uint8).reshape(-1).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)

        def done() -> None:
            self.in_flight -= 1

        return _Work(done)


def _weights() -> dict[str, torch.Tensor]:
    """Small tensors (packed, many buckets) between tensors sent alone, all distinct bytes."""
    gen = torch.Generator().manual_seed(7)
    out: dict[str, torch.Tensor] = {}
    for i in range(12):
        for j in range(5):
            out[f"l{i}.small{j}"] = torch.randint(
                -1000, 1000, (300 + 37 * j,), generator=gen, dtype=torch.int32
            )
        out[f"l{i}.big"] = torch.randint(-1000, 1000, (2048,), generator=gen, dtype=torch.int32)
    return out


def _specs(weights: dict[str, torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec(n, "int32", tuple(t.shape)) for n, t in weights.items()]


def _payloads(weights: dict[str, torch.Tensor], chunks: list[Chunk]) -> list[bytes]:
    """What each collective of the stream carries."""
    out = []
    for chunk in chunks:
        if isinstance(chunk, Bucket):
            buf = bytearray(chunk.size)
            for slot in chunk.slots:
                buf[slot.offset : slot.offset + slot.nbytes] = weights[slot.spec.name].numpy().tobytes()
            out.append(bytes(buf))
        else:
            out.append(weights[chunk.spec.name].numpy().tobytes())
    return out


def _carries(sent: bytes, chunk: Chunk, weights: dict[str, torch.Tensor]) -> bool:
    """Whether ``sent`` holds the bytes of every tensor of ``chunk`` where the layout puts
    them (the alignment padding between them carries nothing)."""
    if not isinstance(chunk, Bucket):
        return sent == weights[chunk.spec.name].numpy().tobytes()
    return len(sent) == chunk.size and all(
        sent[s.offset : s.offset + s.nbytes] == weights[s.spec.name].numpy().tobytes() for s in chunk.slots
    )


def _group(pg: Any, rank: int) -> Group:
    return Group("g", rank, 2, "gloo", 10.0, _Store(), pg, torch.device("cpu"))


def test_the_trainer_never_repacks_a_bucket_buffer_before_its_broadcast_is_done() -> None:
    weights = _weights()
    chunks = plan_chunks(_specs(weights), BUCKET)
    assert sum(isinstance(c, Bucket) for c in chunks) >= 6  # each buffer is refilled several times
    pg = _SendingPG()
    group = _group(pg, 0)
    Broadcaster(["http://127.0.0.1:1"], bucket_bytes=BUCKET)._send(
        group, list(weights.items()), chunks, True, "s"
    )
    assert pg.most_in_flight == STREAM_DEPTH > 2
    assert len(pg.sent) == len(chunks)
    bad = [
        i
        for i, (sent, chunk) in enumerate(zip(pg.sent, chunks, strict=True))
        if not _carries(sent, chunk, weights)
    ]
    assert not bad, f"collectives {bad} carried bytes repacked while they were in flight"
    assert group.store.get(sums_key("s")) == b"".join(tensor_digest(t) for t in weights.values())


def test_the_worker_never_receives_into_a_bucket_buffer_before_unpacking_it() -> None:
    weights = _weights()
    specs = _specs(weights)
    chunks = plan_chunks(specs, BUCKET)
    pg = _ReceivingPG(_payloads(weights, chunks))
    group = _group(pg, 1)
    registry = GroupRegistry()
    registry._groups["g"] = group
    source = DistributedSource("g", tuple(specs), bucket_bytes=BUCKET, stream_id="s")
    targets = {n: torch.zeros_like(t) for n, t in weights.items()}
    sink = TensorSink(targets)
    reader = StreamReader(registry, source)
    reader.validate(sink.specs)
    group.store.set(manifest_key("s"), manifest(chunks))
    group.store.set(go_key("s"), b"1")
    group.store.set(sums_key("s"), b"".join(tensor_digest(t) for t in weights.values()))
    for _ in reader.stream(sink):  # raises checksum_mismatch if a bucket was overwritten
        pass
    assert pg.most_in_flight == STREAM_DEPTH > 2
    assert not pg.payloads
    bad = [n for n, t in weights.items() if not torch.equal(targets[n], t)]
    assert not bad, f"{bad} were unpacked from a buffer the next receive had overwritten"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priorities are Linux's")
def test_a_streams_hasher_runs_below_the_priority_of_the_thread_that_made_it() -> None:
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with stream_hasher() as hasher:
        theirs = hasher.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result()
    assert theirs == min(19, mine + HASHER_NICE)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # only the helper moved
