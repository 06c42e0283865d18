"""The one error family of weightsync.

Every refusal and failure is a :class:`WeightSyncError` carrying a machine-readable
``code`` and the HTTP status the HTTP transport answers with (the idea is h11's
``error_status_hint``).  Other transports and the Python API raise the same types,
so a caller handles one family whatever path a request took.
"""

from __future__ import annotations

from typing import Any, ClassVar


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
