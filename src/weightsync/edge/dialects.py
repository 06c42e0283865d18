"""What vLLM's and SGLang's routes look like wherever weightsync serves them: a worker's
dialect routes (``weightsync.serve.dialects``) and the router's fleet routes
(``weightsync.router.dialects``) share these, so the two can never drift apart — how a
refusal is shaped (one shaper per dialect), how a query string is read, and the dialects'
own values.

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

from collections.abc import Collection, Iterable
from typing import Any, Final

from weightsync.core.errors import InvalidRequest, WeightSyncError

__all__ = [
    "DEFAULT_VERSION", "EDGE_STATUSES", "SGLANG_IGNORED", "SGLANG_LOAD_FORMATS", "SGLANG_PAUSE_MODES",
    "flush_refusal", "internal", "query", "query_bool", "sglang_error", "sglang_status", "vllm_error",
]  # fmt: skip

EDGE_STATUSES: Final = (401, 403, 413, 415)
"""Statuses of refusals made at the edge, before any route ran: SGLang's shape keeps them."""

DEFAULT_VERSION: Final = "default"
"""What vLLM and SGLang report before any version was set (weightsync's ``undeclared``)."""

SGLANG_PAUSE_MODES: Final = {"abort": "abort", "retract": "keep", "in_place": "keep"}
"""SGLang's pause modes onto weightsync's (docs/dialects.md says why)."""

SGLANG_LOAD_FORMATS: Final = (None, "auto", "safetensors")
"""The ``load_format`` values of SGLang's disk update that mean a safetensors checkpoint."""

SGLANG_IGNORED: Final = ("torch_empty_cache", "recapture_cuda_graph", "token_step")
"""SGLang's fields that only tune CUDA memory or the trainer's bookkeeping: accepted and
ignored (they change no weight, state or cache)."""


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


def query(pairs: Iterable[tuple[str, str]], allowed: Collection[str]) -> dict[str, str]:
    """The query parameters ``pairs`` (every ``(key, value)``, as a web framework's
    ``multi_items()`` lists them) as a dict; raises ``InvalidRequest`` for a key outside
    ``allowed`` (``unknown_field``) or given twice (``invalid_value``)."""
    pairs = list(pairs)
    keys = list(dict.fromkeys(k for k, _ in pairs))
    unknown = sorted(set(keys) - set(allowed))
    if unknown:
        raise InvalidRequest(f"unknown query parameter(s) {unknown}", code="unknown_field", fields=unknown)
    for key in keys:
        if sum(k == key for k, _ in pairs) > 1:
            raise InvalidRequest(f"query parameter {key!r} given twice", code="invalid_value", field=key)
    return dict(pairs)


def query_bool(field: str, text: str) -> bool:
    """A query-string boolean as vLLM's server reads one (``true``/``false``/``1``/``0``...);
    raises ``InvalidRequest`` (``wrong_type``) for anything else."""
    value = text.strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise InvalidRequest(f"{field} must be true or false, got {text[:40]!r}", code="wrong_type", field=field)
