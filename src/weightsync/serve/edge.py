"""What every HTTP handler of the worker shares: the bearer-token check, the JSON body read
strictly, and the reply to an unexpected failure (logged, answered, never a crash)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from weightsync.core.errors import InvalidRequest
from weightsync.core.validation import strict_loads
from weightsync.edge.origin import check_api_key, check_bearer
from weightsync.serve.replies import JSONReply

log = logging.getLogger("weightsync.http")

_LOADS_INLINE = 1 << 20
"""The largest body read as JSON on the event loop (a few milliseconds); larger ones are read in
a thread."""


def internal_error(exc: Exception) -> JSONResponse:
    """The 500 ``internal_error`` reply for an unexpected ``exc``, logged with its traceback."""
    log.exception("unexpected failure", exc_info=exc)
    return JSONReply(
        {"status": "error", "code": "internal_error", "message": f"{type(exc).__name__}: {exc}"},
        status_code=500,
    )


async def read_json_body(request: Request) -> Any:
    """The body as JSON; an empty body is ``{}``.

    Raises ``InvalidRequest``: ``invalid_json`` (a key repeated in an object included), or
    ``too_deep`` for nesting deeper than the parser's stack allows (tens of thousands of
    ``[`` fit in a small body).
    """
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        if len(raw) > _LOADS_INLINE:  # megabytes of JSON (a plan part) take a while: not on the loop
            return await asyncio.to_thread(strict_loads, raw)
        return strict_loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise InvalidRequest("the body is nested too deeply to parse", code="too_deep") from None


def bearer_check(api_key: str | None) -> Callable[[Request], None]:
    """A check that the request carries ``Bearer <api_key>``; none when ``api_key`` is None.

    Raises ``InvalidRequest`` (``empty_api_key``) for an empty key, which would let a bare
    ``Bearer`` in.
    """
    check_api_key(api_key)

    def check(request: Request) -> None:
        check_bearer(request.headers.get("authorization"), api_key)

    return check
