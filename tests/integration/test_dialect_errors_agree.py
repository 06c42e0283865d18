"""A worker's dialect routes and the router's fleet routes shape a refusal with one shaper per
dialect (``weightsync.edge.dialects``): the same bad request gets the same error body
from both.  The real worker app and the real router app, in this process
(``httpx.ASGITransport``); the router's worker is never reached, since every request here is
refused before any fleet operation."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.helpers import TINY
from weightsync.core import Controller
from weightsync.engines.reference import ReferenceEngine
from weightsync.router.app import create_router_app
from weightsync.router.service import Router
from weightsync.serve import create_app

KEY = "k" * 32

VLLM = [
    ("POST", "/pause?bogus=1", b"{}", KEY),
    ("POST", "/pause?mode=sideways", b"{}", KEY),
    ("POST", "/pause?mode=abort&mode=wait", b"{}", KEY),
    ("POST", "/pause?clear_cache=maybe", b"{}", KEY),
    ("POST", "/resume", b'{"bogus": 1}', KEY),
    ("POST", "/resume", b"{not json", KEY),
    ("GET", "/is_paused?bogus=1", b"", KEY),
    ("GET", "/weight_info?bogus=1", b"", KEY),
    ("POST", "/pause", b"{}", "wrong"),
]
SGLANG = [
    ("POST", "/pause_generation", b'{"bogus": 1}', KEY),
    ("POST", "/continue_generation", b"{not json", KEY),
    # abort_all_requests (SGLang's field alone) makes the worker answer in SGLang's shape; a bare
    # {} is vLLM's on a worker (docs/dialects.md, shared paths)
    ("POST", "/update_weight_version", b'{"abort_all_requests": false}', KEY),
    ("POST", "/update_weights_from_disk", b"{}", KEY),
    ("POST", "/pause_generation", b"{}", "wrong"),
]


def both(method: str, path: str, body: bytes, key: str) -> tuple[httpx.Response, httpx.Response]:
    """The worker's and the router's replies to one request."""

    async def ask() -> tuple[httpx.Response, httpx.Response]:
        worker = create_app(Controller(ReferenceEngine(TINY)), api_key=KEY)
        router = Router(["http://127.0.0.1:9"])
        headers = {"content-type": "application/json", "authorization": f"Bearer {key}"}
        replies = []
        try:
            for app in (worker, create_router_app(router, api_key=KEY)):
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
                    content = body if method == "POST" else None
                    replies.append(await client.request(method, path, content=content, headers=headers))
        finally:
            await router.stop()
        return replies[0], replies[1]

    return asyncio.run(ask())


@pytest.mark.parametrize(("method", "path", "body", "key"), VLLM)
def test_the_router_and_a_worker_give_the_same_vllm_error_body(
    method: str, path: str, body: bytes, key: str
) -> None:
    worker, router = both(method, path, body, key)
    assert worker.status_code == router.status_code >= 400
    assert "error" in router.json() and router.json()["error"]["code"] == router.status_code
    assert worker.content == router.content + b"\n"  # the worker ends its replies with a newline


@pytest.mark.parametrize(("method", "path", "body", "key"), SGLANG)
def test_the_router_and_a_worker_give_the_same_sglang_error_body(
    method: str, path: str, body: bytes, key: str
) -> None:
    worker, router = both(method, path, body, key)
    assert worker.status_code == router.status_code >= 400
    theirs = json.loads(router.content)
    assert theirs["success"] is False and theirs["code"]
    ours = json.loads(worker.content)
    # A worker adds the state the failure left; the rest is the router's body, in its order.
    assert list(ours.items()) == [*theirs.items(), ("torn", False), ("paused", False)]
