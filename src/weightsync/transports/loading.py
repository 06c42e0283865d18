"""Route a weight source to the transport that reads it, into an engine's sink."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from weightsync.core.errors import InvalidRequest, LoadFailed, NotSupported, WeightSyncError
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
    engine's own machinery (a process group) are handled by the engine before this.

    Total: whatever a channel raises leaves as :class:`LoadFailed`, and ``wrote`` is true
    whenever the channel said so *or* the sink saw a write (the sink is the evidence).  A
    failure before the first write that is not of the error family (a validator that let an
    ``OverflowError`` or ``KeyError`` escape) becomes a refusal: its ``cause`` is an
    ``InvalidRequest`` with code ``invalid_source`` naming the exception type, so the
    controller answers 400 and does not tear.
    """
    try:
        return _route(source, sink, ctx)
    except LoadFailed as exc:
        if exc.wrote or not sink.wrote:
            raise
        raise LoadFailed(exc.message, wrote=True, code=exc.code, **exc.details) from exc
    except WeightSyncError as exc:
        if not sink.wrote:
            raise LoadFailed(exc.message, wrote=False, cause=exc) from exc
        raise LoadFailed(
            f"loading failed after writing began: {exc.message}", wrote=True, code=exc.code
        ) from exc
    except Exception as exc:
        what = describe_exception(exc)
        if sink.wrote:
            raise LoadFailed(
                f"loading failed after writing began: {what}", wrote=True, code="read_failed"
            ) from exc
        refused = InvalidRequest(
            f"the {source.kind} source was refused: {what}",
            code="invalid_source",
            exception=type(exc).__name__,
        )
        raise LoadFailed(refused.message, wrote=False, cause=refused) from exc


def _route(source: WeightSource, sink: TensorSink, ctx: LoadContext) -> LoadStats:
    if isinstance(source, DiskSource):
        from .disk import load_checkpoint

        return load_checkpoint(source, sink, ctx.allowed_roots)
    if isinstance(source, DistributedSource) and ctx.groups is not None:
        return ctx.groups.receive(source, sink)
    if isinstance(source, TensorSource):
        from .tensor import load_shared

        return load_shared(source, sink)
    raise NotSupported(f"the {source.kind} transport is not available on this worker")


def describe_exception(exc: BaseException, limit: int = 200) -> str:
    """``"KeyError: 'x'"``, cut to ``limit`` characters (a message may quote a hostile input)."""
    try:
        text = str(exc)
    except Exception:
        text = ""
    if len(text) > limit:
        text = text[:limit] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
