"""The ``Idempotency-Key`` header, for every route of the front door.

An update's idempotency key may come as the body's ``idempotency_key`` (weightsync's own
routes) or as this header on any route, the dialects' included: TRL's and vLLM's clients
send bodies whose fields are fixed, but a retrying client or a proxy can add a header.  This
middleware hands the header to :func:`~weightsync.edge.idempotency.keyed_dispatch` for the request it
came with (:data:`~weightsync.edge.idempotency.HEADER_KEY`), which carries the update out once.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from weightsync.edge.idempotency import HEADER_KEY

_NAME = b"idempotency-key"


class IdempotencyHeader:
    """ASGI middleware: the request's ``Idempotency-Key`` header, while it is handled."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = None
        if scope["type"] == "http":
            key = next((v.decode("latin-1") for n, v in scope.get("headers", ()) if n == _NAME), None)
        if key is None:
            await self.app(scope, receive, send)
            return
        token = HEADER_KEY.set(key)
        try:
            await self.app(scope, receive, send)
        finally:
            HEADER_KEY.reset(token)
