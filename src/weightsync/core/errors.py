"""The one error family of weightsync.

Every refusal and failure is a :class:`WeightSyncError` carrying a machine-readable
``code`` and the HTTP status the HTTP transport answers with (the idea is h11's
``error_status_hint``).  Other transports and the Python API raise the same types,
so a caller handles one family whatever path a request took.
"""

from __future__ import annotations

from typing import Any, ClassVar, Final


class WeightSyncError(Exception):
    """Root of the family.  ``code`` is stable and machine-readable; ``message`` is for people."""

    http_status: ClassVar[int] = 500
    default_code: ClassVar[str] = "error"

    def __init__(self, message: str, *, code: str | None = None, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.details: dict[str, Any] = details

    def to_reply(self) -> dict[str, Any]:
        """Return the JSON error object the HTTP transport sends."""
        reply: dict[str, Any] = {"status": "error", "code": self.code, "message": self.message}
        if self.details:
            reply["details"] = self.details
        return reply

    @staticmethod
    def from_reply(reply: Any, http_status: int | None = None) -> WeightSyncError:
        """Rebuild the error a reply describes: the inverse of :meth:`to_reply`.

        Without ``http_status`` the status is the reply's own ``http_status`` (an integer,
        as :meth:`to_wire` writes), else the status of the class whose ``default_code`` is
        the reply's code, else 500 (a code no class owns, such as ``not_paused``).
        The class comes from ``http_status`` (a 5xx whose code says the update tore is
        :class:`WeightsTorn`; a status no class answers with is an :class:`EngineFailure`);
        code, message and details are kept.  A reply that carries ``wrote`` (see
        :meth:`to_wire`) is a :class:`LoadFailed` whose ``cause`` is the error by status.
        Tolerates any JSON: missing or mistyped fields get neutral values.
        """
        reply = reply if isinstance(reply, dict) else {}
        if http_status is None:
            own = reply.get("http_status")
            code = reply.get("code")
            owner = _BY_CODE.get(code) if isinstance(code, str) else None
            http_status = own if type(own) is int else owner.http_status if owner is not None else 500
        message = reply.get("message")
        message = message if isinstance(message, str) else f"HTTP {http_status}"
        code = str(reply.get("code", "error"))
        details = reply.get("details")
        details = {str(k): v for k, v in details.items()} if isinstance(details, dict) else {}
        for reserved in ("message", "code", "wrote", "cause"):  # would collide with arguments
            details.pop(reserved, None)
        cls = _BY_STATUS.get(http_status, EngineFailure)
        if http_status >= 500 and code in _TORN_CODES:  # a 409 weights_torn is a refusal, not a tear
            cls = WeightsTorn
        if "wrote" not in reply:
            return cls(message, code=code, **details)
        wrote = reply["wrote"] is True
        if cls is EngineFailure and code == LoadFailed.default_code:
            return LoadFailed(message, wrote=wrote, **details)  # failed as such: no narrower cause
        return LoadFailed(message, wrote=wrote, cause=cls(message, code=code, **details), **details)

    @property
    def reply_status(self) -> int:
        """The HTTP status a reply of this error carries."""
        return self.http_status

    def to_wire(self) -> dict[str, Any]:
        """The error as a plain dict for a process boundary: :meth:`to_reply` plus its
        ``http_status`` (and a load's ``wrote``).  :meth:`from_wire` is the inverse."""
        return {**self.to_reply(), "http_status": self.reply_status}

    @staticmethod
    def from_wire(wire: Any) -> WeightSyncError:
        """Rebuild an error from :meth:`to_wire` (any other value is an ``EngineFailure``)."""
        status = wire.get("http_status") if isinstance(wire, dict) else None
        return WeightSyncError.from_reply(wire, status if type(status) is int else 500)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code!r}, message={self.message!r})"


class InvalidRequest(WeightSyncError):
    """The request is malformed: bad JSON, wrong type, missing or unknown field (400)."""

    http_status = 400
    default_code = "invalid_request"


class Unauthorized(WeightSyncError):
    """The bearer token is missing or wrong (401)."""

    http_status = 401
    default_code = "unauthorized"


class Forbidden(WeightSyncError):
    """The request came from somewhere the worker does not serve: a foreign ``Origin`` or an
    unexpected ``Host`` (403, codes ``forbidden_origin`` and ``forbidden_host``)."""

    http_status = 403
    default_code = "forbidden"


class NotFound(WeightSyncError):
    """An unknown route, or a named thing (path, group, request) that does not exist (404)."""

    http_status = 404
    default_code = "not_found"


class IllegalState(WeightSyncError):
    """The command is well formed but not legal in the current state (409)."""

    http_status = 409
    default_code = "illegal_state"


class CacheInUse(IllegalState):
    """Raised by an engine's ``reset_prefix_cache`` that dropped nothing because running or
    kept requests hold the cache (409, code ``cache_in_use``): the one way an engine says a
    reset did not happen."""

    default_code = "cache_in_use"

    def __init__(
        self,
        message: str = "the prefix cache was not reset: running or kept requests hold it; "
        "pause with mode 'abort' or 'wait' first",
        *,
        code: str | None = None,
        **details: Any,
    ) -> None:
        super().__init__(message, code=code, **details)


class PayloadTooLarge(WeightSyncError):
    """The request body exceeds the server's limit (413)."""

    http_status = 413
    default_code = "payload_too_large"


class UnsupportedMediaType(WeightSyncError):
    """A body that is not declared as ``Content-Type: application/json`` (415)."""

    http_status = 415
    default_code = "unsupported_media_type"


class NotSupported(WeightSyncError):
    """The engine or transport does not implement this command (501)."""

    http_status = 501
    default_code = "not_supported"


class EngineFailure(WeightSyncError):
    """The engine failed while carrying out a legal command (500)."""

    http_status = 500
    default_code = "engine_failure"


class WeightsTorn(EngineFailure):
    """An update failed after it had started writing weights: the worker is now torn."""

    default_code = "weights_torn"


class EngineUnavailable(WeightSyncError):
    """The engine is not reachable or not alive (503)."""

    http_status = 503
    default_code = "engine_unavailable"


class LoadFailed(EngineFailure):
    """Raised by an engine's ``load_weights``.

    ``wrote`` says whether any weight had been written when the failure happened; the
    controller turns a failure with ``wrote=True`` into the torn state.  ``cause`` keeps a
    family error (say a 400 for a shape mismatch) so its code and status reach the caller
    when nothing was written.
    """

    default_code = "load_failed"

    def __init__(
        self,
        message: str,
        *,
        wrote: bool,
        cause: WeightSyncError | None = None,
        code: str | None = None,
        **details: Any,
    ) -> None:
        super().__init__(message, code=code or (cause.code if cause else None), **details)
        self.wrote = wrote
        self.cause = cause

    @property
    def reply_status(self) -> int:
        return self.cause.http_status if self.cause is not None else self.http_status

    def to_wire(self) -> dict[str, Any]:
        """The cause's wire form (its status, code, message and details) when there is one,
        else this error's; with ``wrote`` either way."""
        wire = self.cause.to_wire() if self.cause is not None else super().to_wire()
        if self.details:
            wire["details"] = {**wire.get("details", {}), **self.details}
        return {**wire, "wrote": self.wrote}


_BY_STATUS: Final[dict[int, type[WeightSyncError]]] = {
    cls.http_status: cls
    for cls in (
        InvalidRequest,
        Unauthorized,
        Forbidden,
        NotFound,
        IllegalState,
        PayloadTooLarge,
        UnsupportedMediaType,
        NotSupported,
        EngineFailure,
        EngineUnavailable,
    )
}
"""The class a reply's HTTP status stands for: each class's own ``http_status``."""

_OWNERS: Final[tuple[type[WeightSyncError], ...]] = (*_BY_STATUS.values(), WeightsTorn, LoadFailed)
_BY_CODE: Final[dict[str, type[WeightSyncError]]] = {cls.default_code: cls for cls in _OWNERS}
"""The class whose ``default_code`` a code is: the status :meth:`WeightSyncError.from_reply` assumes."""


def cache_reset_failed() -> WeightsTorn:
    """The error of an update whose weights were loaded but whose requested prefix-cache
    reset did not happen: it ends ``tore``."""
    return WeightsTorn(
        "weights were loaded but the requested prefix-cache reset did not happen, "
        "so cached prefixes of the old weights may be served; worker is torn — "
        "pause with mode 'abort' or 'wait' and update again",
        code="cache_reset_failed",
    )


_TORN_CODES: Final = frozenset({WeightsTorn.default_code, "cache_reset_failed"})
