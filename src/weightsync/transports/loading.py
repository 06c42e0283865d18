"""Route a weight source to the transport that reads it, into an engine's sink."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from weightsync.core.errors import NotSupported
from weightsync.core.requests import DiskSource, DistributedSource, TensorSource, WeightSource
from weightsync.core.values import LoadStats

from .sink import TensorSink

if TYPE_CHECKING:
    from .distributed.worker import GroupRegistry


@attrs.frozen
class LoadContext:
    """Worker-side state the transports need: where checkpoints may be read from, and the
    weight-update groups this worker joined."""

    allowed_roots: tuple[Path, ...] | None = None
    groups: GroupRegistry | None = None

    @classmethod
    def create(cls, dirs: Sequence[str | Path] | None) -> LoadContext:
        from .distributed.worker import GroupRegistry

        return cls(tuple(Path(d).resolve() for d in dirs) if dirs else None, GroupRegistry())


def load_sync(source: WeightSource, sink: TensorSink, ctx: LoadContext) -> LoadStats:
    """Load ``source`` into ``sink`` (blocking: run it in a thread).  Sources that need an
    engine's own machinery (a process group) are handled by the engine before this."""
    if isinstance(source, DiskSource):
        from .disk import load_checkpoint

        return load_checkpoint(source, sink, ctx.allowed_roots)
    if isinstance(source, DistributedSource) and ctx.groups is not None:
        return ctx.groups.receive(source, sink)
    if isinstance(source, TensorSource):
        from .tensor import load_shared

        return load_shared(source, sink)
    raise NotSupported(f"the {source.kind} transport is not available on this worker")
