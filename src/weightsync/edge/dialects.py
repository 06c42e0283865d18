"""What vLLM's and SGLang's routes look like wherever weightsync serves them: a worker's
dialect routes (``weightsync.serve.dialects``) and the router's fleet routes
(``weightsync.router.dialects``) share these, so the two can never drift apart — how a
refusal is shaped (one shaper per dialect), how a query string is read, and the dialects'
own values.

Each shaper returns the reply's JSON body and HTTP status, in the order a response class
takes them (``JSONResponse(*vllm_error(exc))``).

- vLLM: ``{"error": {"message", "type", "param", "code"}}`` with the error's own status;
  ``type`` is weightsync's machine-readable code, ``param`` where the field at fault is, in
  vLLM's spelling (``query.mode``, ``body.new_version``, ``body.init_info.master_port``; null
  when no field is), ``code`` the HTTP status.
- SGLang: ``{"success": false, "message", "code", ...}`` with 400, except the statuses the
  edge answers before any route (401/403/413/415), which keep theirs; a worker adds the state
  the failure left (``torn``, ``paused``).  SGLang's ``/flush_cache`` answers text.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any, Final

from weightsync.core.errors import InvalidRequest, NotSupported, WeightSyncError

__all__ = [
    "DEFAULT_VERSION",
    "EDGE_STATUSES",
    "SGLANG_IGNORED",
    "SGLANG_LOAD_FORMATS",
    "SGLANG_PAUSE_MODES",
    "SGLANG_SELECTORS",
    "SGLANG_UNSERVED",
    "SHARED_DEFAULT",
    "SHARED_OWN_FIELDS",
    "VLLM_QUERY_PARAMS",
    "VLLM_VERSIONS",
    "flush_refusal",
    "internal",
    "query",
    "query_bool",
    "sglang_error",
    "sglang_int",
    "sglang_not_routed",
    "sglang_selector",
    "sglang_status",
    "shared_dialect",
    "vllm_error",
    "vllm_param",
]  # fmt: skip

EDGE_STATUSES: Final = (401, 403, 413, 415)
"""Statuses of refusals made at the edge, before any route ran: SGLang's shape keeps them."""

VLLM_VERSIONS: Final = ("0.32", "0.33")
"""The vLLM releases the vLLM dialect can mirror where they differ (``serve --vllm-version``;
the last is the default)."""

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


VLLM_QUERY_PARAMS: Final = frozenset(
    {
        "mode",
        "clear_cache",
        "include_dp",
        "config_format",
        "reset_running_requests",
        "reset_external",
        "level",
        "tags",
    }
)
"""The query parameters of vLLM's routes; every other field of theirs is in the body."""

SHARED_DEFAULT: Final = {"/update_weight_version": "vllm", "/server_info": "sglang"}
"""Per path vLLM and SGLang both answer: whose shape answers a request that names no field
of one dialect only (see :func:`shared_dialect`)."""

SHARED_OWN_FIELDS: Final = {
    "/update_weight_version": {"sglang": frozenset({"abort_all_requests"})},
    "/server_info": {"vllm": frozenset({"config_format"})},
}
"""Per path vLLM and SGLang both answer: the fields (body or query) only one dialect's route has."""


def vllm_param(field: Any, fields: Any = None) -> str | None:
    """Where vLLM says a field is (its ``param``): ``query.<name>`` for its query parameters,
    ``body.<path>`` for the rest; a location already spelled so (or ``body`` itself) is kept.
    ``fields`` (a list of unknown fields) stands in when no single field is named."""
    if not isinstance(field, str):
        field = fields[0] if isinstance(fields, list) and fields else None
    if not isinstance(field, str):
        return None
    name: str = field
    if name == "body" or name.startswith(("body.", "query.")):
        return name
    root = name.split(".", 1)[0].split("[", 1)[0]
    return f"query.{name}" if root in VLLM_QUERY_PARAMS else f"body.{name}"


def vllm_error(exc: WeightSyncError) -> tuple[dict[str, Any], int]:
    """The body and status of ``exc`` in vLLM's error shape (``param`` as :func:`vllm_param`)."""
    error = {
        "message": exc.message,
        "type": exc.code,
        "param": vllm_param(exc.details.get("field"), exc.details.get("fields")),
        "code": exc.http_status,
    }
    return {"error": error}, exc.http_status


def shared_dialect(path: str, fields: Collection[str], chosen: str | None) -> str:
    """Which dialect (``"vllm"`` or ``"sglang"``) answers a request on ``path``, a path vLLM
    and SGLang both serve: ``chosen`` (``serve --dialect``) when given; else the dialect whose
    route alone has one of the request's ``fields`` (:data:`SHARED_OWN_FIELDS`); else the
    path's default (:data:`SHARED_DEFAULT`, vLLM for a path it does not list)."""
    if chosen is not None:
        return chosen
    for dialect, own in SHARED_OWN_FIELDS.get(path, {}).items():
        if set(fields) & own:
            return dialect
    return SHARED_DEFAULT.get(path, "vllm")


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
        raise InvalidRequest(
            f"unknown query parameter(s) {unknown}",
            code="unknown_field",
            field=f"query.{unknown[0]}",
            fields=unknown,
        )
    for key in keys:
        if sum(k == key for k, _ in pairs) > 1:
            raise InvalidRequest(
                f"query parameter {key!r} given twice", code="invalid_value", field=f"query.{key}"
            )
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


# ---------------------------------------------------------------------- SGLang, continued

SGLANG_SELECTORS: Final = ("all", "target", "draft")
"""The weights an SGLang update names (``selector``): ``all`` (the target model and its
draft), ``target`` or ``draft``.  A worker serves one model and no draft."""

SGLANG_UNSERVED: Final = frozenset({
    "/get_weights_by_name", "/update_weights_from_ipc", "/load_lora_adapter",
    "/unload_lora_adapter", "/load_lora_adapter_from_tensors", "/load_lora_adapter_from_distributed",
    "/init_weights_send_group_for_remote_instance",
    "/send_weights_to_remote_instance", "/set_internal_state", "/start_profile", "/stop_profile",
    "/open_session", "/close_session", "/configure_logging", "/slow_down", "/freeze_gc", "/pull_weights",
    "/get_remote_instance_transfer_engine_info", "/clear_hicache_storage_backend",
    "/start_expert_distribution_record", "/stop_expert_distribution_record", "/dump_expert_distribution_record",
})  # fmt: skip
"""Paths of SGLang's native server a worker does not answer (``sglang/srt/entrypoints/
http_server.py``): a request to one is refused in SGLang's shape, 404 (see
:func:`sglang_not_routed`).  A path a worker comes to serve is answered by its route first."""

_DIGITS: Final = frozenset("0123456789")


def sglang_int(value: Any) -> Any:
    """``value`` as SGLang's server reads an integer field: a string of decimal digits
    (optionally signed, surrounded by blanks) is that integer, as pydantic's coercion of
    SGLang's request structs makes it (SGLang's own tests send ``"master_port": "29500"``);
    anything else is returned unchanged, for the route's parser to accept or refuse.  Booleans
    stay strict: ``true`` is not 1."""
    if type(value) is not str or len(value) > 32:
        return value
    text = value.strip(" \t\n\r")
    digits = text[1:] if text[:1] in ("+", "-") else text
    return int(text) if digits and set(digits) <= _DIGITS else value


def sglang_selector(value: Any) -> str:
    """The ``selector`` of an SGLang update (``None``: SGLang's default ``all``).  ``all`` and
    ``target`` both name the one model a worker serves.  Raises ``InvalidRequest``
    (``invalid_value``) for a value SGLang does not know, and ``NotSupported``
    (``not_supported``) for ``draft``: a worker has no draft model, and a selection it cannot
    honour is refused rather than applied to other weights."""
    selector = "all" if value is None else value
    if type(selector) is not str or selector not in SGLANG_SELECTORS:
        raise InvalidRequest(
            f"selector must be one of {list(SGLANG_SELECTORS)}", code="invalid_value", field="selector"
        )
    if selector == "draft":
        raise NotSupported(
            "selector 'draft': this worker serves one model and no draft model (use 'all' or 'target')",
            code="not_supported",
            field="selector",
        )
    return selector


def sglang_not_routed(status: int, method: str, path: str) -> tuple[dict[str, Any], int]:
    """The body and status of a 404 (a path of SGLang's server this worker does not answer)
    or a 405 (an SGLang route asked with another method), in SGLang's failure shape."""
    if status == 405:
        message = f"{method} {path}: method not allowed on this SGLang route"
        return {"success": False, "message": message, "code": "method_not_allowed"}, 405
    message = f"{path} is a route of SGLang's server that this worker does not serve (see docs/dialects.md)"
    return {"success": False, "message": message, "code": "unknown_route"}, 404
