"""Route a weight source to the transport that reads it, into an engine's sink."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from weightsync.core.errors import InvalidRequest, LoadFailed, NotSupported, WeightSyncError
from weightsync.core.requests import DiskSource, DistributedSource, TensorSource, WeightSource
from weightsync.core.values import LoadStats, TensorSpec

from .sink import TensorSink, check_metadata

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

    The returned stats carry ``hashes``: what the channel hashed of every tensor it wrote
    (``None`` if it left one unhashed), from which the controller keeps the digest.
    """
    try:
        stats = _route(source, sink, ctx)
        return attrs.evolve(stats, hashes=sink.written_hashes())
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


def check_source(
    source: WeightSource, specs: Mapping[str, TensorSpec], ctx: LoadContext
) -> dict[str, str] | None:
    """Validate ``source`` against ``specs`` as :func:`load_sync` would before its first
    write, and write nothing (a dry run; blocking: run it in a thread).

    Returns ``name -> xxh3-64`` of the tensors the load would write when the source declares
    them (a checkpoint whose manifest lists per-tensor hashes, loaded without a dtype cast),
    else ``None``.  For a broadcast only the group and the metadata can be checked (the
    trainer's stream does not exist yet).  Raises the 4xx refusals a load would; anything
    else raised while checking becomes ``InvalidRequest`` (``invalid_source``).
    """
    try:
        return _check(source, specs, ctx)
    except WeightSyncError:
        raise
    except Exception as exc:
        raise InvalidRequest(
            f"the {source.kind} source was refused: {describe_exception(exc)}",
            code="invalid_source",
            exception=type(exc).__name__,
        ) from exc


def _check(source: WeightSource, specs: Mapping[str, TensorSpec], ctx: LoadContext) -> dict[str, str] | None:
    if isinstance(source, DiskSource):
        from .disk import DiskCheckpoint

        ckpt = DiskCheckpoint.open(source.model_path, ctx.allowed_roots)
        cast = check_metadata(
            (e.spec for e in ckpt.entries),
            specs,
            allow_partial=source.allow_partial,
            allow_dtype_cast=source.allow_dtype_cast,
        )
        ckpt.verify_checksums()
        declared = ckpt.tensor_hashes
        if declared is None or cast:  # a cast tensor's bytes are known only once cast
            return None
        return {e.spec.name: declared[e.spec.name] for e in ckpt.entries}
    if isinstance(source, DistributedSource) and ctx.groups is not None:
        ctx.groups.get(source.group_name)
        check_metadata(source.tensors, specs, allow_partial=True)
        return None
    if isinstance(source, TensorSource):
        from .tensor.shm import check_shared

        check_shared(source, specs)
        return None
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
