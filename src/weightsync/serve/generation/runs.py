"""One generation request as the engine's sequences: ``n`` samples of every prompt, run
together, read whole (:func:`collect`) or as one stream of their chunks (:func:`merged`).

Every sequence's stream is opened (and so checked by the engine) before any runs, so a
request refused for one prompt generates nothing for the others.  Samples of one prompt
with a seed take ``seed + j`` for the ``j``-th, as vLLM seeds its parallel samples.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import attrs

from weightsync.serve.generation.fields import SEED_RANGE, Ask


@attrs.frozen
class Sequence:
    index: int
    prompt: list[int]
    fields: dict[str, Any]
    request_id: str | None


def _wrap(seed: int) -> int:
    lo, hi = SEED_RANGE
    return (seed - lo) % (hi - lo + 1) + lo


def sequences(ask: Ask, encode: Callable[[str], list[int]]) -> list[Sequence]:
    """The request's sequences, prompt-major (the ``n`` samples of a prompt are adjacent)."""
    out = []
    many = len(ask.prompts) * ask.n > 1
    for i, prompt in enumerate(ask.prompts):
        ids = encode(prompt) if isinstance(prompt, str) else prompt
        for j in range(ask.n):
            index = i * ask.n + j
            fields = dict(ask.sampling)
            if j and fields.get("seed") is not None:
                fields["seed"] = _wrap(fields["seed"] + j)
            rid = f"{ask.request_id}-{index}" if ask.request_id is not None and many else ask.request_id
            out.append(Sequence(index, ids, fields, rid))
    return out


async def open_streams(engine: Any, seqs: list[Sequence]) -> list[AsyncIterator[Any]]:
    """The engine's stream of each sequence, all opened (checked) first; a refusal of any
    closes those already opened and raises."""
    streams: list[AsyncIterator[Any]] = []
    try:
        for s in seqs:
            streams.append(engine.stream(s.prompt, request_id=s.request_id, **s.fields))
    except BaseException:
        for opened in streams:
            await opened.aclose()  # type: ignore[attr-defined]
        raise
    return streams


async def _last(stream: AsyncIterator[Any]) -> Any:
    item = None
    async for item in stream:  # noqa: B007 (the last item is the completion)
        pass
    return item


async def collect(streams: list[AsyncIterator[Any]]) -> list[Any]:
    """Every sequence's completion, in order; a failure of one aborts the others."""
    if len(streams) == 1:
        return [await _last(streams[0])]
    tasks = [asyncio.ensure_future(_last(s)) for s in streams]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def merged(streams: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """``(sequence index, chunk or completion)`` of every stream as they come; closing it
    (or a failure of one stream) aborts every sequence still running."""
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await streams[0].aclose()  # type: ignore[attr-defined]
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[Any]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item, None))
        except Exception as exc:
            queue.put_nowait((i, None, exc))
        finally:
            queue.put_nowait((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(streams)
        while running:
            i, item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is None:
                running -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*tasks, return_exceptions=True)
