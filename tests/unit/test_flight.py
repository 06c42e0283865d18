"""`Flight` (the sharded plan's point-to-point window) starts an operation only once there is
room: a buffer's next receive never starts before its previous receive was waited for and
unpacked (two receives in flight, double-buffered); and the worker alternates its packing
buffers itself, so no plan can make two receives in flight share one."""

from __future__ import annotations

import struct
from typing import Any

import pytest
import torch

from weightsync.core.plan.boxes import Box
from weightsync.core.plan.value import Piece, Transfer
from weightsync.core.snapshot import TensorSpec
from weightsync.transports.hashing import tensor_digest
from weightsync.transports.plan.flight import Flight
from weightsync.transports.plan.receive import RECEIVE_DEPTH, receive


class _Events:
    """A stand-in group that only records when work is waited for."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []

    def wait(self, work: Any) -> None:
        self.log.append(("wait", work))


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_an_operation_starts_only_after_the_one_depth_back_finished_its_follow_up(depth: int) -> None:
    group = _Events()
    flight = Flight(group, depth=depth)  # type: ignore[arg-type]

    def start(k: int) -> int:
        group.log.append(("start", k))
        return k

    for k in range(8):
        flight.add(lambda k=k: start(k), lambda k=k: group.log.append(("then", k)))
        assert len(flight.pending) <= depth
    flight.drain()
    log = group.log
    for k in range(depth, 8):
        # the operation `depth` back (which used the same buffer at depth 2) is done first
        assert log.index(("then", k - depth)) < log.index(("start", k))
    assert [e for e in log if e[0] == "then"] == [("then", k) for k in range(8)]


def test_the_worker_keeps_two_receives_in_flight() -> None:
    assert RECEIVE_DEPTH == 2


class _Group:
    """A stand-in group for :func:`receive`: each receive is in flight from its start until it
    is waited for, when its bytes land (a real backend may write them any time in between)."""

    def __init__(self, messages: dict[int, bytes], sums: bytes) -> None:
        self.device = torch.device("cpu")
        self.timeout_s = 5.0
        self.messages = messages
        self.in_flight: list[tuple[int, torch.Tensor]] = []
        self.shared: list[tuple[int, int]] = []
        self._buffers: list[torch.Tensor] = []
        self.store = _Store(sums)

    def buffers(self, size: int) -> list[torch.Tensor]:
        if not self._buffers:
            self._buffers = [torch.empty(size, dtype=torch.uint8) for _ in range(2)]
        return self._buffers

    def recv(self, buf: torch.Tensor, src: int, tag: int) -> int:
        lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
        for other, b in self.in_flight:
            if b.data_ptr() < hi and lo < b.data_ptr() + b.numel():
                self.shared.append((other, tag))
        self.in_flight.append((tag, buf))
        return tag

    def wait(self, work: int) -> None:
        (buf,) = [b for tag, b in self.in_flight if tag == work]
        self.in_flight = [(tag, b) for tag, b in self.in_flight if tag != work]
        buf.copy_(torch.frombuffer(bytearray(self.messages[work]), dtype=torch.uint8))


class _Store:
    def __init__(self, sums: bytes) -> None:
        self.sums = sums

    def wait(self, keys: list[str], timeout: Any) -> None:
        pass

    def get(self, key: str) -> bytes:
        return self.sums


def test_packed_receives_alternate_buffers_whatever_the_plan_says() -> None:
    """A hostile plan puts four consecutive packed transfers on buffer 0: the worker still
    never has two receives in flight into the same buffer, and every weight lands intact."""
    n = 4
    spec = TensorSpec("w", "float32", (n, 8))
    sent = torch.arange(n * 8, dtype=torch.float32).reshape(n, 8)
    transfers, messages, sums = [], {}, b""
    for k in range(n):
        box = Box(((k, k + 1), (0, 8)))
        piece = Piece("w", box, 0, 32)
        transfers.append(Transfer(k, k, 0, 0, 0, 1, 0, 32, (piece,)))
        messages[k] = sent[k].numpy().tobytes()
        sums += struct.pack("<QQ", k, 0) + tensor_digest(sent[k])
    group = _Group(messages, sums)
    target = torch.zeros(n, 8)
    for _ in receive(group, "s", transfers, {"w": spec}, {"w": (target, Box.full(spec.shape))}, lambda: None):  # type: ignore[arg-type]
        pass
    assert group.shared == []
    assert torch.equal(target, sent)


def test_receive_holds_no_reference_to_a_tensor_once_its_last_piece_landed() -> None:
    """A pulling engine (vLLM) frees a tensor's scratch as it takes it: receive must not keep
    its memory alive for the rest of the plan."""
    specs = {n: TensorSpec(n, "float32", (2, 8)) for n in ("a", "b")}
    sent = {n: torch.full((2, 8), float(i + 1)) for i, n in enumerate(specs)}
    transfers, messages, sums = [], {}, b""
    for k, n in enumerate(specs):  # two pieces per tensor, in one packed transfer each
        pieces = tuple(Piece(n, Box(((r, r + 1), (0, 8))), 32 * r, 32) for r in range(2))
        transfers.append(Transfer(k, k, 0, 0, 0, 1, 0, 64, pieces))
        messages[k] = sent[n].numpy().tobytes()
        sums += b"".join(struct.pack("<QQ", k, r) + tensor_digest(sent[n][r]) for r in range(2))
    group = _Group(messages, sums)
    lent = {n: (torch.zeros(2, 8), Box.full((2, 8))) for n in specs}
    taken: dict[str, Any] = {}  # name -> the storage of the tensor taken away

    def landed(p: Piece, h: bytes) -> None:
        if p.box.bounds[0] == (1, 2):  # the tensor's last piece: the engine takes it
            taken[p.name] = lent.pop(p.name)[0].untyped_storage()

    use_count = torch._C._storage_Use_Count  # type: ignore[attr-defined]
    seen: dict[str, int] = {}
    for _ in receive(group, "s", transfers, specs, lent, lambda: None, landed):  # type: ignore[arg-type]
        for n, storage in taken.items():  # one reference: the storage object itself
            seen[n] = max(seen.get(n, 0), use_count(storage._cdata))
    assert seen == {"a": 1, "b": 1}
