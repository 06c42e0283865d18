"""The HTTP transport: FastAPI app and router serving the admin routes over a controller.

Every route is ``POST /engine/<name>`` with a JSON-object body (empty body = ``{}``) and
answers a JSON object with ``status: "ok" | "error"``.  Bodies are parsed by
``weightsync.core.requests`` (strict: FastAPI does no coercion here), errors are the
``weightsync.core.errors`` family mapped to their HTTP status, and no request can take the
server down: anything unexpected is a 500 reply, never a crash.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import attrs
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from weightsync import __version__
from weightsync.core import events
from weightsync.core.controller import Controller
from weightsync.core.engine import (
    ClosingEngine,
    DescribedEngine,
    GeneratingEngine,
    StartingEngine,
    TrackingEngine,
)
from weightsync.core.errors import PayloadTooLarge, WeightSyncError
from weightsync.core.routes import ROUTES, dispatch
from weightsync.edge import dynamo
from weightsync.edge.dialects import VLLM_VERSIONS
from weightsync.edge.idempotency import keyed_dispatch
from weightsync.lora.commands import AdapterSlots
from weightsync.serve import schemas
from weightsync.serve.completions import add_completion_routes
from weightsync.serve.dialects import BODILESS_PATHS, add_dialect_routes
from weightsync.serve.dialects.vllm_lora import add_lora_routes
from weightsync.serve.edge import bearer_check, internal_error, read_json_body
from weightsync.serve.generation.admission import Admission
from weightsync.serve.generation.fields import MAX_LOGPROBS
from weightsync.serve.guard import SiteGuard
from weightsync.serve.idempotency import IdempotencyHeader
from weightsync.serve.lora import ModelSelection, adapter_slots
from weightsync.serve.metrics import Metrics
from weightsync.serve.replies import JSONReply, error_response

__all__ = ["JSONReply", "admin_router", "create_app", "error_response", "install_error_handlers"]

DEFAULT_MAX_BODY = 16 << 20


class BodyLimit:
    """ASGI middleware: refuse bodies over ``limit`` bytes with 413 before reading them whole."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = PayloadTooLarge(f"request body exceeds {self.limit} bytes")
        for key, value in scope.get("headers", []):
            if key == b"content-length" and value.isdigit() and int(value) > self.limit:
                await error_response(too_large)(scope, receive, send)
                return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise too_large  # handlers answer it like any refusal: 413
            return message

        await self.app(scope, limited, send)


@attrs.define
class Taints:
    """The routing taints a worker carries (Dynamo's ``POST /engine/update/model_taints``): a
    router routes nothing to a worker that carries any.  Routing metadata of the front door,
    not weight state: no command changes them; ``get_weight_version`` reports them (``taints``)."""

    held: frozenset[str] = frozenset()

    def reported(self, reply: dict[str, Any]) -> dict[str, Any]:
        """A ``get_weight_version`` reply with the taints beside the state, when there are any
        (a worker without taints answers exactly its state)."""
        return {**reply, "taints": sorted(self.held)} if self.held else reply


def admin_router(
    controller: Controller,
    *,
    api_key: str | None = None,
    metrics: Metrics | None = None,
    world_size: int = 1,
    taints: Taints | None = None,
    adapters: AdapterSlots | None = None,
) -> APIRouter:
    """The admin routes as a router any FastAPI app can include (``app.include_router``).

    Include :func:`install_error_handlers` on the app too, so errors get JSON replies, and
    wrap the app in :class:`~weightsync.serve.guard.SiteGuard` for cross-site safety.
    ``taints``: where Dynamo's ``update/model_taints`` keeps the worker's routing taints (a
    new holder when not given); ``adapters``: the LoRA slots ``get_weight_version`` reports
    beside the base's state (``max_loras``, ``adapters``), on a worker that serves them.
    """
    router = APIRouter(prefix="/engine", tags=["admin"])
    check = bearer_check(api_key)
    taints = taints if taints is not None else Taints()

    def make(name: str) -> Callable[[Request], Awaitable[JSONResponse]]:
        async def handle(request: Request) -> JSONResponse:
            t0 = time.perf_counter()
            reply: dict[str, Any] | None = None
            code = "ok"
            try:
                check(request)
                # Dynamo's engine_rpc forms mean one call of a registry route (edge/dynamo.py)
                body = await read_json_body(request)
                reply = await keyed_dispatch(controller, *dynamo.translate(name, body))  # a key: run once
                if name == "get_weight_version":
                    reply = taints.reported(reply)
                    if adapters is not None:
                        reply = {**reply, **adapters.to_reply()}
                return JSONReply(reply)
            except WeightSyncError as exc:
                code = exc.code
                return error_response(exc)
            except Exception as exc:  # the server answers, logs, and keeps serving
                code = "internal_error"
                return internal_error(exc)
            finally:
                if metrics is not None:
                    metrics.observe(name, code, time.perf_counter() - t0, reply)

        handle.__name__ = name
        return handle

    for name, route in ROUTES.items():
        router.add_api_route(
            f"/{name}",
            make(name),
            methods=["POST"],
            summary=route.summary,
            response_class=JSONResponse,
            openapi_extra={
                "requestBody": {
                    "required": False,
                    "content": {"application/json": {"schema": schemas.documented(route.body)}},
                },
                "responses": {
                    "200": {"description": "ok", "content": {"application/json": {"schema": route.reply}}},
                    **schemas.error_responses(),
                },
            },
        )

    @router.get(
        "/capabilities", summary="What this worker speaks and supports (as POST /engine/capabilities)."
    )
    async def capabilities(request: Request) -> JSONResponse:
        try:
            check(request)
            return JSONReply(await dispatch(controller, "capabilities", {}))
        except WeightSyncError as exc:
            return error_response(exc)

    @router.post(
        f"/{dynamo.TAINT_ROUTE}",
        summary="Dynamo's routing taints: a router routes nothing to a worker carrying any ([] clears them).",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": schemas.MODEL_TAINTS}},
            },
            "responses": {"200": {"description": "ok"}, **schemas.error_responses()},
        },
    )
    async def update_model_taints(request: Request) -> JSONResponse:
        try:
            check(request)
            taints.held = dynamo.model_taints(await read_json_body(request))
        except WeightSyncError as exc:
            return error_response(exc)
        events.taints_set(sorted(taints.held))
        return JSONReply({"status": "ok", "taints": sorted(taints.held)})

    @router.get("/routes", summary="List the admin routes this worker serves.")
    async def routes(request: Request) -> JSONResponse:
        try:
            check(request)
        except WeightSyncError as exc:
            return error_response(exc)
        return JSONReply(
            {
                "status": "ok",
                "routes": sorted(ROUTES),
                "engine": controller.engine.name,
                "world_size": world_size,
            }
        )

    return router


def install_error_handlers(app: FastAPI) -> None:
    """Answer unknown paths, wrong methods and unexpected failures with JSON error objects."""

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "unknown_route", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        message = str(exc.detail)
        if exc.status_code == 405 and request.url.path.startswith("/engine/"):
            message = (
                f"{request.method} {request.url.path}: admin routes are POST with a JSON object body, "
                f"e.g. curl -X POST {request.url.path} -H 'Content-Type: application/json' -d '{{}}'"
            )
        return JSONReply(
            {"status": "error", "code": code, "message": message},
            status_code=exc.status_code,
            headers=exc.headers,
        )

    @app.exception_handler(WeightSyncError)
    async def family_error(_: Request, exc: WeightSyncError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        return internal_error(exc)


def create_app(
    controller: Controller,
    *,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY,
    world_size: int = 1,
    allowed_hosts: Iterable[str] | None = None,
    dialect: str | None = None,
    auto_pause_updates: bool = False,
    vllm_version: str = VLLM_VERSIONS[-1],
    max_logprobs: int = MAX_LOGPROBS,
    max_loras: int = 0,
) -> FastAPI:
    """A complete worker app: admin routes, the dialects' routes, ``/v1/completions`` (when
    the engine generates), ``/v1/models``, ``/health``, ``/metrics`` and OpenAPI at ``/docs``.
    ``dialect``, ``auto_pause_updates`` and ``vllm_version`` are ``serve --dialect``,
    ``--auto-pause-updates`` and ``--vllm-version`` (see
    :func:`~weightsync.serve.dialects.add_dialect_routes`); ``max_logprobs`` is
    ``--max-logprobs``, the most alternatives per token a generation request may ask for;
    ``max_loras`` is ``--max-loras``, the LoRA adapters served at once (0: none; vLLM's
    ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` then, :mod:`weightsync.serve.lora`).

    Every request passes :class:`~weightsync.serve.guard.SiteGuard` first: POST
    bodies must be JSON, a foreign ``Origin`` is refused, and a request arriving over
    loopback must name a loopback host or one of ``allowed_hosts`` (``["*"]`` allows any).
    """
    metrics = Metrics(controller)
    slots = adapter_slots(controller.engine, max_loras)
    selection = ModelSelection(controller.engine.name, slots)
    # Swagger UI and ReDoc from assets shipped in a package, served by the worker: /docs works offline.
    app = FastAPIOffline(
        title="weightsync worker",
        version=__version__,
        summary="Weight-update admin routes",
        lifespan=_lifespan,
    )
    app.state.controller = controller
    app.state.adapters = slots
    app.state.metrics = metrics
    app.state.abort_in_flight = lambda: abort_in_flight(controller)
    app.state.admission = admission = Admission(lambda: controller.snapshot().paused)
    install_error_handlers(app)
    app.state.taints = taints = Taints()
    app.include_router(
        admin_router(
            controller, api_key=api_key, metrics=metrics, world_size=world_size, taints=taints, adapters=slots
        )
    )
    if slots is not None:
        add_lora_routes(app, slots, bearer_check(api_key))
    add_dialect_routes(
        app,
        controller,
        bearer_check(api_key),
        metrics=metrics,
        world_size=world_size,
        dialect=dialect,
        auto_pause_updates=auto_pause_updates,
        admission=admission,
        vllm_version=vllm_version,
    )
    app.state.on_close = []  # what the lifespan stops after the engine closes
    if isinstance(controller.engine, GeneratingEngine):
        app.state.on_close.append(
            add_completion_routes(
                app,
                controller.engine,
                api_key=api_key,
                metrics=metrics,
                admission=admission,
                max_logprobs=max_logprobs,
                selection=selection,
            )
        )

    @app.get("/health", summary="200 while the engine is alive, 503 otherwise.")
    async def health() -> JSONResponse:
        alive = await controller.is_alive()
        snap = controller.snapshot()
        body: dict[str, Any] = {
            "status": "ok" if alive else "error",
            "alive": alive,
            "torn": snap.torn,
            "paused": snap.paused,
        }
        if isinstance(controller.engine, TrackingEngine):
            body["in_flight"] = len(controller.engine.in_flight())
        if not alive:
            body["code"] = "engine_unavailable"
        return JSONReply(body, status_code=200 if alive else 503)

    started = int(time.time())

    @app.get("/v1/models", summary="The served model, and the LoRA adapters served, as OpenAI's model list.")
    async def models(request: Request) -> JSONResponse:
        try:
            bearer_check(api_key)(request)
        except WeightSyncError as exc:
            return error_response(exc)
        engine = controller.engine
        name = engine.name
        card = {"id": name, "object": "model", "created": started, "owned_by": "weightsync", "root": name,
                "parent": None}  # fmt: skip
        if isinstance(engine, DescribedEngine):  # vLLM's card has it; TRL's AsyncGRPO reads it
            card["max_model_len"] = engine.max_model_len
        return JSONReply({"object": "list", "data": [card, *selection.cards(started)]})

    @app.get("/metrics", summary="Prometheus metrics.")
    async def prometheus() -> Response:
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(IdempotencyHeader)  # an update's key from its header (core/idempotency.py)
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    app.add_middleware(  # outermost: refused before the body is read
        SiteGuard, allowed_hosts=allowed_hosts, bodiless_paths=BODILESS_PATHS
    )
    return app


async def abort_in_flight(controller: Controller) -> int:
    """Abort every queued, kept or running request of the engine; return how many.

    The server calls this when it starts shutting down, so a completion waiting on a paused
    worker ends (``finish_reason: "abort"``) instead of holding the shutdown open.
    """
    engine = controller.engine
    if not isinstance(engine, TrackingEngine):
        return 0
    aborted = 0
    for request_id in list(engine.in_flight()):
        with contextlib.suppress(Exception):  # shutting down: one failure must not keep the rest
            aborted += bool(await engine.abort_request(request_id))
    return aborted


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    engine = app.state.controller.engine
    if isinstance(engine, StartingEngine):
        engine.start()
    try:
        yield
    finally:
        try:
            if isinstance(engine, ClosingEngine):
                await engine.close()
        finally:
            for close in app.state.on_close:
                close()
