"""The one mapping from a failure to what a caller is told.

A load that raised is either *refused* (nothing was written: a 4xx family error says why)
or *failed* (``LoadFailed``; torn when something was written).  Which one is decided by the
target's ``wrote`` alone, never by what the channel claims.  Every channel reader, both
engines and the vLLM worker extension map exceptions here, so a fix lands once.
"""

from __future__ import annotations

import copy

from weightsync.core.errors import EngineFailure, InvalidRequest, LoadFailed, WeightSyncError


def describe_exception(exc: BaseException, limit: int = 200) -> str:
    """``"KeyError: 'x'"``, cut to ``limit`` characters (a message may quote a hostile input)."""
    try:
        text = str(exc)
    except Exception:
        text = ""
    if len(text) > limit:
        text = text[:limit] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def refusal(
    exc: BaseException, kind: str, *, code: str = "invalid_source", read_code: str | None = None
) -> WeightSyncError:
    """The 4xx refusal for ``exc`` raised before anything was written: a family error as it
    is; with ``read_code``, an ``OSError`` as ``InvalidRequest(read_code)`` (the source could
    not be read); any other exception as ``InvalidRequest(code)`` naming its type."""
    if isinstance(exc, WeightSyncError):
        return exc
    if read_code is not None and isinstance(exc, OSError):
        return InvalidRequest(
            f"cannot read the {kind} source: {describe_exception(exc)}",
            code=read_code,
            exception=type(exc).__name__,
        )
    return InvalidRequest(
        f"the {kind} source was refused: {describe_exception(exc)}",
        code=code,
        exception=type(exc).__name__,
    )


def failed(exc: BaseException, kind: str, wrote: bool, *, defect: bool = False) -> LoadFailed:
    """The one rule for a load that raised ``exc``: ``wrote`` is the target's word (whatever
    the channel claims).  Nothing written: a clean failure, whose ``cause`` is the 4xx
    refusal (:func:`refusal`) unless the channel itself failed (a ``LoadFailed`` without a
    cause).  Something written: torn, with the channel's code (``read_failed`` for an
    exception outside the family).

    ``defect=True`` says an exception outside the family is the engine's own defect rather
    than the source's: a 500 ``load_failed`` either way, not a refusal.

    An :class:`Undone` failure wrote and then proved every byte restored: it failed without
    writing, whatever ``wrote`` says, and its error carries ``undone: true``."""
    if isinstance(exc, Undone) and exc.tensors == 0:  # it failed before its first write
        return failed(exc.cause, kind, False, defect=defect)
    if isinstance(exc, Undone):
        inner = exc.cause
        if isinstance(inner, LoadFailed) and inner.cause is not None:
            inner = inner.cause
        cause = (
            copy.copy(inner)
            if isinstance(inner, WeightSyncError)
            else EngineFailure(describe_exception(inner))
        )
        cause.message = f"{cause.message} ({exc.how}: the weights are unchanged)"
        cause.details = {**cause.details, "undone": True}
        return LoadFailed(cause.message, wrote=False, cause=cause)
    if isinstance(exc, LoadFailed):
        cause = exc.cause if not wrote else None
        return LoadFailed(exc.message, wrote=wrote, cause=cause, code=exc.code, **exc.details)
    if defect and not isinstance(exc, WeightSyncError):
        return LoadFailed(f"loading failed: {describe_exception(exc)}", wrote=wrote)
    if not wrote:
        cause = refusal(exc, kind)
        return LoadFailed(cause.message, wrote=False, cause=cause)
    if isinstance(exc, WeightSyncError):
        return LoadFailed(f"loading failed after writing began: {exc.message}", wrote=True, code=exc.code)
    return LoadFailed(
        f"loading failed after writing began: {describe_exception(exc)}", wrote=True, code="read_failed"
    )


def failure(exc: BaseException) -> WeightSyncError:
    """The error for a command that is not a load: a family error as it is, any other
    exception as an engine failure (500) that names its type."""
    if isinstance(exc, WeightSyncError):
        return exc
    return EngineFailure(describe_exception(exc))


class Undone(Exception):
    """A channel wrote, failed, and put back every byte it wrote, proven by reading them back:
    the served weights are exactly what they were, so the load failed *without* writing.
    ``cause`` is the failure; ``tensors`` how many tensors were written and restored (0: it
    failed before its first write, though the served tensors were already in its hands);
    ``how`` says how the restore was proven, for the reply."""

    def __init__(
        self,
        cause: BaseException,
        tensors: int,
        how: str = "every element written was put back and read back",
    ) -> None:
        super().__init__(describe_exception(cause))
        self.cause = cause
        self.tensors = tensors
        self.how = how
