"""The plan channel for an engine that pulls its tensors (vLLM's in-place reload).

A one-process vLLM worker serves every tensor whole, in checkpoint layout, but takes tensors
only as ``(name, tensor)`` pairs it pulls (``model_runner.reload_weights(weights_iterator=...)``
through a :class:`~weightsync.transports.sink.PullTarget`): no byte of a plan can land in
its parameters.  :func:`pull_reader` receives each tensor's pieces into scratch memory
the target lends (:meth:`~weightsync.transports.sink.Target.buffer`), with the same
messages, buffers and checks as :func:`~.reader.receive_in_place` (:func:`~.receive.receive`),
and hands the tensor over (:meth:`~weightsync.transports.sink.Target.accept`) once its last
piece has landed and the tensor is hashed: the target's ``wrote`` turns true as the first
tensor leaves, and its ``hashes`` are those of what was handed over, so the digest the
worker reports is that of what it serves.  Tensors are handed over in the order they
complete; a tensor's scratch is the target's from then on.

What is verified when:

- before any collective (:meth:`~.reader.PlanReader.validate`, then the start of the stream): the part
  against the served checkpoint (names, dtypes, shapes; every tensor covered exactly once;
  message sizes; :func:`~weightsync.core.plan.check.check_part`), this worker's rank in the
  group, and every source's manifest (the size of each message it will send).  A mismatch
  is a refusal (400), nothing received, nothing handed over;
- as each tensor completes: its whole-tensor xxh3-64 (what the worker then reports) is
  taken before it is handed over, from the scratch every piece landed in; nothing is
  compared with the sources yet — they post their pieces' hashes only after their last
  message;
- after the last message, before the stream ends: every piece's xxh3-64 against its
  source's (:func:`~.receive.verify`).  By then the engine took every tensor, so a
  mismatch (``checksum_mismatch``) tears the worker honestly: never committed, the worker
  and the group alive, and the next complete load makes it whole.  A corrupt piece can thus
  reach the engine's parameters, but never a committed version.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Generator, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from weightsync.core.plan.boxes import Box
from weightsync.core.plan.value import Piece
from weightsync.core.snapshot import TensorSpec
from weightsync.transports.hashing import tensor_hash
from weightsync.transports.plan.reader import PlanReader, WholePart
from weightsync.transports.plan.receive import begin, receive, settle
from weightsync.transports.plan.streams import Streams, completed_hash
from weightsync.transports.sink import Target, torch_dtype


class _Scratch(Mapping[str, tuple[torch.Tensor, Box]]):
    """``name -> (scratch tensor, its full box)``, the memory lent by the target when a
    tensor's first piece arrives (receive asks for it then), until it is handed over."""

    def __init__(self, target: Target, specs: Mapping[str, TensorSpec], device: torch.device) -> None:
        self.target, self.specs, self.device = target, specs, device
        self._held: dict[str, tuple[torch.Tensor, Box]] = {}

    def __getitem__(self, name: str) -> tuple[torch.Tensor, Box]:
        got = self._held.get(name)
        if got is None:
            spec = self.specs[name]
            t = self.target.buffer(spec, self.device)
            if t is None:
                t = torch.empty(spec.shape, dtype=torch_dtype(spec.dtype), device=self.device)
            got = self._held[name] = (t, Box.full(spec.shape))
        return got

    def release(self, name: str) -> torch.Tensor:
        return self._held.pop(name)[0]

    def __iter__(self) -> Iterator[str]:
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)


class _Handover:
    """Tensors whose last piece landed, hashed (:func:`~.streams.completed_hash`), handed to
    the target in completion order."""

    def __init__(
        self, target: Target, scratch: _Scratch, left: dict[str, int], hasher: ThreadPoolExecutor
    ) -> None:
        self.target, self.scratch, self.left, self.hasher = target, scratch, left, hasher
        self.pieces = dict(left)
        self.streams = Streams()
        self.queue: deque[tuple[str, str | Future[str]]] = deque()
        for name, n in left.items():  # an empty tensor gets no piece: it is complete now
            if n == 0:
                self.queue.append((name, tensor_hash(scratch[name][0])))

    def landed(self, piece: Piece, digest: bytes) -> None:
        self.left[piece.name] -= 1
        if not self.left[piece.name]:
            t = self.scratch[piece.name][0]
            pieces = self.pieces[piece.name]
            self.queue.append(
                (piece.name, completed_hash(t, pieces, piece, digest, self.streams, self.hasher))
            )

    @property
    def complete(self) -> bool:
        """Every piece landed."""
        return not any(self.left.values())

    def hand_over(self, wait: bool) -> None:
        """Hand over the completed tensors whose hash is ready (all, waiting, with ``wait``)."""
        while self.queue:
            name, h = self.queue[0]
            if isinstance(h, Future) and not (wait or h.done()):
                return
            self.queue.popleft()
            digest = h if isinstance(h, str) else h.result()
            self.target.accept(self.scratch.specs[name], self.scratch.release(name), digest)


def pull_reader(registry: Any, source: Any) -> PlanReader:
    """The plan channel of a one-process worker that pulls whole tensors (see the module
    docstring): checked as any one-process worker's part (:class:`~.reader.PlanReader`,
    before anything moves), landed by :func:`receive_and_hand_over`."""
    return PlanReader(registry, source, into=receive_and_hand_over)


def receive_and_hand_over(part: WholePart, target: Target) -> Iterator[None]:
    """Receive ``part``'s pieces into scratch the target lends and hand each tensor over to
    any :class:`~weightsync.transports.sink.Target` once complete and hashed.  Raises
    ``InvalidRequest`` (``stream_mismatch``) or ``LoadFailed`` (``stream_aborted``) before the
    first collective, ``LoadFailed`` (``stream_failed`` or, a source having
    sent more than it declared, ``peer_failed``: the group dropped; ``checksum_mismatch``:
    the group kept) after it."""
    group, sid, registry = part.group, part.stream_id, part.registry
    begin(group, sid, part.transfers)
    specs = {n: part.specs[n] for n in part.names}
    scratch = _Scratch(target, specs, group.device)
    left = dict.fromkeys(specs, 0)
    for t in part.transfers:
        for p in t.pieces:
            left[p.name] += 1
    with ThreadPoolExecutor(1, thread_name_prefix="weightsync-hash") as hasher:
        handover = _Handover(target, scratch, left, hasher)
        steps = receive(
            group, sid, part.transfers, part.specs, scratch, lambda: None, handover.landed, handover.streams
        )
        try:
            for _ in steps:
                # once every piece landed, every tensor is handed over before the pieces
                # are verified (receive's last step): the sources' hashes come last
                handover.hand_over(wait=handover.complete)
                yield
        except Exception as exc:
            failure = settle(registry, group, sid, exc)
            if failure is exc:
                raise
            raise failure from exc
        except BaseException:  # the consumer stopped pulling mid-plan: the group is out of step
            registry._drop(group)
            raise
        finally:
            if isinstance(steps, Generator):
                steps.close()  # a receive left part way ends here
