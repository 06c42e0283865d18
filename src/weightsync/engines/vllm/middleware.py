"""weightsync's admin routes inside vLLM's own OpenAI-compatible server.

vLLM's server takes ASGI middleware by import path (``--middleware``); this one answers
``/engine/*`` with weightsync's admin routes over the server's own engine client, answers
vLLM's native RL routes (``/pause``, ``/start_weight_update``, ``/update_weights``, ...) and
SGLang's (see docs/dialects.md) through the same controller, so they get weightsync's
guarantees and need no ``VLLM_SERVER_DEV_MODE``, and passes everything else to vLLM
untouched, so users keep vLLM's full API::

    vllm serve MODEL \\
        --worker-extension-cls weightsync.engines.vllm.worker.WeightSyncExtension \\
        --middleware weightsync.engines.vllm.middleware.WeightSyncMiddleware

Settings come from the environment: ``WEIGHTSYNC_API_KEY`` (bearer token for the admin
routes), ``WEIGHTSYNC_ALLOWED_WEIGHT_DIRS`` (``:``-separated) and
``WEIGHTSYNC_ALLOWED_HOSTS`` (``,``-separated, see ``weightsync.edge.guard``).  Completions go through
vLLM's own routes; their JSON bodies get the weight epoch's ``cache_salt`` (routes in
:data:`SALTED`), so they never reuse KV that other weights computed, and the replies of
:data:`STAMPED` (whole or streamed) carry weightsync's version stamps, as the worker's own
completions do (:mod:`~weightsync.engines.vllm.server_stamps`).
"""

from __future__ import annotations

import json
import os
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from weightsync.engines.sampling import valid_salt
from weightsync.engines.vllm.engine import cache_salt
from weightsync.engines.vllm.server_stamps import CURRENT, Tracker, follow_generation

PREFIX = "/engine/"
# vLLM's generation routes that take a ``cache_salt`` field in their JSON body.
SALTED = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})
# Those whose replies weightsync stamps with the weight versions that produced them.
STAMPED = frozenset({"/v1/completions", "/v1/chat/completions"})


class WeightSyncMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._admin: Any = None
        self._engine: Any = None

    def _build(self, server_app: Any) -> Any:
        from fastapi import FastAPI

        from weightsync.core import Controller
        from weightsync.engines.vllm.engine import VllmEngine
        from weightsync.serve import admin_router, install_error_handlers
        from weightsync.serve.dialects import BODILESS_PATHS, add_dialect_routes
        from weightsync.serve.edge import bearer_check
        from weightsync.serve.guard import SiteGuard

        dirs = [d for d in os.environ.get("WEIGHTSYNC_ALLOWED_WEIGHT_DIRS", "").split(":") if d]
        engine = self._engine = VllmEngine(
            server_app.state.engine_client, allowed_weight_dirs=dirs or None, owns=False
        )
        admin = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
        install_error_handlers(admin)
        api_key = os.environ.get("WEIGHTSYNC_API_KEY")
        controller = Controller(engine)
        admin.include_router(admin_router(controller, api_key=api_key, world_size=engine.world_size))
        # vLLM's native RL routes and SGLang's, answered by weightsync (no dev mode needed).
        add_dialect_routes(admin, controller, bearer_check(api_key), world_size=engine.world_size)
        follow_generation(server_app.state.engine_client)  # for the stamps of vLLM's completions
        hosts = [h for h in os.environ.get("WEIGHTSYNC_ALLOWED_HOSTS", "").split(",") if h]
        # JSON bodies, same origin, no rebound Host
        return SiteGuard(admin, allowed_hosts=hosts, bodiless_paths=BODILESS_PATHS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (
            scope["path"].startswith(PREFIX) or scope["path"] in _dialect_paths()
        ):
            if self._admin is None:
                self._admin = self._build(scope["app"])
            await self._admin(scope, receive, send)
            return
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in SALTED:
            if self._admin is None:  # the engine's epochs salt and stamp vLLM's completions
                self._admin = self._build(scope["app"])
            scope, receive, data = await self._salted(scope, receive)
            if scope["path"] in STAMPED and isinstance(data, dict):
                await self._stamped(scope, receive, send, data)
                return
        await self.app(scope, receive, send)

    async def _stamped(self, scope: Scope, receive: Receive, send: Send, data: dict[str, Any]) -> None:
        """vLLM answers, its engine requests followed and its reply stamped."""
        n = data.get("n")
        n = n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1
        tracker = Tracker(self._engine.stamps, n, following=data.get("use_beam_search") is not True)
        token = CURRENT.set(tracker)
        try:
            await self.app(scope, receive, tracker.relay(send))
        finally:
            CURRENT.reset(token)

    async def _salted(self, scope: Scope, receive: Receive) -> tuple[Scope, Receive, Any]:
        """The request with the current weight epoch's ``cache_salt`` in its JSON body (a
        caller's own salt kept inside it), and the body read (``None`` when it is not JSON).
        A body that is not a JSON object, or a salt vLLM would refuse, goes on unchanged, for
        vLLM to answer."""
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let vLLM see it
                return scope, _replay([message], receive), None
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        try:
            data = json.loads(body)
        except ValueError:
            data = None
        if isinstance(data, dict):
            user = data.get("cache_salt")
            if user is None or valid_salt(user):
                data["cache_salt"] = cache_salt(self._engine.stamps.epoch, user)
                body = json.dumps(data).encode()
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        replay = _replay([{"type": "http.request", "body": body, "more_body": False}], receive)
        return {**scope, "headers": headers}, replay, data


def _dialect_paths() -> frozenset[str]:
    from weightsync.serve.dialects import DIALECT_PATHS

    return DIALECT_PATHS


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A ``receive`` that answers ``messages`` first, then the connection's own."""
    pending = list(messages)

    async def replay() -> Message:
        return pending.pop(0) if pending else await receive()

    return replay
