"""The vLLM engine's text side (:class:`~weightsync.engines.vllm.tokenizer.VllmTokenizer`)
behind the worker's generation routes: chat messages are rendered, and a text prompt is
encoded, in a thread rather than on the event loop, and what vLLM's renderer or tokenizer
refuses is answered as before (501 ``no_chat_template``, 400 ``invalid_value``).  vLLM's
renderer and tokenizer are stand-ins recording the thread each call runs in and raising
vLLM's own exception classes."""

from __future__ import annotations

import asyncio
import threading
import time
import warnings
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from vllm.exceptions import VLLMValidationError

from weightsync.engines.vllm.tokenizer import VllmTokenizer
from weightsync.serve.completions import add_completion_routes
from weightsync.serve.metrics import Metrics

pytestmark = pytest.mark.unit

with warnings.catch_warnings():  # what vLLM's chat module imports warns of torch.jit's deprecation
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.renderers.chat_utils import ChatTemplateResolutionError


class _Renderer:
    """``llm.renderer``: ``render_messages`` and the tokenizer's ``encode`` record their
    thread, then raise ``refusal``."""

    def __init__(self, refusal: Exception) -> None:
        self.refusal = refusal
        self.threads: list[int] = []
        self.tokenizer = self

    def get_tokenizer(self) -> _Renderer:
        return self

    def render_messages(self, messages: list[dict[str, str]], params: Any) -> Any:
        self.threads.append(threading.get_ident())
        raise self.refusal

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.threads.append(threading.get_ident())
        raise self.refusal


class _Engine:
    """A generating engine whose requests never reach generation (each is refused first)."""

    name = "stand-in"

    def __init__(self, renderer: _Renderer) -> None:
        self.tokenizer = VllmTokenizer(SimpleNamespace(renderer=renderer))

    async def generate(self, prompt: list[int], **kwargs: Any) -> Any:
        raise AssertionError("a refused request reached the engine")

    def stream(self, prompt: list[int], **kwargs: Any) -> AsyncIterator[Any]:
        raise AssertionError("a refused request reached the engine")


def _post(refusal: Exception, path: str, body: dict[str, Any]) -> tuple[httpx.Response, list[int], int]:
    """The reply to ``body`` at ``path``, the threads the renderer ran in, and the loop's."""
    renderer = _Renderer(refusal)
    engine = _Engine(renderer)
    app = FastAPI()
    add_completion_routes(app, engine, api_key=None, metrics=Metrics(SimpleNamespace(engine=engine)))  # type: ignore[arg-type]

    async def main() -> tuple[httpx.Response, int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as client:
            return await client.post(path, json=body), threading.get_ident()

    reply, loop_thread = asyncio.run(main())
    return reply, renderer.threads, loop_thread


CHAT = {"model": "stand-in", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_chat_messages_are_rendered_off_the_loop_and_no_template_is_still_501() -> None:
    reply, threads, loop_thread = _post(ChatTemplateResolutionError("none"), "/v1/chat/completions", CHAT)
    assert (reply.status_code, reply.json()["code"]) == (501, "no_chat_template"), reply.json()
    assert len(threads) == 1 and threads[0] != loop_thread


def test_messages_the_template_refuses_are_still_400_and_rendered_off_the_loop() -> None:
    reply, threads, loop_thread = _post(VLLMValidationError("bad role"), "/v1/chat/completions", CHAT)
    assert (reply.status_code, reply.json()["code"]) == (400, "invalid_value"), reply.json()
    assert "the chat template refused the messages" in reply.json()["message"]
    assert len(threads) == 1 and threads[0] != loop_thread


def test_a_text_prompt_is_encoded_off_the_loop_and_a_refusal_is_still_400() -> None:
    body = {"model": "stand-in", "prompt": "x" * 10_000, "max_tokens": 2}
    reply, threads, loop_thread = _post(ValueError("too long"), "/v1/completions", body)
    assert (reply.status_code, reply.json()["code"]) == (400, "invalid_value"), reply.json()
    assert len(threads) == 1 and threads[0] != loop_thread


class _Slow(_Renderer):
    """A renderer that takes a while and notes when a second call starts before the first
    ends (a Hugging Face fast tokenizer then raises "Already borrowed")."""

    def __init__(self) -> None:
        super().__init__(VLLMValidationError("refused after rendering"))
        self.busy = threading.Lock()
        self.overlaps = 0

    def render_messages(self, messages: list[dict[str, str]], params: Any) -> Any:
        if not self.busy.acquire(blocking=False):
            self.overlaps += 1
            self.busy.acquire()
        try:
            time.sleep(0.02)
            return super().render_messages(messages, params)
        finally:
            self.busy.release()


def test_concurrent_chat_requests_never_use_the_tokenizer_at_once() -> None:
    renderer = _Slow()
    engine = _Engine(renderer)
    app = FastAPI()
    add_completion_routes(app, engine, api_key=None, metrics=Metrics(SimpleNamespace(engine=engine)))  # type: ignore[arg-type]

    async def main() -> tuple[list[httpx.Response], int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as client:
            replies = await asyncio.gather(
                *(client.post("/v1/chat/completions", json=CHAT) for _ in range(8))
            )
            return list(replies), threading.get_ident()

    replies, loop_thread = asyncio.run(main())
    assert [r.json()["code"] for r in replies] == ["invalid_value"] * 8
    assert len(renderer.threads) == 8 and loop_thread not in renderer.threads
    assert renderer.overlaps == 0
