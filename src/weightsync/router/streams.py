"""Relaying a worker's stream of server-sent events, chunk by chunk, bounded.

The worker stamps every event itself (``weight_version``, ``weight_version_current``; the
spans on the event that finishes a choice), so the router passes the bytes through as they
come.  Before answering it reads the first event, to put the version it names in the reply's
headers (``x-weightsync-weight-version``, ``x-weightsync-weight-epoch``, as a whole reply
has them) and to learn that the worker really answers a stream: a worker that fails before
its first event is a failure the router may retry elsewhere.  Bounds: each wait for the
worker's next bytes is the hop's timeout (the session's read timeout), the whole stream at
most ``MAX_STREAM_BYTES``; past either the stream ends with an error event and ``[DONE]``.
Closing the relay (the client left) closes the upstream connection, which the worker reads as
its client leaving and aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any, Final

import aiohttp
import attrs

from weightsync.core.validation import strict_loads
from weightsync.edge.events import DONE, event

MAX_STREAM_BYTES: Final = 256 << 20
"""The most bytes the router relays of one stream."""
MAX_FIRST_EVENT: Final = 4 << 20
"""The most bytes the router reads looking for a stream's first event."""


@attrs.define
class Upstream:
    """An open stream from worker ``url``: its first event's bytes (read) and the rest to come."""

    url: str
    response: aiohttp.ClientResponse
    first: bytes
    release: Callable[[], None]
    """Called once when the relay ends (the worker's in-flight count)."""
    headers: dict[str, str] = attrs.field(factory=dict)
    """The router's headers for the reply (the version the first event names)."""


class StreamFailed(Exception):
    """The worker's stream ended or broke before its first event."""


async def first_event(response: aiohttp.ClientResponse) -> bytes:
    """The bytes up to and including the first event's blank line.  Raises ``StreamFailed``
    when the stream ends first or its first event is larger than ``MAX_FIRST_EVENT``."""
    buffered = b""
    async for chunk in response.content.iter_any():
        buffered += chunk
        if b"\n\n" in buffered:
            return buffered
        if len(buffered) > MAX_FIRST_EVENT:
            raise StreamFailed(f"no event in the first {MAX_FIRST_EVENT} bytes")
    raise StreamFailed("the stream ended before its first event")


def first_data(first: bytes) -> Any:
    """The JSON the first event carries (``data: {...}``), or ``None`` when it carries none."""
    line = first.split(b"\n\n", 1)[0]
    if not line.startswith(b"data: "):
        return None
    try:
        return strict_loads(line[6:].decode("utf-8"), finite=True)
    except (ValueError, RecursionError):
        return None


async def relay(up: Upstream, limit: int = MAX_STREAM_BYTES) -> AsyncIterator[bytes]:
    """``up``'s bytes as they come (see the module docstring)."""
    done = False
    try:
        seen = len(up.first)
        yield up.first
        async for chunk in up.response.content.iter_any():
            seen += len(chunk)
            if seen > limit:
                yield _failure(f"{up.url}'s stream passed {limit} bytes", "bad_reply")
                return
            yield chunk
        done = True
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        yield _failure(f"{up.url}'s stream broke: {type(exc).__name__}: {exc}", "worker_failed")
    finally:
        if done:
            up.response.release()
        else:  # the worker must see its client leave: drop the connection, not reuse it
            up.response.close()
        with contextlib.suppress(Exception):
            up.release()


def _failure(message: str, code: str) -> bytes:
    reply = {"status": "error", "code": code, "message": message}
    return b"\n\n" + event({"error": reply}) + DONE
