"""weightsync's admin routes inside vLLM's own OpenAI-compatible server.

vLLM's server takes ASGI middleware by import path (``--middleware``); this one answers
``/engine/*`` with weightsync's admin routes over the server's own engine client, and passes
everything else to vLLM untouched, so users keep vLLM's full API::

    vllm serve MODEL \\
        --worker-extension-cls weightsync.engines.vllm.worker.WeightSyncExtension \\
        --middleware weightsync.engines.vllm.middleware.WeightSyncMiddleware

Settings come from the environment: ``WEIGHTSYNC_API_KEY`` (bearer token for the admin
routes), ``WEIGHTSYNC_ALLOWED_WEIGHT_DIRS`` (``:``-separated) and
``WEIGHTSYNC_ALLOWED_HOSTS`` (``,``-separated, see ``weightsync.transports.http.guard``).  Completions go through
vLLM's own routes, so they carry no weightsync version stamps; read
``/engine/get_weight_version`` instead.
"""

from __future__ import annotations

import os
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

PREFIX = "/engine/"


class WeightSyncMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._admin: Any = None

    def _build(self, server_app: Any) -> Any:
        from fastapi import FastAPI

        from weightsync.core import Controller
        from weightsync.transports.http import admin_router, install_error_handlers
        from weightsync.transports.http.guard import SiteGuard

        from .engine import VllmEngine

        dirs = [d for d in os.environ.get("WEIGHTSYNC_ALLOWED_WEIGHT_DIRS", "").split(":") if d]
        engine = VllmEngine(server_app.state.engine_client, allowed_weight_dirs=dirs or None, owns=False)
        admin = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
        install_error_handlers(admin)
        admin.include_router(
            admin_router(
                Controller(engine), api_key=os.environ.get("WEIGHTSYNC_API_KEY"), world_size=engine.world_size
            )
        )
        hosts = [h for h in os.environ.get("WEIGHTSYNC_ALLOWED_HOSTS", "").split(",") if h]
        return SiteGuard(admin, allowed_hosts=hosts)  # JSON bodies, same origin, no rebound Host

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PREFIX):
            if self._admin is None:
                self._admin = self._build(scope["app"])
            await self._admin(scope, receive, send)
            return
        await self.app(scope, receive, send)
