"""The admin routes: for each name, how its body is parsed and which controller call it makes.

Transports (HTTP, an embedding server, the in-process test driver) all go through
:func:`dispatch`, so a route behaves the same whichever way it is reached.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

import attrs

from .controller import Controller
from .errors import NotFound
from .requests import (
    PARSERS,
    AbortRequest,
    DestroyGroupRequest,
    EngineRpcRequest,
    InitGroupRequest,
    PauseRequest,
    SetWeightVersion,
    UpdateRequest,
)

Reply = dict[str, Any]
Handler = Callable[[Controller, Any], Awaitable[Reply]]


async def _get_version(c: Controller, _: Any) -> Reply:
    return c.snapshot().to_reply()


async def _set_version(c: Controller, r: SetWeightVersion) -> Reply:
    snap = await c.declare(r.version, epoch=r.epoch, expected_digest=r.expected_digest)
    return {
        "version": snap.version_value,
        "version_declared": True,
        "digest": snap.digest,
        "epoch": snap.epoch,
    }


async def _update(c: Controller, r: UpdateRequest) -> Reply:
    if r.dry_run:
        dry = await c.dry_run(r)
        return {"dry_run": True, "digest": dry.digest, "epoch": dry.snapshot.epoch}
    out = await c.update(r)
    return {
        "version": r.version.value if r.version is not None else "unknown",
        "version_declared": out.declared,
        "prefix_cache_reset": out.prefix_cache_reset,
        "digest": out.snapshot.digest,
        "epoch": out.snapshot.epoch,
        "stats": out.stats.to_reply(),
    }


async def _verify(c: Controller, _: Any) -> Reply:
    return (await c.verify_weights()).to_reply()


async def _init_group(c: Controller, r: InitGroupRequest) -> Reply:
    await c.init_group(r)
    return {}


async def _destroy_group(c: Controller, r: DestroyGroupRequest) -> Reply:
    await c.destroy_group(r.group_name)
    return {}


async def _pause(c: Controller, r: PauseRequest) -> Reply:
    res = await c.pause(r)
    return {
        "mode": r.mode.value,
        "clear_cache": res.outcome.cache_cleared,
        "aborted": res.outcome.aborted,
        "already_paused": res.was_paused,
    }


async def _resume(c: Controller, _: Any) -> Reply:
    await c.resume()
    return {}


async def _flush(c: Controller, _: Any) -> Reply:
    return {"flushed": await c.flush_cache()}


async def _abort(c: Controller, r: AbortRequest) -> Reply:
    await c.abort_request(r.request_id)
    return {}


async def _liveness(c: Controller, _: Any) -> Reply:
    return {"alive": await c.is_alive()}


async def _weight_info(c: Controller, _: Any) -> Reply:
    return (await c.weight_info()).to_reply()


async def _rpc(c: Controller, r: EngineRpcRequest) -> Reply:
    return {"result": await c.rpc(r.method, r.args, r.kwargs)}


@attrs.frozen
class Route:
    name: str
    handler: Handler
    mutating: bool
    summary: str


ROUTES: Final[Mapping[str, Route]] = {
    r.name: r
    for r in (
        Route("get_weight_version", _get_version, False, "Report the committed version and state."),
        Route("set_weight_version", _set_version, True, "Declare a version; never touches weights."),
        Route("update_weights_from_disk", _update, True, "Load weights from a safetensors checkpoint."),
        Route("update_weights_from_distributed", _update, True, "Receive weights broadcast by a trainer."),
        Route("update_weights_from_tensor", _update, True, "Load weights shared by a colocated trainer."),
        Route("init_weights_update_group", _init_group, True, "Join a weight-update group."),
        Route("destroy_weights_update_group", _destroy_group, True, "Leave a weight-update group."),
        Route("pause_generation", _pause, True, "Pause generation (keep, wait or abort)."),
        Route("resume_generation", _resume, True, "Resume generation; refused while torn."),
        Route("flush_cache", _flush, True, "Reset the prefix cache, honestly."),
        Route("abort_request", _abort, False, "Abort one in-flight request."),
        Route("liveness_probe", _liveness, False, "Whether the engine can serve."),
        Route("weight_info", _weight_info, False, "Names, dtypes and shapes of the served weights."),
        Route("engine_rpc", _rpc, True, "Call an allow-listed engine method."),
        Route("verify_weights", _verify, False, "Recompute the digest of the served weights and compare."),
    )
}


def parse(controller: Controller, route: str, body: Any) -> Any:
    """Parse ``body`` for ``route``.  Raises ``NotFound`` or ``InvalidRequest``."""
    if route not in ROUTES:
        raise NotFound(f"unknown route {route!r}", code="unknown_route")
    if route == "engine_rpc":
        return EngineRpcRequest.from_body(body, controller.rpc_methods)
    return PARSERS[route](body)


async def dispatch(controller: Controller, route: str, body: Any) -> Reply:
    """Parse, run and answer one admin route.

    Returns the reply object with ``status: "ok"``; raises the error family otherwise
    (the caller turns it into an error reply with ``error.to_reply()``).
    """
    request = parse(controller, route, body)
    reply = await ROUTES[route].handler(controller, request)
    return {"status": "ok", **reply}
