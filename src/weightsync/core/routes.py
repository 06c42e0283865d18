"""The route registry: every admin route, once, with how its body is parsed, which controller
call it makes, the JSON Schemas of its body and ok reply, a summary, and whether it is a weight update.

Everything that lists routes derives from :data:`ROUTES`: the HTTP router and its OpenAPI
document, the typed clients and ``Fleet`` (a test checks their methods against it), the
metrics' route labels, and the fuzz strategies.  Transports (HTTP, an embedding server, the
in-process test driver) all go through :func:`dispatch`, so a route behaves the same
whichever way it is reached.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

import attrs

from weightsync.core import events, schemas
from weightsync.core.controller import Controller
from weightsync.core.errors import InvalidRequest, NotFound, WeightSyncError
from weightsync.core.plan.value import kept_if_accepted
from weightsync.core.requests import (
    AbortRequest,
    DestroyGroupRequest,
    EmptyRequest,
    EngineRpcRequest,
    FinishSession,
    InitGroupRequest,
    MemoryRequest,
    PauseRequest,
    SetWeightVersion,
    UpdateRequest,
    VerifyRequest,
)
from weightsync.core.snapshot import Snapshot
from weightsync.core.sources import DistributedSource
from weightsync.core.validation import Body, store_name

Reply = dict[str, Any]
Handler = Callable[[Controller, Any], Awaitable[Reply]]
Parser = Callable[[Any], Any]
"""A body (untrusted JSON) to a typed request; raises ``InvalidRequest``."""


async def _get_version(c: Controller, _: Any) -> Reply:
    return c.snapshot().to_reply()


async def _clock(c: Controller, _: Any) -> Reply:
    # a fleet coordinator sends a declaration's `not_after` in this clock (docs/fleet.md)
    return {"clock": c.clock()}


async def _set_version(c: Controller, r: SetWeightVersion) -> Reply:
    snap = await c.declare(r.version, epoch=r.epoch, expected_digest=r.expected_digest, not_after=r.not_after)
    return {
        "version": snap.version_value,
        "version_declared": True,
        "digest": snap.digest,
        "epoch": snap.epoch,
    }


async def _update(c: Controller, r: UpdateRequest) -> Reply:
    if r.dry_run:
        dry = await c.dry_run(r)
        return {
            "dry_run": True,
            "digest": dry.digest,
            "epoch": dry.snapshot.epoch,
            "state": dry.snapshot.to_reply(),
        }
    out = await c.update(r)
    return {
        "version": r.version.value if r.version is not None else "unknown",
        "version_declared": out.declared,
        "prefix_cache_reset": out.prefix_cache_reset,
        "digest": out.snapshot.digest,
        "epoch": out.snapshot.epoch,
        "verified": out.stats.verified,
        "session_open": out.snapshot.session_open,
        "stats": out.stats.to_reply(),
        # the worker's resulting state, as get_weight_version would report it: `version` above
        # is this update's own label (Dynamo's contract), `state.version` what is now served
        "state": attrs.evolve(out.snapshot, update_in_flight=False).to_reply(),
    }


async def _begin_session(c: Controller, _: Any) -> Reply:
    snap = await c.begin_session()
    return {"session_open": snap.session_open, "deadline_s": c.session_timeout_s}


async def _finish_session(c: Controller, r: FinishSession) -> Reply:
    out = await c.finish_session(r)
    return {
        "version": out.snapshot.version_value if out.declared else "unknown",
        "version_declared": out.declared,
        "prefix_cache_reset": out.prefix_cache_reset,
        "digest": out.snapshot.digest,
        "epoch": out.snapshot.epoch,
        "verified": out.snapshot.verified,
        "session_open": False,
        "stats": out.stats.to_reply(),
    }


async def _abandon_session(c: Controller, _: Any) -> Reply:
    snap = await c.abandon_session()
    return {"torn": snap.torn, "paused": snap.paused, "digest": snap.digest}


def _memory_reply(snap: Snapshot) -> Reply:
    return {"weights": snap.weights, "kv_cache": snap.kv_cache, "weights_released": snap.weights_released,
            "paused": snap.paused, "digest": snap.digest}  # fmt: skip


async def _release_memory(c: Controller, r: MemoryRequest) -> Reply:
    return _memory_reply(await c.release_memory(r))


async def _resume_memory(c: Controller, r: MemoryRequest) -> Reply:
    return _memory_reply(await c.restore_memory(r))


async def _capabilities(c: Controller, _: Any) -> Reply:
    return c.capabilities()


async def _verify(c: Controller, r: VerifyRequest) -> Reply:
    return (await c.verify_weights(allow_load_digest=r.allow_load_digest)).to_reply()


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


def _rpc_parser(controller: Controller) -> Parser:
    return lambda body: EngineRpcRequest.from_body(body, controller.rpc_methods)


@attrs.frozen
class Route:
    """One admin route.  ``parser`` is None only for ``engine_rpc``, whose parser needs the
    engine's allow-list; ``update`` marks the weight updates (metrics time and size them)."""

    name: str
    parser: Parser | None
    handler: Handler
    body: schemas.Schema
    reply: schemas.Schema
    summary: str
    update: bool = False

    def parse(self, controller: Controller, body: Any) -> Any:
        """The typed request for ``body``.  Raises ``InvalidRequest``."""
        return (self.parser or _rpc_parser(controller))(body)


def _routes(*routes: Route) -> Mapping[str, Route]:
    return {r.name: r for r in routes}


_empty = EmptyRequest.from_body
ROUTES: Final[Mapping[str, Route]] = _routes(
    Route("get_weight_version", _empty, _get_version, schemas.EMPTY, schemas.STATE_REPLY,
          "Report the committed version and state."),
    Route("set_weight_version", SetWeightVersion.from_body, _set_version, schemas.SET_VERSION,
          schemas.DECLARED_REPLY, "Declare a version; never touches weights."),
    Route("update_weights_from_disk", UpdateRequest.from_disk_body, _update, schemas.DISK_UPDATE,
          schemas.UPDATE_REPLY, "Load weights from a safetensors checkpoint.", update=True),
    Route("update_weights_from_distributed", UpdateRequest.from_distributed_body, _update,
          schemas.DISTRIBUTED_UPDATE, schemas.UPDATE_REPLY, "Receive weights broadcast by a trainer.", update=True),
    Route("update_weights_from_plan", UpdateRequest.from_plan_body, _update, schemas.PLAN_UPDATE,
          schemas.UPDATE_REPLY, "Receive this worker's part of a sharded transfer plan.", update=True),
    Route("update_weights_from_delta", UpdateRequest.from_delta_body, _update, schemas.DELTA_UPDATE,
          schemas.UPDATE_REPLY, "Apply a delta checkpoint to the exact base it names.", update=True),
    Route("update_weights_from_tensor", UpdateRequest.from_tensor_body, _update, schemas.TENSOR_UPDATE,
          schemas.UPDATE_REPLY, "Load weights shared by a colocated trainer.", update=True),
    Route("init_weights_update_group", InitGroupRequest.from_body, _init_group, schemas.INIT_GROUP,
          schemas.OK, "Join a weight-update group."),
    Route("destroy_weights_update_group", DestroyGroupRequest.from_body, _destroy_group,
          schemas.GROUP_NAME, schemas.OK, "Leave a weight-update group."),
    Route("pause_generation", PauseRequest.from_body, _pause, schemas.PAUSE, schemas.PAUSE_REPLY,
          "Pause generation (keep, wait or abort)."),
    Route("resume_generation", _empty, _resume, schemas.EMPTY, schemas.OK,
          "Resume generation; refused while torn."),
    Route("flush_cache", _empty, _flush, schemas.EMPTY, schemas.FLUSH_REPLY,
          "Reset the prefix cache, honestly."),
    Route("abort_request", AbortRequest.from_body, _abort, schemas.REQUEST_ID, schemas.OK,
          "Abort one in-flight request."),
    Route("liveness_probe", _empty, _liveness, schemas.EMPTY, schemas.ALIVE_REPLY,
          "Whether the engine can serve."),
    Route("clock", _empty, _clock, schemas.EMPTY, schemas.CLOCK_REPLY,
          "The worker's clock, in unix seconds (what a declaration's not_after is checked against)."),
    Route("weight_info", _empty, _weight_info, schemas.EMPTY, schemas.WEIGHT_INFO_REPLY,
          "Names, dtypes and shapes of the served weights."),
    Route("engine_rpc", None, _rpc, schemas.RPC, schemas.RPC_REPLY,
          "Call an allow-listed engine method."),
    Route("verify_weights", VerifyRequest.from_body, _verify, schemas.VERIFY, schemas.VERIFY_REPLY,
          "Recompute the digest of the served weights and compare."),
    Route("begin_weight_update", _empty, _begin_session, schemas.EMPTY, schemas.SESSION_REPLY,
          "Open an update session (paused or torn); updates with session=true stream into it."),
    Route("end_weight_update", FinishSession.from_body, _finish_session, schemas.FINISH_SESSION,
          schemas.UPDATE_REPLY, "Finish the update session: reset the cache, commit the version.",
          update=True),
    Route("abort_weight_update", _empty, _abandon_session, schemas.EMPTY, schemas.ABANDON_REPLY,
          "Abandon the update session: torn if it wrote, untouched otherwise."),
    Route("release_memory", MemoryRequest.release_from_body, _release_memory, schemas.MEMORY_RELEASE,
          schemas.MEMORY_REPLY, "Release memory while paused: offload or discard the weights, release the KV cache."),
    Route("resume_memory", MemoryRequest.resume_from_body, _resume_memory, schemas.MEMORY_RESUME,
          schemas.MEMORY_REPLY, "Restore released memory (discarded weights stay discarded until an update)."),
    Route("capabilities", _empty, _capabilities, schemas.EMPTY, schemas.CAPABILITIES_REPLY,
          "What this worker speaks and supports (GET works too)."),
)  # fmt: skip


def parse(controller: Controller, route: str, body: Any) -> Any:
    """Parse ``body`` for ``route``.  Raises ``NotFound`` or ``InvalidRequest``."""
    if route not in ROUTES:
        raise NotFound(f"unknown route {route!r}", code="unknown_route")
    return ROUTES[route].parse(controller, body)


async def dispatch(controller: Controller, route: str, body: Any) -> Reply:
    """Parse, run and answer one admin route.

    Returns the reply object with ``status: "ok"``; raises the error family otherwise
    (the caller turns it into an error reply with ``error.to_reply()``).  Every state change
    and refusal is logged on ``weightsync.events`` (:mod:`weightsync.core.events`).  The front
    doors make an update that carries an idempotency key run once
    (:func:`weightsync.edge.idempotency.keyed_dispatch`).
    """
    try:
        with kept_if_accepted():  # a plan part parsed for a refused request is not kept
            request = await _parsed(controller, route, body)
            reply = await ROUTES[route].handler(controller, request)
    except WeightSyncError as exc:
        events.route_refused(route, exc)
        raise
    events.route_done(route, reply)
    return {"status": "ok", **reply}


async def _parsed(controller: Controller, route: str, body: Any) -> Any:
    """``body`` parsed for ``route``.  A refused body is settled first: a trainer may already
    be broadcasting what it declared (:func:`declared_stream`)."""
    try:
        if route in ROUTES and ROUTES[route].update and isinstance(body, dict) and "plan" in body:
            # a plan part (a million pieces) can take a second to parse: in a thread, so the
            # loop answers meanwhile.  Any other body is parsed at once, so commands still
            # reach the controller in the order they arrived.
            return await asyncio.to_thread(parse, controller, route, body)
        return parse(controller, route, body)
    except WeightSyncError:
        await controller.settle_refused(declared_stream(route, body))
        raise


STREAM_ROUTE: Final = "update_weights_from_distributed"
"""The route whose refusals can owe a trainer that posts and broadcasts at once its broadcast."""

_STREAM_FIELDS: Final = ("names", "dtypes", "shapes", "group_name", "packing")


def declared_stream(route: str, body: Any) -> DistributedSource | str | None:
    """What a body of ``route`` that its parser refused owes a trainer already broadcasting
    (:meth:`EngineCalls.settle <weightsync.core.engine.EngineCalls.settle>`): its stream when
    ``names``, ``dtypes``, ``shapes``, ``group_name`` and ``packing`` parse, whatever else is
    wrong with it; else its group when ``group_name`` parses; else nothing.  Nothing for a dry
    run, a delta, or weightsync's packed stream (its trainer sends nothing before the go)."""
    if route != STREAM_ROUTE or type(body) is not dict or "delta" in body or body.get("dry_run") is True:
        return None
    packing = body.get("packing")
    if type(packing) is dict and "flat" not in packing and packing.keys() & {"stream_id", "bucket_bytes"}:
        return None
    try:
        return DistributedSource.parse(
            Body({k: body[k] for k in _STREAM_FIELDS if k in body}, _STREAM_FIELDS)
        )
    except InvalidRequest:
        pass
    try:
        return store_name("group_name", body.get("group_name"))
    except InvalidRequest:
        return None
