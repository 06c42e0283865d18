"""Cross-site safety: what a web page in the operator's browser must not be able to do.

A loopback worker without a key is still reachable from any page the operator visits.
Browsers send some cross-site requests without asking the server first (a "simple
request": a form post, or ``fetch`` with a ``text/plain``, form or multipart body), and a
page can rebind its own DNS name to ``127.0.0.1``.  Three rules close both doors:

1. every POST needs ``Content-Type: application/json`` (415 ``unsupported_media_type``):
   a browser sends that type cross-site only after a CORS preflight, which this server
   never grants;
2. a request whose ``Origin`` header is present must come from the server's own origin
   (403 ``forbidden_origin``); ``Origin: null`` (sandboxed pages, files) is foreign too;
3. a request that arrived on a loopback address must name a loopback host (``localhost``,
   ``127.0.0.1``, ``[::1]``, any port) in its ``Host`` header, so a page whose name was
   rebound to ``127.0.0.1`` is refused (403 ``forbidden_host``).  A loopback-bound worker
   thus answers loopback names only; ``allowed_hosts`` adds names (a local reverse proxy's),
   and ``"*"`` allows any.  Requests that arrived on another interface (a worker bound
   beyond loopback, which needs a key) are not held to it.

GET routes (``/health``, ``/metrics``, ``/engine/routes``, ``/docs``) only pass the Host
rule: they change nothing, and the browser keeps their replies from a foreign page.

A request that repeats ``Host``, ``Origin`` or ``Content-Type`` is refused outright (400
``repeated_header``), GET included: the rules would read one copy and a proxy or the app
might act on the other.

The rules are :class:`~weightsync.edge.origin.SitePolicy`; :class:`SiteGuard` applies them
to every request of an ASGI app, the worker's (``weightsync.serve.guard``) and the
router's alike.  Plain ASGI: no web framework is imported, and each front door says how a
refusal is rendered, so it reads as every other error of that door.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

from weightsync.core.errors import WeightSyncError
from weightsync.edge.origin import SitePolicy, request_headers

__all__ = ["ASGIApp", "Refuse", "SiteGuard"]

# The ASGI shapes, as Starlette spells them (so its apps and responses fit without it).
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

Refuse = Callable[[WeightSyncError], ASGIApp]
"""How a front door answers a refused request: the error as an ASGI response."""


class SiteGuard:
    """ASGI middleware applying a :class:`SitePolicy` to every HTTP request before ``app``
    sees it; a refused request is answered by ``refuse(error)``.

    ``bodiless_paths``: paths whose POST may come with no body and no ``Content-Type`` (the
    dialects' routes: vLLM's client posts so); see :meth:`SitePolicy.check`."""

    def __init__(
        self,
        app: ASGIApp,
        refuse: Refuse,
        allowed_hosts: Iterable[str] | None = None,
        bodiless_paths: Iterable[str] = (),
    ) -> None:
        self.app = app
        self.refuse = refuse
        self.policy = SitePolicy(allowed_hosts)
        self.bodiless = frozenset(bodiless_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            try:
                headers = request_headers(scope["headers"])
                server = scope.get("server") or (None, None)
                self.policy.check(
                    scope["method"],
                    scope.get("scheme", "http"),
                    headers,
                    server[0],
                    bodiless_ok=scope.get("path") in self.bodiless,
                )
            except WeightSyncError as exc:
                await self.refuse(exc)(scope, receive, send)
                return
        await self.app(scope, receive, send)
