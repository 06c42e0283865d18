"""Draining a refused stream: the collectives a trainer already started are joined, and their
bytes discarded, so that its broadcast returns and the group stays in step.

vLLM's, SGLang's, TRL's, OpenRLHF's and Miles' trainers post an update and start broadcasting
at once.  A worker that refuses such an update (a name the model lacks, a shape, a state or
version rule) or fails it part-way still joins every broadcast the request declared that it
did not take yet, then answers: the trainer's broadcast returns, its HTTP call carries the
refusal, and the next update runs on the same group.  The request's metadata says what to
join (:func:`collective_sizes`: one broadcast per tensor, vLLM's and SGLang's flat chunks, or
weightsync's packed chunks).

Where the bytes land: a broadcast is received whole (no stream here lets a receiver take one
broadcast in parts), so the scratch is as large as the largest declared broadcast, the memory
an accepted update of the same stream takes for its receive.  Through a helper process
(``receiver: "process"``) it is the helper's shared segment, which its receives keep; on a
group this process joined it is one buffer per group, grown to the largest broadcast drained
so far and kept for the next drain (:func:`drain` posts ``STREAM_DEPTH`` broadcasts at a time
into it: the bytes are discarded, so several may land in the same memory).  No room for it is
a failed drain.

What is not drained: weightsync's packed stream before its go (its trainer waits for every
worker's ready mark and learns a refusal from the reply: nothing was sent); a bare stream on
a gloo group the worker joined itself (refused ``unsafe_stream``: receiving sizes that are
only the request's word could abort the worker, see :meth:`StreamReader.refused
<weightsync.transports.distributed.reader.StreamReader.refused>`); and a stream whose wire
failed (the group is dropped, as before).  A drain that fails leaves the group out of step:
its caller drops it, which ends a helper's process, and the trainer's collective fails
instead of waiting.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import torch

from weightsync.core.sources import DistributedSource
from weightsync.transports.distributed.layout import STREAM_DEPTH, Bucket, flat_chunks, nbytes, plan_chunks
from weightsync.transports.distributed.receiver import ReceiverGroup

_SCRATCH: weakref.WeakKeyDictionary[Any, torch.Tensor] = weakref.WeakKeyDictionary()
"""Each group's drain buffer (this process's groups; a helper's segment is its own)."""


@attrs.define
class Progress:
    """How far one stream got on the wire, for what its end owes the trainer.

    ``owed``: whether the trainer is sending this stream's broadcasts (a bare stream from the
    start, weightsync's packed stream once rank 0 said go); ``taken``: how many of them were
    received (none is left in flight when the stream ends); ``broken``: the wire itself
    failed, so the group is out of step and nothing can be drained."""

    owed: bool = True
    taken: int = 0
    broken: bool = False

    @contextlib.contextmanager
    def receiving(self) -> Iterator[None]:
        """Around one broadcast posted and waited for: counted when it is in, ``broken`` when
        it failed."""
        try:
            yield
        except BaseException:
            self.broken = True
            raise
        self.taken += 1


def collective_sizes(source: DistributedSource) -> list[int]:
    """The byte count of every broadcast ``source`` declares, in order."""
    if source.bucket_bytes is not None:
        chunks = plan_chunks(source.tensors, source.bucket_bytes)
        return [c.size if isinstance(c, Bucket) else c.nbytes for c in chunks]
    if source.flat:
        return [
            sum(nbytes(s) for s in chunk) for chunk in flat_chunks(source.tensors, source.flat_bucket_bytes)
        ]
    return [nbytes(s) for s in source.tensors]


def drain(group: Any, sizes: Sequence[int]) -> None:
    """Join rank 0's next broadcasts on ``group``, of ``sizes`` bytes each, and discard them.

    Raises what a receive raises (a helper that died, a timeout, a short send through a
    helper, no room for the scratch): the group is then out of step, for the caller to drop."""
    if not sizes:
        return
    if isinstance(group, ReceiverGroup):
        for _ in group.receive_each(sizes):
            pass
        return
    scratch = _scratch(group, max(sizes))
    pending: deque[Any] = deque()
    for size in sizes:
        if len(pending) >= STREAM_DEPTH:
            group.wait(pending.popleft())
        pending.append(group.broadcast(scratch[:size]))
    while pending:
        group.wait(pending.popleft())


def _scratch(group: Any, size: int) -> torch.Tensor:
    """``group``'s drain buffer, at least ``size`` bytes (a bigger one replaces a smaller one)."""
    have = _SCRATCH.get(group)
    if have is None or have.numel() < size:
        _SCRATCH.pop(group, None)  # the smaller one goes before the bigger one is made
        have = _SCRATCH[group] = torch.empty(size, dtype=torch.uint8, device=group.device)
    return have
