"""The distributed channel's reader: a :class:`~weightsync.core.sources.DistributedSource`
checked, then received on one of the worker's groups (the protocol is :mod:`.worker`'s).

A stream that ends without taking every broadcast the trainer is sending, and a stream
refused before its first one, still owe the trainer those broadcasts: :meth:`StreamReader.refused`
and the end of :meth:`StreamReader.stream` join them into scratch memory (:mod:`.drain`), so the
trainer's broadcast returns and the group stays in step; where that cannot be done safely the
group is dropped, which makes the trainer's collective fail instead of waiting.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Protocol

from weightsync.core.errors import InvalidRequest, LoadFailed, NotFound, WeightSyncError
from weightsync.core.snapshot import TensorSpec
from weightsync.core.sources import DistributedSource
from weightsync.core.validation import unique_tensor_names
from weightsync.transports.distributed import foreign, packed
from weightsync.transports.distributed.drain import Progress, collective_sizes, drain
from weightsync.transports.distributed.group import Group
from weightsync.transports.distributed.layout import Chunk, plan_chunks
from weightsync.transports.distributed.receiver import ReceiverGroup
from weightsync.transports.distributed.stateless import CommGroup
from weightsync.transports.sink import Target, check_metadata

log = logging.getLogger("weightsync.transports.distributed")


class Groups(Protocol):
    """What a reader needs of the worker's groups (:class:`~.worker.GroupRegistry`)."""

    def get(self, name: str) -> Group: ...

    def get_any(self, name: str) -> Group | ReceiverGroup | CommGroup: ...

    def _drop(self, group: Group | ReceiverGroup | CommGroup) -> None: ...


class StreamReader:
    """The distributed channel: :meth:`validate` (the group, the metadata and the chunk
    plan; nothing received), then :meth:`stream`, which first checks the trainer's manifest
    and waits for the go before the first collective (see :mod:`.worker`).

    ``drains``: whether a refusal or an early end joins what the trainer is still sending
    (a load's reader); a dry run's reader never does (no trainer sends for a dry run)."""

    kind = DistributedSource.kind

    def __init__(self, registry: Groups, source: DistributedSource, *, drains: bool = True) -> None:
        self.registry = registry
        self.source = source
        self.drains = drains
        self._group: Group | ReceiverGroup | None = None
        self._chunks: list[Chunk] = []
        self._in_target: set[str] = set()
        self._owing = False  # validated, and the stream has not begun: a close drains it

    def validate(self, specs: Mapping[str, TensorSpec]) -> None:
        """Raises a 4xx error of the family; any other exception becomes ``InvalidRequest``
        (``invalid_stream``).  Returns ``None``: a stream declares no hashes up front.  A bare
        stream refused here is drained first (:meth:`refused`)."""
        try:
            unique_tensor_names("names", (t.name for t in self.source.tensors))  # a wire source too
            if self.source.bucket_bytes is None:
                self._group = foreign.check_receiver(self.registry.get_any(self.source.group_name))
            else:
                self._group = self.registry.get(self.source.group_name)
            check_metadata(self.source.tensors, specs, allow_partial=True)
            if self.source.bucket_bytes is not None:
                self._chunks = plan_chunks(self.source.tensors, self.source.bucket_bytes)
            self._owing = True
        except WeightSyncError:
            self.refused()
            raise
        except Exception as exc:
            self.refused()
            raise InvalidRequest(f"invalid weight stream: {exc!r}", code="invalid_stream") from exc

    def refused(self) -> None:
        """The update was refused before its stream began: join every broadcast a trainer
        that posts and broadcasts at once is already sending (:func:`~.drain.drain`), and
        discard them.  Nothing for weightsync's packed stream (no chunk is sent before every
        worker's go), for a dry run's reader, or without the group; nor on a gloo group this
        process joined itself, where receiving a bare stream's sizes, only the request's word,
        could abort the worker (it was refused ``unsafe_stream``; leaving the group would not
        end the trainer's collective either).  A drain that fails drops the group.  Never
        raises."""
        self._owing = False
        if not self.drains or self.source.bucket_bytes is not None:
            return
        try:
            group = self.registry.get_any(self.source.group_name)
        except NotFound:
            return
        if isinstance(group, Group) and group.backend == "gloo":
            log.warning("group %r: a bare stream on a gloo group joined inline is not drained", group.name)
            return
        self._drain(group, Progress())

    def stream(self, target: Target) -> Iterator[None]:
        """Receive the stream into ``target`` (blocking), with every tensor's hash; for a
        packed stream the hashes are verified against the trainer's before this ends.

        Raises ``InvalidRequest`` (``stream_mismatch``) or ``LoadFailed`` (``stream_aborted``)
        before the first collective; ``LoadFailed`` after it (``stream_failed`` for a failure
        outside the family, ``checksum_mismatch``).  However it ends, the broadcasts the
        trainer sends that it did not take are drained, or the group is dropped when its wire
        broke or the drain failed."""
        group = self._group
        assert group is not None, "validate first"
        self._owing = False  # from here on the stream settles what it owes, however it ends
        if self.source.bucket_bytes is not None:
            assert self.source.stream_id is not None and isinstance(group, Group)
            try:
                packed.check_manifest(group, self.source.stream_id, self._chunks)
            except WeightSyncError:
                raise
            except Exception as exc:  # the store failed: nothing was asked of the trainer yet
                raise packed.not_started(group, self.source.stream_id, exc) from exc
        progress = Progress(owed=self.source.bucket_bytes is None)  # packed: owed from the go
        self._in_target.clear()
        try:
            if self.source.bucket_bytes is None:
                yield from self._foreign(group, target, progress)
            else:
                assert isinstance(group, Group) and self.source.stream_id is not None
                specs = self.source.tensors
                yield from packed.receive(
                    group, self.source.stream_id, self._chunks, specs, target, self._in_target, progress
                )
        except WeightSyncError:
            raise
        except Exception as exc:
            raise LoadFailed(
                f"weight stream on group {group.name!r} failed: {exc}", wrote=True, code="stream_failed"
            ) from exc
        finally:
            self._drain(group, progress)

    def close(self) -> None:
        """Nothing is held between validation and the stream; a stream validated and never
        begun (its engine failed before it) is drained as a refusal (:meth:`refused`)."""
        if self._owing:
            self.refused()

    @property
    def hashed_in_target(self) -> frozenset[str]:
        """The tensors whose hash was taken in the memory the target lent, after the bytes
        were written there (see :class:`~weightsync.transports.loading.HashesInTarget`)."""
        return frozenset(self._in_target)

    def extra(self) -> dict[str, bool]:
        """``verified``: whether the bytes received are checked against the sender's hashes
        (always on the packed stream; on a foreign one only when the request carried them)."""
        return {"verified": self.source.bucket_bytes is not None or self.source.hashes is not None}

    def _drain(self, group: Group | ReceiverGroup | CommGroup, progress: Progress) -> None:
        """Join what the trainer still sends of this stream after ``progress``, or drop the
        group when its wire broke (a helper that died, lost step or timed out) or the drain
        failed.  Never raises: the stream's own outcome is what its caller is told."""
        if progress.broken or (isinstance(group, ReceiverGroup) and group.dead):
            self.registry._drop(group)
            return
        if not progress.owed or not self.drains:
            return
        rest = collective_sizes(self.source)[progress.taken :]
        if not rest:
            return
        try:
            drain(group, rest)
        except Exception:
            log.warning(
                "group %r dropped: %d broadcast(s) of a refused or failed stream could not be drained",
                group.name,
                len(rest),
                exc_info=True,
            )
            self.registry._drop(group)
            return
        log.info(
            "group %r: drained %d broadcast(s) the trainer sent for an update not taken",
            group.name,
            len(rest),
        )

    def _foreign(self, group: Group | ReceiverGroup, target: Target, progress: Progress) -> Iterator[None]:
        """A per-tensor or flat stream (see :mod:`.foreign`), verified against the request's
        ``hashes`` when it carries them."""
        specs = self.source.tensors
        if self.source.flat:
            steps = foreign.receive_flat(
                group, specs, target, self.source.flat_bucket_bytes, self._in_target, progress
            )
        else:
            steps = foreign.receive_per_tensor(group, specs, target, self._in_target, progress)
        received: list[str] = []
        with contextlib.closing(steps):  # closed early: what was asked for lands, the rest is drained
            for digest in steps:
                received.append(digest)
                yield
        if self.source.hashes is not None:
            foreign.check_hashes(specs, received, self.source.hashes)
