"""Route a weight source to the transport that reads it, into an engine's sink."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import attrs

from weightsync.core.errors import NotSupported
from weightsync.core.requests import DiskSource, WeightSource
from weightsync.core.values import LoadStats

from .sink import TensorSink


@attrs.frozen
class LoadContext:
    """Worker-side settings the transports need: where checkpoints may be read from."""

    allowed_roots: tuple[Path, ...] | None = None

    @classmethod
    def from_dirs(cls, dirs: Sequence[str | Path] | None) -> LoadContext:
        return cls(tuple(Path(d).resolve() for d in dirs) if dirs else None)


def load_sync(source: WeightSource, sink: TensorSink, ctx: LoadContext) -> LoadStats:
    """Load ``source`` into ``sink`` (blocking: run it in a thread).  Sources that need an
    engine's own machinery (a process group) are handled by the engine before this."""
    if isinstance(source, DiskSource):
        from .disk import load_checkpoint

        return load_checkpoint(source, sink, ctx.allowed_roots)
    raise NotSupported(f"the {source.kind} transport is not available on this worker")
