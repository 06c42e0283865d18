"""The worker's server-sent event reply: :func:`weightsync.edge.events.send_events` as a
Starlette response (so a FastAPI route can return it)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from weightsync.edge.events import DONE, HEADERS, MEDIA_TYPE, event, send_events

__all__ = ["DONE", "EventStream", "event"]


class EventStream(StreamingResponse):
    """``text/event-stream`` of the bytes ``source`` yields, closed when the client leaves."""

    def __init__(self, source: AsyncIterator[bytes], status_code: int = 200) -> None:
        super().__init__(source, status_code, headers=HEADERS, media_type=MEDIA_TYPE)
        self.source = source

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_events(self.source, receive, send, self.status_code, self.raw_headers)  # type: ignore[arg-type]
