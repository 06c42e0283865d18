"""``POST /v1/completions`` and ``POST /v1/chat/completions``: OpenAI-compatible generation,
stamped with the weight version(s) that produced it, whole or streamed as server-sent events.

The body is parsed by :mod:`~weightsync.serve.generation.fields` (unknown fields 400, known
fields the worker does not implement 501), the request runs as the engine's sequences
(:mod:`~weightsync.serve.generation.runs`: ``n`` samples of every prompt), and the reply takes
OpenAI's shape (:mod:`~weightsync.serve.generation.openai`).  Every refusal comes before the
first byte of a stream; a failure later is one ``data: {"error": …}`` event before
``data: [DONE]``.  A client that leaves a stream aborts its sequences on the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import attrs
from fastapi import FastAPI, Request
from fastapi.responses import Response

from weightsync.core.errors import WeightSyncError
from weightsync.serve import schemas
from weightsync.serve.edge import bearer_check, internal_error, read_json_body
from weightsync.serve.generation import runs, sglang
from weightsync.serve.generation.admission import Admission
from weightsync.serve.generation.fields import MAX_LOGPROBS, Ask, check_logprobs, parse_chat, parse_completion
from weightsync.serve.generation.openai import Events, Shape, whole
from weightsync.serve.generation.sse import DONE, EventStream, event
from weightsync.serve.generation.text import Spelling, Tokenizer, tokenizer_of
from weightsync.serve.lora import ModelSelection
from weightsync.serve.metrics import Metrics
from weightsync.serve.replies import JSONReply, error_response


class GeneratingEngine(Protocol):
    name: str

    async def generate(self, prompt: list[int], **kwargs: Any) -> Any: ...

    def stream(self, prompt: list[int], **kwargs: Any) -> AsyncIterator[Any]: ...


@attrs.frozen
class Reply:
    """How a parsed request answers: ``events`` of its streams (a stream's bytes) or ``whole``
    of its finished outputs (a reply's body)."""

    events: Callable[[list[Any]], AsyncIterator[bytes]]
    whole: Callable[[list[Any]], Any]


ReplyTo = Callable[[list[Any], str | None], Reply]
"""How a parsed request answers once its sequences exist, run with the LoRA adapter named (or none)."""
Parse = Callable[[Any], tuple[Ask, ReplyTo]]
"""A route's parse of its body: the request and how to answer it."""


def _openapi(schema: dict[str, Any], docs: dict[str, str]) -> dict[str, Any]:
    return {
        "requestBody": {"content": {"application/json": {"schema": schemas.documented(schema, docs)}}},
        "responses": schemas.error_responses(schemas.COMPLETION_ERRORS),
    }


def add_completion_routes(
    app: FastAPI,
    engine: GeneratingEngine,
    *,
    api_key: str | None,
    metrics: Metrics,
    admission: Admission | None = None,
    max_logprobs: int = MAX_LOGPROBS,
    selection: ModelSelection | None = None,
) -> Callable[[], None]:
    """Add the completion routes to ``app``; returns what stops their preparing thread (the
    app's lifespan calls it at shutdown).  ``admission``: asked before a request reaches the
    engine (vLLM 0.33's refusal while paused, :mod:`~.generation.admission`); ``max_logprobs``:
    the most alternatives per token a request may ask for (-1: no bound; ``serve --max-logprobs``);
    ``selection``: which LoRA adapter a request's ``model`` names (:mod:`weightsync.serve.lora`;
    none: ``model`` is metadata)."""
    check = bearer_check(api_key)
    ids = itertools.count()
    tokenizer = getattr(engine, "tokenizer", None)
    # one thread prepares every request, in turn: off the loop, and never two at once on a
    # tokenizer that may not be shared between threads
    preparer = ThreadPoolExecutor(1, thread_name_prefix="weightsync-prepare")

    def encoder(what: str) -> Callable[[str], list[int]]:
        def encode(text: str) -> list[int]:
            return tokenizer_of(engine, what).encode(text)

        return encode

    def chat_render(messages: list[dict[str, str]], gen_prompt: bool) -> str | list[int]:
        return tokenizer_of(engine, "a chat").chat(messages, gen_prompt)

    def prepare(body: Any, parse: Parse) -> tuple[Ask, ReplyTo, list[Any]]:
        """Parse ``body`` (rendering chat messages) and make its sequences (encoding text)."""
        ask, reply_to = parse(body)
        return ask, reply_to, runs.sequences(ask, encoder("a text prompt"))

    async def served(request: Request, parse: Parse) -> Response:
        """Check, read and parse the body (``parse``), run its sequences, and answer as a
        stream of events or one reply of the parse's shape."""
        try:
            check(request)
            body = await read_json_body(request)
            if tokenizer is None:  # no text to render or encode: quick
                ask, reply_to, seqs = prepare(body, parse)
            else:  # a chat template's rendering and a long prompt's encoding: not on the loop
                run = contextvars.copy_context().run
                ask, reply_to, seqs = await asyncio.get_running_loop().run_in_executor(
                    preparer, run, prepare, body, parse
                )
            check_logprobs(ask.sampling, max_logprobs)
            if admission is not None:
                admission.check()
            lora = selection.adapter(ask.model) if selection is not None else None
            streams = await runs.open_streams(engine, seqs, ask.n, lora)
            reply = reply_to(seqs, lora)
            if ask.stream:
                return EventStream(reply.events(streams))
            outs = await runs.collect(streams, len(seqs))
        except WeightSyncError as exc:
            return error_response(exc)
        except Exception as exc:  # answer, log, keep serving
            return internal_error(exc)
        for out in outs:
            metrics.completions.labels(out.finish_reason).inc()
        return JSONReply(reply.whole(outs))

    def openai(chat: bool) -> Callable[[Request], Awaitable[Response]]:
        def parse(body: Any) -> tuple[Ask, ReplyTo]:
            ask = parse_chat(body, chat_render) if chat else parse_completion(body)

            def reply_to(seqs: list[Any], lora: str | None) -> Reply:
                spell = Spelling(tokenizer if isinstance(tokenizer, Tokenizer) else None, ask.tokens_as_ids)
                prompts = [s.prompt for s in seqs[:: ask.n]]
                prefix = "chatcmpl" if chat else "cmpl"
                reply_id = ask.request_id or f"{prefix}-{next(ids)}"  # the id abort_request takes
                shape = Shape(ask, chat, engine.name if lora is None else lora, reply_id, spell, prompts)
                return Reply(
                    lambda streams: _events(shape, ask, streams, metrics), lambda outs: whole(shape, outs)
                )

            return ask, reply_to

        async def route(request: Request) -> Response:
            return await served(request, parse)

        return route

    for path, name, chat, schema, summary in (
        ("/v1/completions", "completions", False, schemas.COMPLETION,
         "OpenAI-style completion, stamped with the weight version(s) that produced it."),
        ("/v1/chat/completions", "chat_completions", True, schemas.CHAT_COMPLETION,
         "OpenAI-style chat completion (the engine's chat template), stamped like a completion."),
    ):  # fmt: skip
        extra = _openapi(schema, schemas.COMPLETION_DOCS)
        app.post(path, name=name, summary=summary, openapi_extra=extra)(openai(chat))

    def sglang_parse(body: Any) -> tuple[Ask, ReplyTo]:
        ask, batch, start = sglang.parse_generate(body)

        def reply_to(seqs: list[Any], lora: str | None) -> Reply:
            replies = [sglang.Reply(s.index, s.prompt, ask, start) for s in seqs]
            finished = metrics.completions.labels
            return Reply(
                lambda streams: _sse(sglang.events(replies, streams, lambda r: finished(r).inc())),
                lambda outs: sglang.whole(replies, outs, batch),
            )

        return ask, reply_to

    @app.post(
        "/generate",
        summary="SGLang's native generation (text or input_ids, sampling_params, return_logprob, stream), "
        "with meta_info.weight_version.",
        openapi_extra=_openapi(schemas.GENERATE, schemas.GENERATE_DOCS),
    )
    async def generate(request: Request) -> Response:
        return await served(request, sglang_parse)

    return functools.partial(preparer.shutdown, wait=False, cancel_futures=True)


async def _events(shape: Shape, ask: Ask, streams: list[Any], metrics: Metrics) -> AsyncIterator[bytes]:
    """The stream's events: every chunk of every choice as it comes, the closing events, then
    ``[DONE]`` (after an error event when the engine failed midway)."""
    events = Events(shape, ask.sampling.get("stop", ()))

    async def bodies() -> AsyncIterator[dict[str, Any]]:
        async with contextlib.aclosing(runs.merged(streams)) as merged:
            async for index, item in merged:
                if hasattr(item, "spans"):
                    metrics.completions.labels(item.finish_reason).inc()
                for e in events.item(index, item):
                    yield e
        for e in events.tail():
            yield e

    async with contextlib.aclosing(_sse(bodies())) as sse:
        async for chunk in sse:
            yield chunk


async def _sse(source: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """``source``'s objects as events, then ``[DONE]`` (after an error event when the engine
    failed midway); closing it closes ``source``."""
    try:
        async for body in source:
            yield event(body)
    except WeightSyncError as exc:
        yield event({"error": exc.to_reply()})
    except Exception as exc:
        reply = internal_error(exc)
        yield b'data: {"error": ' + bytes(reply.body).rstrip() + b"}\n\n"
    finally:
        await source.aclose()  # type: ignore[attr-defined]
    yield DONE


__all__ = ["add_completion_routes"]
