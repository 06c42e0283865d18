"""SGLang's RL routes (``sglang/srt/entrypoints/http_server.py``) on a weightsync worker.

Each route renames SGLang's fields into weightsync admin-route bodies and runs them through
the route registry, so every rule (parsing, legality, torn state, honest cache resets) is
weightsync's own; ``docs/dialects.md`` has the mapping route by route and field by field.

SGLang's updates do not need a pause: the server waits for (or, with
``abort_all_requests``, aborts) the running requests, loads, and continues unless
``keep_pause``.  The nearest weightsync behaviour is a sequence of registry routes: pause
(``wait`` or ``abort``) when running, the update, and resume when this route paused and
``keep_pause`` is false (also after a clean refusal, so a refused update changes nothing; a
torn worker stays paused).  Inside a ``/begin_weight_update`` … ``/end_weight_update``
session the update streams into the session instead and nothing is paused or resumed.

An update with ``online: true`` runs without a pause, as weightsync's ``allow_unpaused``
update (requests keep generating; an engine swaps staged weights in between two steps).
``selector`` (``all``, ``target``) names the one model a worker serves; ``draft`` is refused.
SGLang's integer fields take numeric strings, as its server coerces them.

Replies are SGLang's: ``{"success": bool, "message": str, ...}`` with 200, or 400 on any
failure, plus weightsync's ``code`` (and the state the failure left) on failures; a path it
does not serve is a 404, a wrong method a 405, in that shape too (:func:`serve_not_routed`).
The read routes are in :mod:`~.sglang_reads`, the memory routes in :mod:`~.sglang_memory`,
the weight checks (``/weights_checker``, ``/parallelism_config``) in :mod:`~.sglang_checker`.
"""

from __future__ import annotations

import asyncio
import inspect
import operator
from collections.abc import Callable
from typing import Any, Final

from fastapi import APIRouter, FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from weightsync.core.controller import Controller
from weightsync.core.engine import TrackingEngine
from weightsync.core.errors import InvalidRequest, NotFound, NotSupported, WeightSyncError
from weightsync.core.routes import STREAM_ROUTE, declared_stream
from weightsync.edge.dialects import (
    SGLANG_IGNORED,
    SGLANG_LOAD_FORMATS,
    SGLANG_PAUSE_MODES,
    SGLANG_UNSERVED,
    SHARED_DEFAULT,
    flush_refusal,
    internal,
    sglang_error,
    sglang_int,
    sglang_not_routed,
    sglang_selector,
)  # fmt: skip
from weightsync.serve.dialects import common
from weightsync.serve.dialects.common import Calls, dict_body, endpoint, read_json_body, refuse_pickle
from weightsync.serve.dialects.sglang_checker import SglangChecker
from weightsync.serve.dialects.sglang_fields import (
    boolean,
    distributed_stream,
    fields,
    load_format,
    version_field,
)
from weightsync.serve.dialects.sglang_memory import SglangMemory
from weightsync.serve.dialects.sglang_reads import ServedModel, SglangReads
from weightsync.serve.replies import JSONReply

DEFAULT_GROUP: Final = "weight_update_group"  # SGLang's default group_name

GROUP_INTS: Final = ("master_port", "rank_offset", "world_size")
"""The integer fields of SGLang's ``/init_weights_update_group`` (numeric strings accepted)."""


POSTED: Final = (
    "update_weights_from_disk", "update_weights_from_distributed", "update_weights_from_tensor",
    "init_weights_update_group", "destroy_weights_update_group", "pause_generation", "continue_generation",
    "update_weight_version", "abort_request", "begin_weight_update", "end_weight_update",
)  # fmt: skip
"""SGLang's POST routes whose handler is named like the path."""


class SglangDialect:
    """The routes of SGLang's RL API over one controller (see the module docstring)."""

    def __init__(self, controller: Controller, calls: Calls) -> None:
        self.controller = controller
        self.call = calls
        self.served = ServedModel(controller.engine.name)
        self.reads, self.memory = SglangReads(controller, calls, self.served), SglangMemory(controller, calls)
        self.checker = SglangChecker(controller, calls)
        self._disk = asyncio.Lock()  # one disk update at a time, so model_path is the last one loaded

    async def _abort_all(self) -> int:
        engine = self.controller.engine
        aborted = 0
        for request_id in list(engine.in_flight()) if isinstance(engine, TrackingEngine) else []:
            try:
                await self.call("abort_request", {"request_id": request_id})
                aborted += 1
            except NotFound:
                pass
        return aborted

    async def _update(
        self, route: str, body: dict[str, Any], *, abort_all: bool, keep_pause: bool, online: bool = False
    ) -> None:
        """Run one update the SGLang way (see the module docstring)."""
        if self.controller.snapshot().session_open:
            await self.call(route, {**body, "session": True})
            return
        if online:  # no pause: the engine stages the weights and swaps them in between two steps
            if abort_all:
                await self._abort_all()
            await self.call(route, {**body, "allow_unpaused": True})
            return
        paused_here = not self.controller.snapshot().paused
        if paused_here:
            await self.call("pause_generation", {"mode": "abort" if abort_all else "wait"})
        elif abort_all:
            await self._abort_all()
        try:
            await self.call(route, body)
        except WeightSyncError:
            if paused_here and not self.controller.snapshot().torn:
                await self.call("resume_generation", {})  # a clean refusal changes nothing
            raise
        if paused_here and not keep_pause:
            await self.call("resume_generation", {})

    # ------------------------------------------------------------------ routes

    async def update_weights_from_disk(self, request: Request) -> dict[str, Any]:
        body = fields(
            await read_json_body(request),
            ("model_path", "load_format", "abort_all_requests", "weight_version", "is_async", "keep_pause",
             "flush_cache", "manifest", "selector", "online", *SGLANG_IGNORED),
        )  # fmt: skip
        load_format(body, SGLANG_LOAD_FORMATS)
        sglang_selector(body.get("selector"))
        if boolean(body, "is_async", False):
            raise NotSupported("is_async updates are not supported: the reply says when the weights are in",
                               code="not_supported", field="is_async")  # fmt: skip
        if body.get("manifest") is not None:
            raise NotSupported("a request manifest is not read: the checkpoint's own manifest is",
                               code="not_supported", field="manifest")  # fmt: skip
        online = boolean(body, "online", False)  # running requests hold the cache: no flush by default
        update = {"reset_prefix_cache": boolean(body, "flush_cache", not online), **version_field(body)}
        if "model_path" in body:
            update["model_path"] = body["model_path"]
        abort_all = boolean(body, "abort_all_requests", False)
        async with self._disk:
            await self._update(
                "update_weights_from_disk",
                update,
                abort_all=abort_all,
                keep_pause=boolean(body, "keep_pause", False),
                online=online,
            )
            if "model_path" in body:  # a string: the update's parser checked it
                self.served.record(body["model_path"], self.controller.snapshot())
        return self._updated("Succeeded to update model weights.", body, num_paused_requests=0)

    async def update_weights_from_distributed(self, request: Request) -> dict[str, Any]:
        raw = await read_json_body(request)
        try:
            body, update = self._distributed_body(raw)
        except WeightSyncError:  # the trainer broadcasts at once: what it sends is settled first
            await self.controller.settle_refused(
                declared_stream(STREAM_ROUTE, distributed_stream(raw, DEFAULT_GROUP))
            )
            raise
        await self._update(
            "update_weights_from_distributed", update,
            abort_all=boolean(body, "abort_all_requests", False), keep_pause=False,
        )  # fmt: skip
        return self._updated("Succeeded to update parameter online.", body)

    def _distributed_body(self, raw: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """SGLang's body, checked, and the weightsync update it asks for."""
        body = fields(
            raw,
            ("names", "dtypes", "dtype_names", "shapes", "group_name", "flush_cache", "abort_all_requests",
             "weight_version", "load_format", "hashes", "selector", *SGLANG_IGNORED),
        )  # fmt: skip
        fmt = load_format(body, (None, "flattened_bucket"))
        sglang_selector(body.get("selector"))
        boolean(body, "abort_all_requests", False)
        if "dtypes" in body and "dtype_names" in body:
            raise InvalidRequest(
                "give dtypes or dtype_names, not both", code="conflicting_options", field="dtypes"
            )
        update: dict[str, Any] = {
            "names": body.get("names"),
            "dtypes": body.get("dtypes", body.get("dtype_names")),
            "shapes": body.get("shapes"),
            "group_name": body.get("group_name", DEFAULT_GROUP),
            "reset_prefix_cache": boolean(body, "flush_cache", True),
            **version_field(body),
        }
        update = {k: v for k, v in update.items() if v is not None or k in ("names", "dtypes", "shapes")}
        for field in ("names", "dtypes", "shapes"):
            if update[field] is None:
                raise InvalidRequest(f"missing required field {field!r}", code="missing_field", field=field)
        if "hashes" in body:
            update["hashes"] = body["hashes"]
        if fmt == "flattened_bucket":
            update["packing"] = {"flat": True}
        return body, update

    async def update_weights_from_tensor(self, request: Request) -> dict[str, Any]:
        body = dict_body("body", await read_json_body(request))
        refuse_pickle(body)
        raise InvalidRequest(
            "serialized_named_tensors is required, and is pickled: weightsync refuses it (see "
            "/engine/update_weights_from_tensor for shared-memory handles)",
            code="pickle_refused",
            field="serialized_named_tensors",
        )

    async def init_weights_update_group(self, request: Request) -> dict[str, Any]:
        body = fields(
            await read_json_body(request),
            ("master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"),
        )
        body = {"group_name": DEFAULT_GROUP, **body}
        body.update({field: sglang_int(body[field]) for field in GROUP_INTS if field in body})
        if body.get("backend") == "gloo":  # SGLang's streams are bare: received by a helper
            body["receiver"] = "process"
        await self.call("init_weights_update_group", body)
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    async def destroy_weights_update_group(self, request: Request) -> dict[str, Any]:
        body = fields(await read_json_body(request), ("group_name",))
        await self.call("destroy_weights_update_group", {"group_name": body.get("group_name", DEFAULT_GROUP)})
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    async def pause_generation(self, request: Request) -> dict[str, Any]:
        body = fields(await read_json_body(request), ("mode",))
        mode = body.get("mode", "abort")
        if type(mode) is not str or mode not in SGLANG_PAUSE_MODES:
            raise InvalidRequest(
                f"mode must be one of {list(SGLANG_PAUSE_MODES)}", code="invalid_value", field="mode"
            )
        await self.call("pause_generation", {"mode": SGLANG_PAUSE_MODES[mode]})
        return {"success": True, "message": "Generation paused successfully.", "status": "ok"}

    async def continue_generation(self, request: Request) -> dict[str, Any]:
        body = fields(await read_json_body(request), ("torch_empty_cache",))
        boolean(body, "torch_empty_cache", True)
        await self.call("resume_generation", {})
        return {"success": True, "message": "Generation continued successfully.", "status": "ok"}

    async def update_weight_version(self, request: Request) -> dict[str, Any]:
        body = fields(await read_json_body(request), ("new_version", "abort_all_requests"))
        if "new_version" not in body:
            raise InvalidRequest(
                "missing required field 'new_version'", code="missing_field", field="new_version"
            )
        abort_all = boolean(body, "abort_all_requests", False)
        await self.call("set_weight_version", {"weight_version": body["new_version"]})
        if abort_all:
            await self._abort_all()
        version = body["new_version"]
        return {"success": True, "message": f"Weight version updated to {version}", "new_version": version}

    async def abort_request(self, request: Request) -> dict[str, Any]:
        """SGLang's ``AbortReq``: ``abort_all: true`` aborts every request the engine holds,
        else ``rid`` names one; an id the engine does not hold aborts nothing (as in SGLang),
        and the reply says how many were aborted."""
        body = fields(await read_json_body(request), ("rid", "abort_all"))
        if boolean(body, "abort_all", False):
            aborted = await self._abort_all()
        elif body.get("rid") is None:
            raise InvalidRequest("give rid, or abort_all: true", code="missing_field", field="rid")
        else:
            try:
                await self.call("abort_request", {"request_id": body["rid"]})
                aborted = 1
            except NotFound:
                aborted = 0
        return {"success": True, "message": f"Aborted {aborted} request(s).", "aborted": aborted}

    async def begin_weight_update(self, request: Request) -> dict[str, Any]:
        body = fields(await read_json_body(request), ("selector",))
        sglang_selector(body.get("selector"))
        await self.call("begin_weight_update", {})
        return {"success": True, "message": "Weight update session started."}

    async def end_weight_update(self, request: Request) -> dict[str, Any]:
        body = fields(
            await read_json_body(request), ("flush_cache", "weight_version", "run_post_load", "rid")
        )
        boolean(body, "run_post_load", True)
        finish = {"reset_prefix_cache": boolean(body, "flush_cache", True), **version_field(body)}
        await self.call("end_weight_update", finish)
        return self._updated("Weight update session finished.", body)

    def failure(self, exc: Exception) -> JSONReply:
        """``exc`` in SGLang's failure shape with the state it left; anything unexpected is a
        500 ``internal_error``."""
        if not isinstance(exc, WeightSyncError):
            return JSONReply(sglang_error(internal(exc))[0], status_code=500)
        snap = self.controller.snapshot()
        return JSONReply(*sglang_error(exc, torn=snap.torn, paused=snap.paused))

    def _updated(self, message: str, body: dict[str, Any], **extra: Any) -> dict[str, Any]:
        """The success reply from the state after the update (inside a session the version
        waits for its end, and the digest is unknown)."""
        snap = self.controller.snapshot()
        if body.get("weight_version") is not None:
            if snap.session_open:
                message += f" Weight version {body['weight_version']} is declared when the session ends."
            elif snap.version_declared:
                message += f" Weight version updated to {snap.version_value}."
        return {"success": True, "message": message, **extra, "digest": snap.digest}

    async def flush_cache(self, request: Request) -> Response:
        """SGLang answers text/plain: 200 when flushed, 400 when requests held the cache."""
        try:
            fields(await read_json_body(request), ())
            await self.call("flush_cache", {})
        except WeightSyncError as exc:
            return PlainTextResponse(flush_refusal(exc), status_code=400)
        return PlainTextResponse("Cache flushed.\n", status_code=200)

    # ------------------------------------------------------------------ serving

    ROUTES: Final = (
        *common.named_routes(("POST",), *POSTED),
        *((methods, path, f"reads.{name}") for methods, path, name in SglangReads.ROUTES),
        *((methods, path, f"memory.{name}") for methods, path, name in SglangMemory.ROUTES),
        *((methods, path, f"checker.{name}") for methods, path, name in SglangChecker.ROUTES),
    )
    """Each route: its methods, path and the handler's name (``reads.`` for the read routes)."""

    PATHS: Final = frozenset([path for _, path, _ in ROUTES] + ["/flush_cache", "/health_generate"])
    """Every path this dialect answers."""

    def router(self, check: Callable[[Request], None]) -> APIRouter:
        router = APIRouter(tags=["sglang"])
        for methods, path, name in self.ROUTES:
            router.add_api_route(
                path,
                endpoint(
                    f"sglang_{name.replace('.', '_')}", check, operator.attrgetter(name)(self), self.failure
                ),
                methods=list(methods),
                summary=f"SGLang RL API: {path} (see docs/dialects.md)",
                response_class=JSONResponse,
                include_in_schema=False,  # documented in docs/dialects.md
            )

        async def flush(request: Request) -> Response:
            try:
                check(request)
            except WeightSyncError as exc:
                return PlainTextResponse(f"{exc.message} ({exc.code})\n", status_code=exc.http_status)
            return await self.flush_cache(request)

        router.add_api_route("/flush_cache", flush, methods=["GET", "POST"], include_in_schema=False)

        async def health(request: Request) -> Response:  # answers its own status: 200 or 503
            try:
                check(request)
                return await self.reads.health_generate(request)
            except Exception as exc:
                return self.failure(exc)

        router.add_api_route("/health_generate", health, methods=["GET"], include_in_schema=False)
        return router


def serve_not_routed(app: FastAPI) -> None:
    """Answer, in SGLang's failure shape, a wrong method on a path of this dialect (405; on a
    path vLLM serves too, when SGLang's shape is that path's default) and a path of SGLang's
    server the worker does not serve (404, :data:`SGLANG_UNSERVED`); every other unrouted
    request keeps the answer of the app's own handler (install that first)."""
    previous = app.exception_handlers.get(StarletteHTTPException, http_exception_handler)

    async def not_routed(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", None)
        path = request.url.path
        ours = path in SglangDialect.PATHS and SHARED_DEFAULT.get(path, "sglang") == "sglang"
        if (status == 405 and ours) or (status == 404 and path in SGLANG_UNSERVED):
            body, status = sglang_not_routed(status, request.method, path)
            return JSONReply(body, status_code=status, headers=getattr(exc, "headers", None))
        reply = previous(request, exc)
        return await reply if inspect.isawaitable(reply) else reply

    app.exception_handlers[StarletteHTTPException] = not_routed
