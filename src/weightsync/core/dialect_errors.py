"""How vLLM's and SGLang's routes shape a refusal: one shaper per dialect, used by a worker's
dialect routes (``weightsync.transports.http.dialects``) and the router's fleet routes
(``weightsync.router.dialects``) alike, so the two can never drift apart.

Each shaper returns the reply's JSON body and HTTP status, in the order a response class
takes them (``JSONResponse(*vllm_error(exc))``).

- vLLM: ``{"error": {"message", "type", "param", "code"}}`` with the error's own status;
  ``type`` is weightsync's machine-readable code, ``param`` the field it names (or null),
  ``code`` the HTTP status.
- SGLang: ``{"success": false, "message", "code", ...}`` with 400, except the statuses the
  edge answers before any route (401/403/413/415), which keep theirs; a worker adds the state
  the failure left (``torn``, ``paused``).  SGLang's ``/flush_cache`` answers text.
"""

from __future__ import annotations

from typing import Any, Final

from .errors import WeightSyncError

__all__ = ["EDGE_STATUSES", "flush_refusal", "internal", "sglang_error", "sglang_status", "vllm_error"]

EDGE_STATUSES: Final = (401, 403, 413, 415)
"""Statuses of refusals made at the edge, before any route ran: SGLang's shape keeps them."""


def internal(exc: Exception) -> WeightSyncError:
    """An unexpected ``exc`` as the ``internal_error`` (500) the dialect routes answer with."""
    return WeightSyncError(f"{type(exc).__name__}: {exc}", code="internal_error")


def vllm_error(exc: WeightSyncError) -> tuple[dict[str, Any], int]:
    """The body and status of ``exc`` in vLLM's error shape."""
    param = exc.details.get("field")
    error = {
        "message": exc.message,
        "type": exc.code,
        "param": param if isinstance(param, str) else None,
        "code": exc.http_status,
    }
    return {"error": error}, exc.http_status


def sglang_status(exc: WeightSyncError) -> int:
    """The status of ``exc`` in SGLang's shape: 400, unless the edge refused it."""
    return exc.http_status if exc.http_status in EDGE_STATUSES else 400


def sglang_error(exc: WeightSyncError, **state: Any) -> tuple[dict[str, Any], int]:
    """The body and status of ``exc`` in SGLang's failure shape, ``state`` (what the failure
    left, on a worker) appended to the body."""
    return {"success": False, "message": exc.message, "code": exc.code, **state}, sglang_status(exc)


def flush_refusal(exc: WeightSyncError) -> str:
    """The text of SGLang's ``/flush_cache`` when ``exc`` refused it."""
    return f"Cache not flushed: {exc.message} ({exc.code})\n"
