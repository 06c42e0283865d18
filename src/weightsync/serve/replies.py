"""JSON replies that cannot fail to render.

Starlette's ``JSONResponse`` writes non-ASCII text as UTF-8, which raises on a lone
surrogate; an error message quoting hostile input must still be answered.  Validated values
never contain one, so the fallback to ASCII escapes only ever serves such messages.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse

from weightsync.core.errors import WeightSyncError


class JSONReply(JSONResponse):
    """``JSONResponse`` that falls back to ``\\uXXXX`` escapes for text UTF-8 cannot encode,
    and ends every reply with a newline (so that replies printed by curl one after another
    read one per line)."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content) + b"\n"
        except UnicodeEncodeError:
            return (
                json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()
                + b"\n"
            )


def error_response(exc: WeightSyncError) -> JSONReply:
    """The JSON error object for ``exc``, with its HTTP status."""
    return JSONReply(exc.to_reply(), status_code=exc.http_status)
