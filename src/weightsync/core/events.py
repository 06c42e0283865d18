"""What a worker did, as log records: one INFO record per state change on the
``weightsync.events`` logger.

:func:`weightsync.core.routes.dispatch` calls :func:`route_done` after every admin route it
ran and :func:`route_refused` for every refusal, so each transport's workers say the same
thing.  A record's message reads as one line (``update source=disk version='step-1' …``);
its fields ride on the record as ``record.event`` (a dict), which a JSON formatter writes
out as keys of their own (``serve --log-format json``).  Reads (``get_weight_version``,
``weight_info`` …) are not state changes and log nothing.  Stdlib only, like all of core.
"""

from __future__ import annotations

import logging
from typing import Any, Final

from weightsync.core.errors import WeightSyncError

log = logging.getLogger("weightsync.events")

_UPDATE: Final = "update_weights_from_"
_TORN_CODES: Final = frozenset({"weights_torn", "cache_reset_failed"})


def _fields_of(route: str, reply: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The event name and fields for a successful ``route``, or None for a read."""
    if route.startswith(_UPDATE):
        source = route.removeprefix(_UPDATE)  # disk, distributed, tensor, plan
        if reply.get("dry_run"):
            return "dry_run", {"source": source, "digest": reply.get("digest")}
        stats = reply.get("stats") or {}
        return "update", {
            "source": source,
            "version": reply.get("version"),
            "version_declared": reply.get("version_declared"),
            "version_current": reply.get("version_current"),  # whether the label names these weights
            "tensors": stats.get("tensors"),
            "bytes": stats.get("bytes"),
            "ms": round(float(stats.get("seconds") or 0.0) * 1000, 3),
            "digest": reply.get("digest"),
            "staged": bool(stats.get("staged", False)),
            "prefix_cache_reset": reply.get("prefix_cache_reset"),
            "epoch": reply.get("epoch"),
        }
    if route == "pause_generation":
        return "pause", {
            "mode": reply.get("mode"),
            "aborted": reply.get("aborted"),
            "kept": reply.get("mode") == "keep",
            "clear_cache": reply.get("clear_cache"),
            "already_paused": reply.get("already_paused"),
        }
    if route == "resume_generation":
        return "resume", {}
    if route == "set_weight_version":
        return "declare", {
            "version": reply.get("version"),
            "epoch": reply.get("epoch"),
            "digest": reply.get("digest"),
        }
    if route == "flush_cache":
        return "flush_cache", {"flushed": reply.get("flushed")}
    if route == "init_weights_update_group":
        return "group_joined", {}
    if route == "destroy_weights_update_group":
        return "group_left", {}
    if route == "abort_request":
        return "request_aborted", {}
    if route == "begin_weight_update":
        return "session_opened", {"deadline_s": reply.get("deadline_s")}
    if route == "end_weight_update":
        return "session_finished", {
            "version": reply.get("version"),
            "version_declared": reply.get("version_declared"),
            "digest": reply.get("digest"),
            "prefix_cache_reset": reply.get("prefix_cache_reset"),
            "epoch": reply.get("epoch"),
        }
    if route == "abort_weight_update":
        return "session_abandoned", {"torn": reply.get("torn"), "digest": reply.get("digest")}
    if route == "engine_rpc":
        return "engine_rpc", {}
    return None


def _emit(level: int, event: str, fields: dict[str, Any]) -> None:
    text = " ".join(f"{k}={v!r}" for k, v in fields.items())
    log.log(level, "%s %s", event, text, extra={"event": {"event": event, **fields}})


def route_done(route: str, reply: dict[str, Any]) -> None:
    """Log the state change ``route`` made, ``reply`` being its ok reply."""
    if not log.isEnabledFor(logging.INFO):
        return
    found = _fields_of(route, reply)
    if found is not None:
        event, fields = found
        _emit(logging.INFO, event, {"route": route, **fields})


def taints_set(taints: list[str]) -> None:
    """Log the routing taints the worker now carries (Dynamo's ``update/model_taints``)."""
    if log.isEnabledFor(logging.INFO):
        _emit(logging.INFO, "model_taints", {"taints": taints})


def adapter_changed(event: str, fields: dict[str, Any]) -> None:
    """Log a change of a LoRA adapter slot (``lora_loaded``, ``lora_unloaded``) with ``fields``."""
    if log.isEnabledFor(logging.INFO):
        _emit(logging.INFO, event, fields)


def route_refused(route: str, exc: WeightSyncError) -> None:
    """Log a refusal of ``route`` (nothing changed), or a tear (the update failed after it
    began writing: the worker is torn), with the error's code and message."""
    torn = exc.code in _TORN_CODES
    level = logging.WARNING if torn else logging.INFO
    if log.isEnabledFor(level):
        event = "torn" if torn else "refused"
        _emit(
            level,
            event,
            {"route": route, "code": exc.code, "message": exc.message, "status": exc.http_status},
        )
