"""One generation request as the engine's sequences: ``n`` samples of every prompt, run
together, read whole (:func:`collect`) or as one stream of their chunks (:func:`merged`).

Every sequence's stream is opened (and so checked by the engine) before any runs, so a
request refused for one prompt generates nothing for the others.  Samples of one prompt
with a seed take ``seed + j`` for the ``j``-th, as vLLM seeds its parallel samples.  An engine
that runs a prompt's ``n`` samples as one request of its own (:class:`SamplesAsOneRequest`:
vLLM's ``SamplingParams(n=…)``) gets them so, and seeds them itself the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol, runtime_checkable

import attrs

from weightsync.serve.generation.fields import SEED_RANGE, Ask


@attrs.frozen
class Sequence:
    index: int
    prompt: list[int]
    fields: dict[str, Any]
    request_id: str | None


@runtime_checkable
class SamplesAsOneRequest(Protocol):
    """An engine that runs the ``n`` samples of a prompt as one request."""

    def stream_samples(
        self, prompt: list[int], n: int, *, request_ids: list[str | None], **fields: Any
    ) -> AsyncIterator[tuple[int, Any]]:
        """``(sample index, chunk or completion)`` of the ``n`` samples as they come; every
        refusal is raised by the call, before anything is generated."""
        ...


Source = AsyncIterator[tuple[int, Any]]
"""``(sequence index, chunk or completion)`` of one or more of a request's sequences."""


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


async def _tagged(index: int, stream: AsyncIterator[Any]) -> Source:
    try:
        async for item in stream:
            yield index, item
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


async def _shifted(first: int, stream: Source) -> Source:
    try:
        async for j, item in stream:
            yield first + j, item
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


async def open_streams(
    engine: Any, seqs: list[Sequence], n: int = 1, lora: str | None = None
) -> list[Source]:
    """The engine's streams of the sequences (``n`` samples per prompt, prompt-major), all
    opened (checked) first, each with the LoRA adapter ``lora`` (none: the base): one per
    prompt where the engine runs samples as one request, else one per sequence.  A refusal of
    any closes those already opened and raises."""
    streams: list[Source] = []
    adapter = {} if lora is None else {"lora": lora}
    one_request = n > 1 and isinstance(engine, SamplesAsOneRequest) and lora is None
    try:
        for first in range(0, len(seqs), n if one_request else 1):
            s = seqs[first]
            if one_request:
                ids = [q.request_id for q in seqs[first : first + n]]
                samples = engine.stream_samples(s.prompt, n, request_ids=ids, **s.fields)
                streams.append(_shifted(first, samples))
            else:
                streams.append(
                    _tagged(first, engine.stream(s.prompt, request_id=s.request_id, **adapter, **s.fields))
                )
    except BaseException:
        for opened in streams:
            await opened.aclose()  # type: ignore[attr-defined]
        raise
    return streams


async def collect(streams: list[Source], count: int) -> list[Any]:
    """Every sequence's completion (``count`` of them), in order; a failure of one stream
    aborts the others."""
    outs: list[Any] = [None] * count

    async def drain(stream: Source) -> None:
        async for index, item in stream:  # the last item of a sequence is its completion
            outs[index] = item

    if len(streams) == 1:
        await drain(streams[0])
        return outs
    tasks = [asyncio.ensure_future(drain(s)) for s in streams]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return outs


async def merged(streams: list[Source]) -> AsyncIterator[tuple[int, Any]]:
    """``(sequence index, chunk or completion)`` of every stream as they come; closing it
    (or a failure of one stream) aborts every sequence still running."""
    if len(streams) == 1:
        try:
            async for index, item in streams[0]:
                yield index, item
        finally:
            await streams[0].aclose()  # type: ignore[attr-defined]
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()
    ended = (-1, None, None)

    async def pump(stream: Source) -> None:
        try:
            async for index, item in stream:
                queue.put_nowait((index, item, None))
        except Exception as exc:
            queue.put_nowait((-1, None, exc))
        finally:
            queue.put_nowait(ended)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        running = len(streams)
        while running:
            index, item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is None:
                running -= 1
                continue
            yield index, item
    finally:
        for t in tasks:
            t.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*tasks, return_exceptions=True)
