"""What both dialects share: reading a body, running registry routes, and the refusals a
dialect adds on top of weightsync's own parsers (pickled payloads, fields it cannot honour).

A dialect never decides legality or validates a weight source itself: it renames fields,
fills in the dialect's defaults and calls :func:`weightsync.core.routes.dispatch`, so every
rule lives once, in the registry's parsers and the controller.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Collection
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response

from weightsync.core.controller import Controller
from weightsync.core.errors import InvalidRequest, NotSupported
from weightsync.core.routes import Reply
from weightsync.edge.dialects import DEFAULT_VERSION
from weightsync.edge.idempotency import keyed_dispatch
from weightsync.serve.edge import read_json_body
from weightsync.serve.metrics import Metrics
from weightsync.serve.replies import JSONReply

__all__ = [
    "Calls",
    "dict_body",
    "endpoint",
    "named_routes",
    "read_json_body",
    "refuse_pickle",
    "refuse_unsupported",
    "weight_label",
]  # fmt: skip


class Calls:
    """Runs registry routes for one dialect request, recording each in the metrics under its
    weightsync route name (so a dialect request counts where the work happened)."""

    def __init__(self, controller: Controller, metrics: Metrics | None) -> None:
        self.controller = controller
        self.metrics = metrics

    async def __call__(self, route: str, body: Any) -> Reply:
        t0 = time.perf_counter()
        code = "ok"
        reply: Reply | None = None
        try:
            reply = await keyed_dispatch(self.controller, route, body)  # a key: run once
            return reply
        except Exception as exc:
            code = getattr(exc, "code", "internal_error")
            raise
        finally:
            if self.metrics is not None:
                self.metrics.observe(route, code, time.perf_counter() - t0, reply)


def weight_label(controller: Controller) -> dict[str, Any]:
    """The version a worker serves as both dialects report it (``"default"`` while none was
    declared), whether it was declared, and the digest of the weights held."""
    snap = controller.snapshot()
    return {
        "weight_version": snap.version_value if snap.version_declared else DEFAULT_VERSION,
        "version_declared": snap.version_declared,
        "digest": snap.digest,
    }


def dict_body(field: str, value: Any) -> dict[str, Any]:
    """``value`` as an object, else ``InvalidRequest`` (``wrong_type``) naming ``field``."""
    if type(value) is not dict:
        raise InvalidRequest(f"{field} must be a JSON object", code="wrong_type", field=field)
    return value


PICKLED_FIELDS = {
    "ipc_handles_pickled": (
        "weightsync never unpickles anything: send tensors through shared memory "
        "(POST /engine/update_weights_from_tensor with weightsync.trainer.share), a checkpoint "
        "(update_weights_from_disk) or a broadcast (the nccl or weightsync backend)"
    ),
    "ipc_handles": (
        "CUDA IPC handles are not JSON and would need pickle, which weightsync refuses: send "
        "shared-memory handles to /engine/update_weights_from_tensor, or use the nccl or "
        "weightsync backend"
    ),
    "serialized_named_tensors": (
        "serialized named tensors are pickled, and weightsync never unpickles anything: send "
        "shared-memory handles to /engine/update_weights_from_tensor (weightsync.trainer.share), "
        "a checkpoint to /update_weights_from_disk, or broadcast with /update_weights_from_distributed"
    ),
}


def refuse_pickle(body: dict[str, Any]) -> None:
    """Refuse a body carrying a pickled payload (400 ``pickle_refused``), before anything runs."""
    for field, advice in PICKLED_FIELDS.items():
        if field in body:
            raise InvalidRequest(f"{field} refused: {advice}", code="pickle_refused", field=field)


def refuse_unsupported(body: dict[str, Any], fields: Collection[str], why: Callable[[str], str]) -> None:
    """Refuse fields this worker cannot honour (501 ``not_supported``) when they ask for more
    than the default, so nothing is silently ignored."""
    for field in fields:
        if body.get(field) not in (None, False):
            raise NotSupported(why(field), code="not_supported", field=field)


def endpoint(
    name: str,
    check: Callable[[Request], None],
    handler: Callable[[Request], Awaitable[Any]],
    failure: Callable[[Exception], Response],
) -> Callable[[Request], Awaitable[Response]]:
    """``handler`` as a route named ``name``: the bearer-token ``check`` first, the handler's
    object as JSON, and any failure (a refusal, or anything unexpected) as the dialect's
    ``failure`` reply, so the server answers and keeps serving."""

    async def handle(request: Request) -> Response:
        try:
            check(request)
            return JSONReply(await handler(request))
        except Exception as exc:
            return failure(exc)

    handle.__name__ = name
    return handle


M = TypeVar("M")


def named_routes(methods: M, *names: str) -> tuple[tuple[M, str, str], ...]:
    """Routes whose handler is named like their path: ``(methods, "/name", "name")`` each."""
    return tuple((methods, f"/{name}", name) for name in names)
