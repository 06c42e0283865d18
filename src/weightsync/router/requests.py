"""Reading the router's requests: a bounded JSON-object body, and a fleet update's arguments."""

from __future__ import annotations

from typing import Any, Final

from starlette.requests import Request

from weightsync.core.errors import InvalidRequest, PayloadTooLarge
from weightsync.core.validation import (
    Body,
    any_json,
    hex_digest,
    integer,
    one_of,
    positive_number,
    strict_loads,
    string,
)
from weightsync.fleet.coordinator import MAX_DEADLINE_S
from weightsync.fleet.result import PAUSE_MODES, POLICIES
from weightsync.router.bounded import TooLarge, read_bounded

__all__ = ["MAX_BODY_BYTES", "UPDATE_FIELDS", "parse_update", "read_object", "read_raw_object"]

MAX_BODY_BYTES: Final = 16 << 20

UPDATE_FIELDS: Final = (
    "model_path", "weight_version", "policy", "min_workers", "pause_mode", "deadline_s",
    "max_unavailable", "expected_digest",
)  # fmt: skip


async def read_object(request: Request, limit: int = MAX_BODY_BYTES) -> dict[str, Any]:
    """The body as a JSON object (empty body: ``{}``); see :func:`read_raw_object`."""
    return (await read_raw_object(request, limit))[1]


async def read_raw_object(request: Request, limit: int = MAX_BODY_BYTES) -> tuple[bytes, dict[str, Any]]:
    """The body's bytes and the JSON object they hold (empty body: ``{}``).

    Raises ``PayloadTooLarge`` past ``limit`` bytes, ``InvalidRequest`` (``invalid_json``,
    ``too_deep``, ``not_an_object``) for anything else that is not a JSON object.
    """
    try:
        raw = await read_bounded(request.headers.get("content-length"), request.stream(), limit)
    except TooLarge:
        raise PayloadTooLarge(f"request body exceeds {limit} bytes") from None
    if not raw.strip():
        return b"{}", {}
    try:
        body = strict_loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise InvalidRequest("the body is nested too deeply to parse", code="too_deep") from None
    if type(body) is not dict:
        raise InvalidRequest("the request body must be a JSON object", code="not_an_object")
    return raw, body


def _deadline(field: str, value: Any) -> float:
    return positive_number(field, value, MAX_DEADLINE_S)


def parse_update(body: dict[str, Any], n_workers: int) -> dict[str, Any]:
    """The arguments of ``/fleet/update_weights_from_disk``; raises ``InvalidRequest``."""
    b = Body(body, UPDATE_FIELDS)

    def count(field: str, value: Any) -> int:
        return integer(field, value, 1, n_workers)

    return {
        "model_path": b.get("model_path", string),
        "weight_version": b.get("weight_version", any_json),
        "policy": b.get("policy", one_of(POLICIES), "rollback"),
        "min_workers": b.get("min_workers", count, None),
        "pause_mode": b.get("pause_mode", one_of(PAUSE_MODES), "keep"),
        "deadline_s": b.get("deadline_s", _deadline, 600.0),
        "max_unavailable": b.get("max_unavailable", count, n_workers),
        "expected_digest": b.get("expected_digest", hex_digest, None),
    }
