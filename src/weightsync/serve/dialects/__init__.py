"""The dialects a worker speaks beside its own ``/engine/*`` routes: vLLM's native RL API
and SGLang's RL routes, each a thin mapping onto the route registry (see docs/dialects.md).

:func:`add_dialect_routes` serves both on a FastAPI app (the worker app, and the admin app
inside vLLM's server that :mod:`weightsync.engines.vllm.middleware` builds);
:data:`DIALECT_PATHS` are the paths they answer, which the middleware takes over from vLLM.

A path both dialects serve (``/update_weight_version``) answers in one dialect's shape: the
one ``serve --dialect`` chose, else the one the request's fields point to
(:func:`weightsync.edge.dialects.shared_dialect`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Final

from fastapi import FastAPI, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute

from weightsync.core.controller import Controller
from weightsync.core.errors import WeightSyncError
from weightsync.edge.dialects import VLLM_VERSIONS, shared_dialect
from weightsync.serve.dialects.common import Calls, read_json_body
from weightsync.serve.dialects.sglang import SglangDialect, serve_not_routed
from weightsync.serve.dialects.vllm import VllmDialect
from weightsync.serve.generation.admission import Admission
from weightsync.serve.metrics import Metrics

DIALECTS: Final = ("weightsync", "vllm", "sglang")
"""What a worker speaks: its own admin routes, vLLM's RL API, SGLang's RL routes."""

CHOICES: Final = ("vllm", "sglang")
"""What ``serve --dialect`` takes: the dialect whose shapes answer the paths both serve."""

VLLM_PATHS: Final = frozenset(path for _, path, _ in (*VllmDialect.ROUTES, *VllmDialect.SHARED_ROUTES))
"""vLLM's RL API."""

SERVER_PATHS: Final = frozenset(path for _, path, _ in VllmDialect.SERVER_ROUTES)
"""vLLM's server routes a worker answers as well (``/server_info``, ``/reset_prefix_cache``);
inside vLLM's own server vLLM keeps answering them."""

SHARED_PATHS: Final = (VLLM_PATHS | SERVER_PATHS) & SglangDialect.PATHS
"""Paths vLLM and SGLang both answer, each in its own shape."""

DIALECT_PATHS: Final = (VLLM_PATHS | SglangDialect.PATHS) - SERVER_PATHS
"""The RL routes of both dialects: inside vLLM's server the middleware takes them over."""

BODILESS_PATHS: Final = DIALECT_PATHS | SERVER_PATHS
"""Paths whose POST may come without a body and without ``Content-Type`` (vLLM's client
posts ``/start_weight_update`` so, TRL's ``/reset_prefix_cache``); see
:class:`weightsync.edge.origin.SitePolicy`."""


def add_dialect_routes(
    app: FastAPI,
    controller: Controller,
    check: Callable[[Request], None],
    *,
    metrics: Metrics | None = None,
    world_size: int = 1,
    dialect: str | None = None,
    auto_pause_updates: bool = False,
    admission: Admission | None = None,
    vllm_version: str = VLLM_VERSIONS[-1],
) -> None:
    """Serve vLLM's and SGLang's routes on ``app`` over ``controller``; ``check`` is the
    bearer-token check of the admin routes (the dialects get the same).

    ``dialect`` (``"vllm"``, ``"sglang"`` or None for both) answers the paths both serve in
    that dialect's shape, and with ``"vllm"`` vLLM's replies carry vLLM's keys only;
    ``auto_pause_updates`` lets vLLM's ``/start_weight_update`` pause a serving worker for
    its update (see :mod:`weightsync.serve.dialects.vllm`); ``vllm_version`` is the vLLM
    release whose behaviour vLLM's routes mirror where releases differ, with ``admission`` the
    generation routes' pause policy it sets (:mod:`weightsync.serve.generation.admission`).
    Raises ``ValueError`` for a dialect outside :data:`CHOICES` or a version outside
    :data:`~weightsync.edge.dialects.VLLM_VERSIONS`."""
    if dialect is not None and dialect not in CHOICES:
        raise ValueError(f"dialect must be one of {list(CHOICES)} or None, got {dialect!r}")
    controller.dialects = DIALECTS
    calls = Calls(controller, metrics)
    if vllm_version not in VLLM_VERSIONS:
        raise ValueError(f"vllm_version must be one of {list(VLLM_VERSIONS)}, got {vllm_version!r}")
    vllm = VllmDialect(
        controller,
        calls,
        world_size,
        exact=dialect == "vllm",
        auto_pause=auto_pause_updates,
        admission=admission if vllm_version != "0.32" else None,
    )
    routers = {"vllm": vllm.router(check), "sglang": SglangDialect(controller, calls).router(check)}
    shared: dict[str, dict[str, APIRoute]] = {path: {} for path in SHARED_PATHS}
    for name, router in routers.items():
        for route in [r for r in router.routes if isinstance(r, APIRoute) and r.path in SHARED_PATHS]:
            shared[route.path][name] = route
            router.routes.remove(route)
    for path, by_dialect in sorted(shared.items()):
        app.add_api_route(
            path,
            _selecting(path, by_dialect, check, dialect),
            methods=sorted({m for route in by_dialect.values() for m in route.methods}),
            include_in_schema=False,
        )
    for router in routers.values():
        app.include_router(router)
    serve_not_routed(app)  # SGLang's 404/405 on its paths, in its shape


def _selecting(
    path: str, by_dialect: dict[str, APIRoute], check: Callable[[Request], None], chosen: str | None
) -> Callable[[Request], Awaitable[Response]]:
    """The endpoint of a path both dialects serve: the request's fields (query and body) pick
    the dialect (:func:`shared_dialect`), whose own endpoint then answers it (a refused token
    or body in its own shape)."""

    async def select(request: Request) -> Response:
        fields: set[str] = set(request.query_params.keys())
        try:
            check(request)
            body = await read_json_body(request) if chosen is None and request.method == "POST" else None
        except WeightSyncError:  # the picked endpoint refuses it; nothing more is read
            body = None
        if isinstance(body, dict):
            fields |= set(body)
        route = by_dialect.get(shared_dialect(path, fields, chosen)) or by_dialect["vllm"]
        return await route.endpoint(request)  # type: ignore[no-any-return]

    select.__name__ = f"shared_{path.strip('/')}"
    return select
