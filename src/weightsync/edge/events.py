"""Server-sent events whose source is closed the moment the client goes (both front doors).

Starlette's ``StreamingResponse`` notices a client that left only when a write fails (ASGI
2.4 servers), and never closes its iterator itself: a stream waiting on a paused worker would
hold its request for as long as the pause.  :func:`send_events` listens for the disconnect
beside the writes and closes the source when it comes, which aborts what the source holds
(the engine's requests on a worker, the upstream connection on the router), then returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Final

DONE: Final = b"data: [DONE]\n\n"
MEDIA_TYPE: Final = "text/event-stream"
HEADERS: Final = {"cache-control": "no-cache", "x-accel-buffering": "no"}

Message = dict[str, Any]


def event(data: Any) -> bytes:
    """One ``data:`` event of ``data`` as JSON (ASCII escapes: any text renders)."""
    return b"data: " + json.dumps(data, separators=(",", ":"), allow_nan=False).encode() + b"\n\n"


async def send_events(
    source: AsyncIterator[bytes],
    receive: Callable[[], Awaitable[Message]],
    send: Callable[[Message], Awaitable[None]],
    status: int,
    headers: Sequence[tuple[bytes, bytes]],
) -> None:
    """Answer an ASGI request with ``source``'s bytes as the body, closing ``source`` when it
    ends, fails, or the client disconnects; a failed write (the client left) is no failure."""
    await send({"type": "http.response.start", "status": status, "headers": list(headers)})

    async def write() -> None:
        async for chunk in source:
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
            await source.aclose()  # type: ignore[attr-defined]
    failed = writer.exception() if writer.done() and not writer.cancelled() else None
    if failed is not None and not isinstance(failed, OSError):
        raise failed
