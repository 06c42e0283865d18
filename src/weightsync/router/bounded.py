"""Reading a body of at most ``limit`` bytes, whoever sends it: a client's request, a worker's
reply to a forwarded request or to a poll."""

from __future__ import annotations

from collections.abc import AsyncIterable


class TooLarge(Exception):
    """A body past its limit, declared (``content-length``) or sent; the message says which."""


async def read_bounded(length: str | None, chunks: AsyncIterable[bytes], limit: int) -> bytes:
    """The body whose ``content-length`` header is ``length`` (None: not given) and whose bytes
    come as ``chunks``.  Raises ``TooLarge`` past ``limit`` bytes, before reading when the
    header declares more, else as soon as more arrived."""
    if length is not None and length.isdigit() and int(length) > limit:
        raise TooLarge(f"declares {length} bytes")
    parts, seen = [], 0
    async for chunk in chunks:
        seen += len(chunk)
        if seen > limit:
            raise TooLarge(f"sent more than {limit} bytes")
        parts.append(chunk)
    return b"".join(parts)
