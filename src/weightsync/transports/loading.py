"""Route a weight source to its channel's reader; validate, then stream into an engine's sink.

What a reader reports beyond its stream (a file count, figures of its own, which hashes it
took in the engine's memory) is a capability checked by type against the protocols below,
never probed by attribute name; what differs between engines is the :class:`Sink`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs

from weightsync.core.errors import NotSupported
from weightsync.core.snapshot import LoadStats, TensorSpec
from weightsync.core.sources import (
    DeltaSource,
    DeltaStreamSource,
    DiskSource,
    DistributedSource,
    PlanSource,
    TensorSource,
    WeightSource,
)
from weightsync.transports.failures import failed, refusal
from weightsync.transports.sink import Target

if TYPE_CHECKING:
    from weightsync.transports.disk.facts import FactsStore
    from weightsync.transports.distributed.worker import GroupRegistry


@attrs.frozen
class LoadContext:
    """Worker-side state the transports need: where checkpoints may be read from, the
    weight-update groups this worker joined, and what its dry runs verified of checkpoints
    (:mod:`weightsync.transports.disk.facts`)."""

    allowed_roots: tuple[Path, ...] | None = None
    groups: GroupRegistry | None = None
    facts: FactsStore | None = None

    @classmethod
    def create(cls, dirs: Sequence[str | Path] | None) -> LoadContext:
        from weightsync.transports.disk.facts import FactsStore
        from weightsync.transports.distributed.worker import GroupRegistry

        roots = tuple(Path(d).resolve() for d in dirs) if dirs else None
        return cls(roots, GroupRegistry(), FactsStore())

    def drain(self, source: WeightSource) -> None:
        """``source``'s update was refused before it reached its channel: join what a trainer
        already sends for it (a bare or flat broadcast; see
        :mod:`weightsync.transports.distributed.drain`), discarding the bytes.  Nothing for
        any other source.  Blocking; never raises."""
        if isinstance(source, DistributedSource) and self.groups is not None:
            self.groups.drain(source)

    def abandon(self, group_name: str) -> None:
        """A refused update named ``group_name`` but no stream that parses: leave the group, so
        that a trainer broadcasting on it fails instead of waiting (see
        :meth:`GroupRegistry.abandon <weightsync.transports.distributed.worker.GroupRegistry.abandon>`)."""
        if self.groups is not None:
            self.groups.abandon(group_name)


class Reader(Protocol):
    """One weight channel's reader: :meth:`validate` everything (write nothing), then
    :meth:`stream` into a :class:`~weightsync.transports.sink.Target`.  Push engines (a
    :class:`~weightsync.transports.sink.TensorSink`) and pull engines (vLLM's reload through a
    :class:`~weightsync.transports.sink.PullTarget`) use the same reader, so each check lives
    in one place."""

    kind: str

    def validate(self, specs: Mapping[str, TensorSpec]) -> dict[str, str] | None:
        """Check the source against ``specs``; returns the hashes a load would write when the
        source declares them, else ``None``.  Raises 4xx errors of the family."""
        ...

    def stream(self, target: Target) -> Iterator[None]:
        """Hand the validated source's tensors to ``target``, stepping after each one."""
        ...

    def close(self) -> None:
        """Release what :meth:`validate` opened (a finished stream has)."""
        ...


@runtime_checkable
class CountsFiles(Protocol):
    """A reader whose source is files (the disk channel): ``files`` is how many it read."""

    @property
    def files(self) -> int: ...


@runtime_checkable
class ReportsExtra(Protocol):
    """A reader with figures of its own for :attr:`LoadStats.extra` (whether the bytes were
    checked against their source's hashes, what its checks cost)."""

    def extra(self) -> dict[str, Any]: ...


@runtime_checkable
class HashesInTarget(Protocol):
    """A reader that can receive into the memory a target lends and hash it there, after the
    read: ``hashed_in_target`` names the tensors it did (see :meth:`Sink.hashed_in_place`)."""

    @property
    def hashed_in_target(self) -> frozenset[str]: ...


class Sink(Protocol):
    """An engine's side of :func:`load`: the weights a source is validated against
    (``specs``), and where its validated stream goes.

    A push engine's :class:`~weightsync.transports.sink.TensorSink` is the target the reader
    writes into; a pull engine's sink hands the stream to the engine (vLLM's in-place
    reload).  ``wrote`` turns true when a tensor may have reached the engine, and alone
    decides torn versus refused; ``tensors`` and ``bytes`` count what was handed over."""

    @property
    def specs(self) -> Mapping[str, TensorSpec]: ...

    @property
    def wrote(self) -> bool: ...

    @property
    def tensors(self) -> int: ...

    @property
    def bytes(self) -> int: ...

    def fill(self, stream: Callable[[Target], Iterator[None]]) -> None:
        """Run ``stream`` (a validated reader's :meth:`Reader.stream`) into the engine, to its
        end.  Raises what the stream or the engine raised."""
        ...

    def written_hashes(self) -> dict[str, str] | None:
        """The channel's hash of every tensor handed over; ``None`` when one went unhashed."""
        ...

    def hashed_in_place(self, vouched: Collection[str]) -> bool:
        """Whether every hash was taken in the memory the engine serves, after the bytes were
        written there (``vouched``: what the reader says it hashed in lent memory)."""
        ...


def open_reader(source: WeightSource, ctx: LoadContext, *, dry_run: bool = False) -> Reader:
    """The reader of ``source``'s channel (for a dry run: one that remembers what it verified,
    where the channel can).  Raises ``NotSupported`` for a channel this worker lacks (a
    broadcast without a group registry)."""
    if isinstance(source, DiskSource):
        from weightsync.transports.disk.reader import DiskReader

        return DiskReader(source, ctx.allowed_roots, ctx.facts, dry_run=dry_run)
    if isinstance(source, DistributedSource) and ctx.groups is not None:
        return ctx.groups.reader(source, drains=not dry_run)
    if isinstance(source, PlanSource) and ctx.groups is not None:
        from weightsync.transports.plan.reader import PlanReader

        return PlanReader(ctx.groups, source)
    if isinstance(source, DeltaStreamSource) and ctx.groups is not None:
        from weightsync.transports.delta.stream import DeltaStreamReader

        return DeltaStreamReader(ctx.groups, source)
    if isinstance(source, DeltaSource):
        from weightsync.transports.delta.reader import DeltaReader

        return DeltaReader(source, ctx.allowed_roots)
    if isinstance(source, TensorSource):
        from weightsync.transports.tensor.shm import SharedReader

        return SharedReader(source)
    raise NotSupported(f"the {source.kind} transport is not available on this worker")


def load(reader: Reader, sink: Sink) -> LoadStats:
    """Validate ``reader``'s source against ``sink``'s specs, then stream it into ``sink``:
    the one load every engine runs, push or pull.

    Raises ``LoadFailed`` (see :func:`failed`); its ``wrote`` is ``sink.wrote``.  The stats
    carry ``hashes``: what the channel hashed of every tensor written (``None`` if it left
    one unhashed), from which the controller keeps the digest, and ``hashed_in_place``:
    whether each of them was taken in the served memory (a :class:`HashesInTarget` reader
    says which tensors it hashed in the memory the sink lent; see
    :meth:`Sink.hashed_in_place`).  ``files`` and ``extra`` come from a reader that
    :class:`CountsFiles` or :class:`ReportsExtra`."""
    t0 = time.perf_counter()
    try:
        reader.validate(sink.specs)
        sink.fill(reader.stream)
    except Exception as exc:
        raise failed(exc, reader.kind, sink.wrote) from exc
    finally:
        reader.close()
    vouched = reader.hashed_in_target if isinstance(reader, HashesInTarget) else frozenset()
    return LoadStats(
        tensors=sink.tensors,
        bytes=sink.bytes,
        seconds=time.perf_counter() - t0,
        files=reader.files if isinstance(reader, CountsFiles) else 0,
        extra=reader.extra() if isinstance(reader, ReportsExtra) else {},
        hashes=sink.written_hashes(),
        hashed_in_place=sink.hashed_in_place(vouched),
    )


def load_sync(source: WeightSource, sink: Sink, ctx: LoadContext) -> LoadStats:
    """Load ``source`` into ``sink`` through its channel's reader (blocking: run it in a
    thread).  Total: whatever happens leaves as :class:`LoadFailed` (see :func:`failed`), a
    failure before the first write a refusal whose ``cause`` is a 4xx error."""
    try:
        reader = open_reader(source, ctx)
    except Exception as exc:
        raise failed(exc, source.kind, wrote=False) from exc
    return load(reader, sink)


def check_source(
    source: WeightSource, specs: Mapping[str, TensorSpec], ctx: LoadContext
) -> dict[str, str] | None:
    """Validate ``source`` against ``specs`` exactly as :func:`load_sync` does before its
    first write, and write nothing (a dry run; blocking: run it in a thread).

    Returns ``name -> xxh3-64`` of the tensors the load would write when the source declares
    them (a checkpoint whose manifest lists per-tensor hashes, loaded without a dtype cast),
    else ``None``.  For a broadcast only the group and the metadata can be checked (the
    trainer's stream does not exist yet).  A checkpoint is read in full, and what was
    verified stays in ``ctx.facts`` for the update that follows (it then copies once).
    Raises the 4xx refusal a load would (see :func:`refusal`)."""
    try:
        reader = open_reader(source, ctx, dry_run=True)
        try:
            return reader.validate(specs)
        finally:
            reader.close()
    except Exception as exc:
        cause = refusal(exc, source.kind)
        if cause is exc:
            raise
        raise cause from exc
