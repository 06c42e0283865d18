"""The router's HTTP surface (Starlette): completions, fleet admin, status, health, metrics.

Every reply is a JSON object; errors are ``{"status": "error", "code", "message"}`` with a
real HTTP status, and bad input on any route is a 4xx that changes nothing.  Every request
passes the same site guard as a worker's (``weightsync.edge.guard``), and with an API key
every route but ``/health`` and ``/metrics`` needs ``Authorization: Bearer <key>``.

| route | body | reply beyond ``status`` |
|---|---|---|
| ``POST /v1/completions`` | the worker's completion body, plus ``min_weight_epoch``, ``max_staleness``, ``weight_version`` | the worker's reply, ``worker``, ``weight_epoch`` |
| ``POST /v1/chat/completions``, ``POST /generate`` | as ``/v1/completions`` (SGLang's batch replies are relayed as they are, labelled by headers) | as ``/v1/completions`` |
| ``GET /v1/models`` | – | a routable worker's model list |

A generation request with ``"stream": true`` is relayed as the worker's server-sent events,
chunk by chunk (see :mod:`weightsync.router.streams`); the freshness policy picks the worker
before the first byte.
| ``POST /fleet/update_weights_from_disk`` | ``model_path``, ``weight_version``, ``policy``, ``min_workers``, ``pause_mode``, ``deadline_s``, ``max_unavailable``, ``expected_digest`` | the transaction result |
| ``POST /fleet/set_weight_version`` | ``weight_version`` | the transaction result |
| ``POST /fleet/pause_generation`` | ``mode``, ``clear_cache`` | ``workers`` (per-worker outcome) |
| ``POST /fleet/resume_generation`` | – | ``workers`` |
| ``GET /fleet/status`` | – | ``epoch``, ``version``, ``baseline``, ``workers`` |
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Final

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from weightsync.core.errors import WeightSyncError
from weightsync.core.validation import Body, any_json, boolean, one_of
from weightsync.edge.events import HEADERS, MEDIA_TYPE, send_events
from weightsync.edge.guard import SiteGuard
from weightsync.edge.origin import check_api_key, check_bearer
from weightsync.fleet.result import PAUSE_MODES
from weightsync.router.answers import Answer, error_answer
from weightsync.router.dialects import DIALECT_PATHS, dialect_routes
from weightsync.router.policy import HEADER, request_policy
from weightsync.router.requests import parse_update, read_object, read_raw_object
from weightsync.router.service import Router
from weightsync.router.streams import Upstream, relay

GENERATION_PATHS: Final = ("/v1/completions", "/v1/chat/completions", "/generate")
"""The generation routes the router relays to a worker."""

KEEP_ALIVE_S: Final = 75
"""How long the router keeps an idle client connection open: longer than clients' pools keep
theirs (httpx: 5 s), so a client never sends on a connection the router is closing."""


def render(answer: Answer) -> Response:
    """``answer`` as a JSON response: its ``raw`` bytes, else its body dumped (ASCII escapes:
    a message quoting hostile text still renders)."""
    body = (
        answer.raw
        if answer.raw is not None
        else json.dumps(answer.body, separators=(",", ":"), allow_nan=False).encode()
    )
    return Response(body, answer.status, headers=dict(answer.headers), media_type="application/json")


class RelayedStream(Response):
    """A worker's stream relayed (:func:`weightsync.router.streams.relay`), closed when the
    client leaves."""

    def __init__(self, upstream: Upstream) -> None:
        super().__init__(None, 200, headers={**HEADERS, **upstream.headers}, media_type=MEDIA_TYPE)
        self.raw_headers = [h for h in self.raw_headers if h[0] != b"content-length"]
        self.upstream = upstream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_events(relay(self.upstream), receive, send, 200, self.raw_headers)  # type: ignore[arg-type]


def error_response(exc: WeightSyncError) -> Response:
    """``exc`` as the router's JSON error reply, with its HTTP status."""
    return render(error_answer(exc))


Handler = Callable[[Request], Awaitable[Answer | Upstream]]


def create_router_app(
    router: Router, *, api_key: str | None = None, allowed_hosts: Iterable[str] | None = None
) -> ASGIApp:
    """The router's ASGI app over ``router`` (started and stopped with the app's lifespan)."""
    check_api_key(api_key)

    def route(handler: Handler, *, auth: bool = True) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                if auth:
                    check_bearer(request.headers.get("authorization"), api_key)
                answer = await handler(request)
                return RelayedStream(answer) if isinstance(answer, Upstream) else render(answer)
            except WeightSyncError as exc:
                return error_response(exc)
            except Exception as exc:  # answer, and keep serving
                return render(
                    Answer(
                        500,
                        {
                            "status": "error",
                            "code": "internal_error",
                            "message": f"{type(exc).__name__}: {exc}",
                        },
                    )
                )

        return endpoint

    def check(request: Request) -> None:
        check_bearer(request.headers.get("authorization"), api_key)

    def generation(path: str) -> Handler:
        async def forward(request: Request) -> Answer | Upstream:
            raw, body = await read_raw_object(request)
            policy = request_policy(body, request.headers.get(HEADER), router.default_policy)
            return await router.complete(body, policy, raw, path)

        return forward

    async def models(request: Request) -> Answer:
        return await router.models()

    async def update(request: Request) -> Answer:
        return await router.update(parse_update(await read_object(request), len(router.urls)))

    async def set_version(request: Request) -> Answer:
        b = Body(await read_object(request), ("weight_version",))
        return await router.set_version(b.get("weight_version", any_json))

    async def pause(request: Request) -> Answer:
        b = Body(await read_object(request), ("mode", "clear_cache"))
        return await router.pause(
            b.get("mode", one_of(PAUSE_MODES), "keep"), b.get("clear_cache", boolean, False)
        )

    async def resume(request: Request) -> Answer:
        Body(await read_object(request), ())
        return await router.resume()

    async def status(request: Request) -> Answer:
        return Answer(200, router.status())

    async def health(request: Request) -> Answer:
        routable = sum(w.machine.routable and not w.taints for w in router.view.workers.values())
        body = {"status": "ok", "routable": routable, "workers": len(router.urls)}
        if routable:
            return Answer(200, body)
        return Answer(
            503, {**body, "status": "error", "code": "no_worker", "message": "no worker is routable"}
        )

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def not_found(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        code = {404: "unknown_route", 405: "method_not_allowed"}.get(status, "http_error")
        detail = exc.detail if isinstance(exc, HTTPException) else str(exc)
        return render(Answer(status, {"status": "error", "code": code, "message": str(detail)}))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = Starlette(
        routes=[
            *(Route(p, route(generation(p)), methods=["POST"]) for p in GENERATION_PATHS),
            Route("/v1/models", route(models), methods=["GET"]),
            Route("/fleet/update_weights_from_disk", route(update), methods=["POST"]),
            Route("/fleet/set_weight_version", route(set_version), methods=["POST"]),
            Route("/fleet/pause_generation", route(pause), methods=["POST"]),
            Route("/fleet/resume_generation", route(resume), methods=["POST"]),
            Route("/fleet/status", route(status), methods=["GET"]),
            Route("/health", route(health, auth=False), methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            *dialect_routes(router, read_object, check),
        ],
        exception_handlers={HTTPException: not_found},
        lifespan=lifespan,
    )
    app.state.router = router
    # vLLM's client posts its routes with no body and no Content-Type (see SitePolicy.check).
    return SiteGuard(app, error_response, allowed_hosts, bodiless_paths=DIALECT_PATHS)
