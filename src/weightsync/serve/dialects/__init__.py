"""The dialects a worker speaks beside its own ``/engine/*`` routes: vLLM's native RL API
and SGLang's RL routes, each a thin mapping onto the route registry (see docs/dialects.md).

:func:`add_dialect_routes` serves both on a FastAPI app (the worker app, and the admin app
inside vLLM's server that :mod:`weightsync.engines.vllm.middleware` builds);
:data:`DIALECT_PATHS` are the paths they answer, which the middleware takes over from vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from fastapi import FastAPI, Request

from weightsync.core.controller import Controller
from weightsync.serve.dialects.common import Calls
from weightsync.serve.dialects.sglang import SglangDialect
from weightsync.serve.dialects.vllm import VllmDialect
from weightsync.serve.metrics import Metrics

DIALECTS: Final = ("weightsync", "vllm", "sglang")
"""What a worker speaks: its own admin routes, vLLM's RL API, SGLang's RL routes."""

DIALECT_PATHS: Final = frozenset(
    [path for _, path, _ in VllmDialect.ROUTES]
    + [path for _, path, _ in SglangDialect.ROUTES]
    + ["/flush_cache"]
)

BODILESS_PATHS: Final = DIALECT_PATHS
"""Paths whose POST may come without a body and without ``Content-Type`` (vLLM's client
posts ``/start_weight_update`` so); see :class:`weightsync.edge.origin.SitePolicy`."""


def add_dialect_routes(
    app: FastAPI,
    controller: Controller,
    check: Callable[[Request], None],
    *,
    metrics: Metrics | None = None,
    world_size: int = 1,
) -> None:
    """Serve vLLM's and SGLang's routes on ``app`` over ``controller``; ``check`` is the
    bearer-token check of the admin routes (the dialects get the same)."""
    controller.dialects = DIALECTS
    calls = Calls(controller, metrics)
    app.include_router(VllmDialect(controller, calls, world_size).router(check))
    app.include_router(SglangDialect(controller, calls).router(check))
