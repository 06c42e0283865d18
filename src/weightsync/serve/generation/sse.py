"""Server-sent events whose source is closed the moment the client goes.

Starlette's ``StreamingResponse`` notices a client that left only when a write fails (ASGI
2.4 servers), and never closes its iterator itself; a stream waiting on a paused worker
would hold its request for as long as the pause.  :class:`EventStream` listens for the
disconnect beside the writes and closes the source when it comes, which aborts the engine's
requests (their ``finally``), then ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"


def event(data: Any) -> bytes:
    """One ``data:`` event of ``data`` as JSON (ASCII escapes: any text renders)."""
    return b"data: " + json.dumps(data, separators=(",", ":"), allow_nan=False).encode() + b"\n\n"


class EventStream(StreamingResponse):
    """``text/event-stream`` of the bytes ``source`` yields (see the module docstring)."""

    def __init__(self, source: AsyncIterator[bytes], status_code: int = 200) -> None:
        headers = {"cache-control": "no-cache", "x-accel-buffering": "no"}
        super().__init__(source, status_code, headers=headers, media_type="text/event-stream")
        self.source = source

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})

        async def write() -> None:
            async for chunk in self.source:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def listen() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        writer, listener = asyncio.ensure_future(write()), asyncio.ensure_future(listen())
        try:
            await asyncio.wait((writer, listener), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (writer, listener):
                task.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.gather(writer, listener, return_exceptions=True)
            with contextlib.suppress(BaseException):
                await self.source.aclose()  # type: ignore[attr-defined]
        failed = writer.exception() if writer.done() and not writer.cancelled() else None
        if failed is not None and not isinstance(failed, OSError):  # (a client that left is no failure)
            raise failed
