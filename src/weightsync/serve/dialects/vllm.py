"""vLLM's native RL API (``vllm/entrypoints/rl/online/api_router.py``) on a weightsync worker,
and the routes of vLLM's server a trainer reads beside it (``/server_info``,
``/reset_prefix_cache``).

Each route renames vLLM's fields into a weightsync admin route's body and calls the route
registry; the registry's parsers validate and the controller decides legality, so vLLM's
clients get weightsync's rules unchanged (validation before the first write, torn state,
honest cache resets, undeclared vs declared, digests).  The mapping, route by route and field
by field, is in ``docs/dialects.md``.

Errors use vLLM's error shape, ``{"error": {"message", "type", "param", "code"}}``, where
``type`` is weightsync's machine-readable code, ``param`` the field at fault as vLLM spells
its place (``query.mode``, ``body.new_version``) and ``code`` the HTTP status.  Fields are
typed as vLLM types them (``new_version`` and ``weight_version`` are strings).

vLLM has one weight-transfer engine per server, so the dialect keeps one weight-update
group and what ``/init_weight_transfer_engine`` said about the stream
(:class:`~weightsync.serve.dialects.vllm_wire.Transfer`).

A worker started with ``--auto-pause-updates`` lets ``/start_weight_update`` begin on a
serving worker, as vLLM does and as TRL's client relies on: the dialect pauses it (mode
``wait``) for the update and resumes it after ``/finish_weight_update`` commits.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable
from typing import Any, ClassVar, Final

import attrs
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from weightsync.core.controller import Controller
from weightsync.core.engine import DescribedEngine, TrackingEngine
from weightsync.core.errors import (
    CacheInUse,
    IllegalState,
    InvalidRequest,
    NotFound,
    NotSupported,
    WeightSyncError,
)
from weightsync.core.routes import STREAM_ROUTE, declared_stream
from weightsync.edge.dialects import internal, query, query_bool, vllm_error
from weightsync.serve.dialects import common, vllm_server
from weightsync.serve.dialects.common import read_json_body
from weightsync.serve.dialects.vllm_sleep import VllmSleep
from weightsync.serve.dialects.vllm_wire import (
    GROUP,
    INIT_NAMES,
    UPDATE_NAMES,
    Transfer,
    checker_body,
    init_body,
    located,
    only,
    stream_fields,
    update_body,
    with_metadata,
)
from weightsync.serve.generation.admission import Admission
from weightsync.serve.replies import JSONReply

START_HINT: Final = "(or serve the worker with --auto-pause-updates)"


def failure(exc: Exception) -> JSONReply:
    """``exc`` in vLLM's error shape (anything unexpected as ``internal_error``)."""
    return JSONReply(*vllm_error(exc if isinstance(exc, WeightSyncError) else internal(exc)))


def _string(body: dict[str, Any], field: str, *, required: bool) -> str | None:
    """``body[field]`` as vLLM types it (a string; null or absent when not ``required``)."""
    value = body.get(field)
    if value is None and not required:
        return None
    if field not in body:
        raise InvalidRequest(f"missing required field {field!r}", code="missing_field", field=field)
    if type(value) is not str:
        raise InvalidRequest(f"{field} must be a string", code="wrong_type", field=field)
    return value


@attrs.define(eq=False)
class VllmDialect:
    """The routes of vLLM's RL API over one controller (see the module docstring).

    ``exact`` (``serve --dialect vllm``): replies carry vLLM's keys only, without weightsync's
    additions.  ``auto_pause`` (``serve --auto-pause-updates``): see the module docstring."""

    controller: Controller
    call: common.Calls
    world_size: int
    exact: bool = attrs.field(default=False, kw_only=True)
    auto_pause: bool = attrs.field(default=False, kw_only=True)
    admission: Admission | None = attrs.field(default=None, kw_only=True)
    """vLLM 0.33's pause policy (``serve --vllm-version 0.33``): ``/pause`` in mode ``abort`` or
    ``wait`` refuses new generation requests with 503 until ``/resume``; ``None`` mirrors 0.32,
    where they queue."""
    transfer: Transfer = attrs.field(factory=Transfer, init=False)
    resume_after_finish: bool = attrs.field(default=False, init=False)
    """Whether /start_weight_update paused the worker for its update."""
    sleep_mode: VllmSleep = attrs.field(init=False)
    """``/sleep``, ``/wake_up``, ``/is_sleeping`` (:mod:`~.vllm_sleep`)."""
    metadata: dict[str, Any] | None = attrs.field(default=None, init=False)
    """The last ``update_info``'s ``names``, ``dtype_names`` and ``shapes`` on this group: vLLM
    0.33's trainer sends the three lists empty when its metadata did not change, meaning
    "the previous call's" (``NCCLWeightTransferEngine.receive_weights``).  Cleared when the
    group is initialised or shut down."""

    def __attrs_post_init__(self) -> None:
        self.sleep_mode = VllmSleep(self.controller, self.call, self.exact, self._held_by_caller)

    def _held_by_caller(self) -> None:
        self.resume_after_finish = False  # the caller holds the pause now

    # ------------------------------------------------------------------ routes

    async def pause(self, request: Request) -> dict[str, Any]:
        params = query(request.query_params.multi_items(), ("mode", "clear_cache"))
        only(await read_json_body(request), ())
        mode = params.get("mode", "abort")
        clear = query_bool("clear_cache", params["clear_cache"]) if "clear_cache" in params else True
        # vLLM ignores the deprecated clear_cache in mode keep (kept requests hold the cache).
        await self.call("pause_generation", {"mode": mode, "clear_cache": clear and mode != "keep"})
        self.resume_after_finish = False  # the caller holds the pause now
        if self.admission is not None:
            self.admission.refusing = mode != "keep"
        return {"status": "paused"}

    async def resume(self, request: Request) -> dict[str, Any]:
        only(await read_json_body(request), ())
        await self.call("resume_generation", {})
        self.resume_after_finish = False
        if self.admission is not None:
            self.admission.refusing = False
        return {"status": "resumed"}

    async def is_paused(self, request: Request) -> dict[str, Any]:
        query(request.query_params.multi_items(), ())
        return {"is_paused": self.controller.snapshot().paused}

    async def abort_requests(self, request: Request) -> dict[str, Any]:
        body = only(await read_json_body(request), ("request_ids",))
        ids = body.get("request_ids")
        if ids is None or ids == []:
            engine = self.controller.engine
            ids = list(engine.in_flight()) if isinstance(engine, TrackingEngine) else []
        elif type(ids) is not list or any(type(i) is not str for i in ids):
            raise InvalidRequest(
                "request_ids must be an array of strings", code="wrong_type", field="request_ids"
            )
        aborted = 0
        for request_id in ids:
            try:
                await self.call("abort_request", {"request_id": request_id})
                aborted += 1
            except NotFound:  # vLLM aborts unknown ids silently
                pass
        return {"status": "aborted", "aborted": aborted}

    async def init_weight_transfer_engine(self, request: Request) -> dict[str, Any]:
        body = only(await read_json_body(request), ("init_info",))
        if "init_info" not in body:
            raise InvalidRequest(
                "missing required field 'init_info'", code="missing_field", field="init_info"
            )
        with located("init_info", INIT_NAMES):
            group, transfer = init_body(body["init_info"])
            await self.call("init_weights_update_group", group)
        self.transfer = transfer
        self.metadata = None
        return {"message": "Weight transfer initialized"}

    async def shutdown_weight_transfer_engine(self, request: Request) -> dict[str, Any]:
        only(await read_json_body(request), ())
        with contextlib.suppress(NotFound):  # vLLM's shutdown of an engine never initialised: a no-op
            await self.call("destroy_weights_update_group", {"group_name": GROUP})
        self.transfer = Transfer()
        self.metadata = None
        return {"message": "Weight transfer shut down"}

    async def start_weight_update(self, request: Request) -> dict[str, Any]:
        # is_checkpoint_format: what vLLM's clients and tests still send; vLLM ignores it.
        body = only(await read_json_body(request), ("is_checkpoint_format",))
        if type(body.get("is_checkpoint_format", False)) is not bool:
            raise InvalidRequest(
                "is_checkpoint_format must be a boolean", code="wrong_type", field="is_checkpoint_format"
            )
        snap = self.controller.snapshot()
        pausing = self.auto_pause and not snap.paused
        if pausing:
            await self.call("pause_generation", {"mode": "wait"})
        try:
            await self.call("begin_weight_update", {})
        except WeightSyncError as exc:
            if pausing:
                await self.call("resume_generation", {})  # a refused start changes nothing
            if exc.code == "not_paused":
                raise IllegalState(f"{exc.message} {START_HINT}", code=exc.code, **exc.details) from None
            raise
        self.resume_after_finish = self.resume_after_finish or pausing
        return {"message": "Weight update started"}

    async def start_draft_weight_update(self, request: Request) -> dict[str, Any]:
        raise NotSupported("this worker serves no speculative draft model", code="not_supported")

    async def update_weights(self, request: Request) -> dict[str, Any]:
        body = only(await read_json_body(request), ("update_info",))
        if "update_info" not in body:
            raise InvalidRequest(
                "missing required field 'update_info'", code="missing_field", field="update_info"
            )
        info = body["update_info"]
        many = type(info) is list
        items = (
            [(f"update_info[{i}]", item) for i, item in enumerate(info)] if many else [("update_info", info)]
        )
        bodies: list[tuple[str, dict[str, Any]]] = []
        try:
            for where, item in items:  # every item is translated (and so checked) before the first one runs
                with located(where, UPDATE_NAMES):
                    item = await self._with_metadata(item, where)
                    bodies.append((where, {**update_body(item, self.transfer, where), "session": True}))
        except WeightSyncError:  # the trainer broadcasts every item at once: settle them all
            await self._settle(
                [b for _, b in bodies] + [stream_fields(i, self.transfer) for _, i in items[len(bodies) :]]
            )
            raise
        for n, (where, one) in enumerate(bodies):
            try:
                with located(where, UPDATE_NAMES):
                    await self.call("update_weights_from_distributed", one)
            except WeightSyncError:  # this one was settled where it was refused; the rest are owed
                await self._settle([b for _, b in bodies[n + 1 :]])
                raise
        return {"message": "Weights updated"}

    async def _settle(self, streams: list[dict[str, Any]]) -> None:
        """Settle, in order, the streams of the items a refusal left unrun
        (:meth:`Controller.settle_refused <weightsync.core.controller.Controller.settle_refused>`), up to the first whose group had to be left."""
        for stream in streams:
            debt = declared_stream(STREAM_ROUTE, stream)
            await self.controller.settle_refused(debt)
            if isinstance(debt, str):
                return

    async def _with_metadata(self, item: Any, where: str) -> Any:
        """``item`` with the last call's metadata in place of empty lists (:func:`with_metadata`);
        with none to reuse, the group is shut down first, so that a trainer already
        broadcasting gets an error instead of waiting for a receiver that cannot know the sizes."""
        try:
            item, self.metadata = with_metadata(item, self.metadata, where)
        except InvalidRequest as exc:
            if exc.code == "no_previous_metadata":
                with contextlib.suppress(WeightSyncError):
                    await self.call("destroy_weights_update_group", {"group_name": GROUP})
                self.transfer = Transfer()
            raise
        return item

    async def finish_weight_update(self, request: Request) -> dict[str, Any]:
        body = only(await read_json_body(request), ("weight_version",))
        version = _string(body, "weight_version", required=False)
        await self.call("end_weight_update", {} if version is None else {"weight_version": version})
        if self.resume_after_finish:  # kept through a failed finish: the next good one resumes
            await self.call("resume_generation", {})
            self.resume_after_finish = False
        return {"message": "Weight update finished"}

    async def update_weight_version(self, request: Request) -> dict[str, Any]:
        body = await read_json_body(request)
        b = common.dict_body("body", body)
        version = _string(b, "new_version", required=True)  # vLLM names the missing field first
        only(b, ("new_version",))
        await self.call("set_weight_version", {"weight_version": version})
        return {"success": True, "new_version": version}

    async def weight_info(self, request: Request) -> dict[str, Any]:
        query(request.query_params.multi_items(), ())
        label = common.weight_label(self.controller)
        return {"weight_version": label["weight_version"]} if self.exact else label

    async def weight_checker(self, request: Request) -> dict[str, Any]:
        action, baseline = checker_body(only(await read_json_body(request), ("action", "baseline")))
        if "weight_hashes" not in self.controller.rpc_methods:
            raise NotSupported(f"engine {self.controller.engine.name!r} cannot checksum its weights")
        checksums = (await self.call("engine_rpc", {"method": "weight_hashes"}))["result"]
        if action == "checksum":
            return {"checksums": checksums}
        assert isinstance(baseline, dict)
        mismatches = sorted(
            k for k in checksums.keys() | baseline.keys() if checksums.get(k) != baseline.get(k)
        )
        return {"match": not mismatches, "mismatches": mismatches}

    async def get_world_size(self, request: Request) -> dict[str, Any]:
        params = query(request.query_params.multi_items(), ("include_dp",))
        if "include_dp" in params:
            query_bool("include_dp", params["include_dp"])  # one data-parallel rank: the same either way
        return {"world_size": self.world_size}

    # ------------------------------------------------------------------ vLLM's server

    async def server_info(self, request: Request) -> dict[str, Any]:
        params = query(request.query_params.multi_items(), ("config_format",))
        engine = self.controller.engine
        described = isinstance(engine, DescribedEngine)
        return vllm_server.server_info(
            engine.name,
            self.world_size,
            params.get("config_format", "text"),
            engine.dtype if described else None,
            engine.max_model_len if described else None,
        )

    async def reset_prefix_cache(self, request: Request) -> dict[str, Any]:
        """vLLM's reply is ``{"success": bool}`` with 200 either way: a reset that did not
        happen (requests hold the cache) is ``success: false``, for the caller to retry."""
        params = query(request.query_params.multi_items(), ("reset_running_requests", "reset_external"))
        only(await read_json_body(request), ())
        if query_bool("reset_running_requests", params.get("reset_running_requests", "false")):
            raise NotSupported(
                "resetting the cache under running requests (preempting them) is not supported: "
                "pause with mode 'abort' or 'wait' first",
                code="not_supported",
                field="reset_running_requests",
            )
        query_bool("reset_external", params.get("reset_external", "false"))  # no external cache here
        try:
            await self.call("flush_cache", {})
        except CacheInUse as exc:
            return (
                {"success": False}
                if self.exact
                else {"success": False, "code": exc.code, "message": exc.message}
            )
        return {"success": True}

    # ------------------------------------------------------------------ serving

    ROUTES: ClassVar[tuple[tuple[str, str, str], ...]] = (
        *common.named_routes("POST", "pause", "resume"),
        ("GET", "/is_paused", "is_paused"),
        *common.named_routes(
            "POST",
            "abort_requests",
            "init_weight_transfer_engine",
            "shutdown_weight_transfer_engine",
            "start_weight_update",
            "start_draft_weight_update",
            "update_weights",
            "finish_weight_update",
        ),
        ("GET", "/weight_info", "weight_info"),
        ("POST", "/weight_checker", "weight_checker"),
        ("GET", "/get_world_size", "get_world_size"),
        *((method, path, f"sleep_mode.{name}") for method, path, name in VllmSleep.ROUTES),
    )
    """vLLM's RL API: inside vLLM's own server, weightsync's middleware answers these."""

    SHARED_ROUTES: ClassVar[tuple[tuple[str, str, str], ...]] = (
        ("POST", "/update_weight_version", "update_weight_version"),
    )
    """vLLM's routes SGLang's routes answer too, in their own shape (``weightsync.serve.dialects``
    picks which answers)."""

    SERVER_ROUTES: ClassVar[tuple[tuple[str, str, str], ...]] = (
        ("GET", "/server_info", "server_info"),
        ("POST", "/reset_prefix_cache", "reset_prefix_cache"),
    )
    """vLLM's server routes a trainer calls beside the RL API; vLLM's own server keeps its own."""

    def router(self, check: Callable[[Request], None]) -> APIRouter:
        """Every route of this dialect, ``check`` (the bearer token) first, failures in vLLM's
        shape."""
        router = APIRouter(tags=["vllm"])
        for method, path, name in (*self.ROUTES, *self.SHARED_ROUTES, *self.SERVER_ROUTES):
            router.add_api_route(
                path,
                common.endpoint(
                    f"vllm_{name.replace('.', '_')}", check, operator.attrgetter(name)(self), failure
                ),
                methods=[method],
                summary=f"vLLM: {path} (see docs/dialects.md)",
                response_class=JSONResponse,
                include_in_schema=False,  # documented in docs/dialects.md
            )
        return router
