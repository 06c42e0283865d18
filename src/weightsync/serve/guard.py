"""The worker's site guard: the cross-site rules of :mod:`weightsync.edge.guard` (the
reasoning behind each rule is there), refusing as the worker answers every other error.

``SiteGuard`` keeps the shape an embedding server adds it with
(``app.add_middleware(SiteGuard, allowed_hosts=[])``); the router applies the same
:class:`weightsync.edge.guard.SiteGuard` with its own replies.
"""

from __future__ import annotations

from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from weightsync.edge import guard
from weightsync.edge.origin import (
    LOOPBACK_HOSTS,
    SAFE_METHODS,
    SINGLE_HEADERS,
    SitePolicy,
    host_name,
    is_loopback_address,
    request_headers,
)
from weightsync.serve.replies import error_response

__all__ = [
    "LOOPBACK_HOSTS", "SAFE_METHODS", "SINGLE_HEADERS", "SiteGuard", "SitePolicy", "host_name",
    "is_loopback_address", "request_headers",
]  # fmt: skip


class SiteGuard:
    """ASGI middleware applying a :class:`SitePolicy` to every HTTP request before the app
    sees it; a refusal is the worker's JSON error reply.

    ``bodiless_paths``: paths whose POST may come with no body and no ``Content-Type`` (the
    dialects' routes: vLLM's client posts so); see :meth:`SitePolicy.check`."""

    def __init__(
        self, app: ASGIApp, allowed_hosts: Iterable[str] | None = None, bodiless_paths: Iterable[str] = ()
    ) -> None:
        self.guard = guard.SiteGuard(app, error_response, allowed_hosts, bodiless_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.guard(scope, receive, send)
