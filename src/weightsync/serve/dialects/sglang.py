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

Replies are SGLang's: ``{"success": bool, "message": str, ...}`` with 200, or 400 on any
failure, plus weightsync's ``code`` (and the state the failure left) on failures.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from weightsync.core.controller import Controller
from weightsync.core.engine import TrackingEngine
from weightsync.core.errors import InvalidRequest, NotFound, NotSupported, WeightSyncError
from weightsync.edge.dialects import (
    SGLANG_IGNORED,
    SGLANG_LOAD_FORMATS,
    SGLANG_PAUSE_MODES,
    flush_refusal,
    internal,
    sglang_error,
)  # fmt: skip
from weightsync.serve.dialects.common import (
    Calls,
    dict_body,
    endpoint,
    read_json_body,
    refuse_pickle,
    weight_label,
)
from weightsync.serve.replies import JSONReply

DEFAULT_GROUP: Final = "weight_update_group"
"""SGLang's default ``group_name``."""


def _fields(body: Any, fields: tuple[str, ...]) -> dict[str, Any]:
    b = dict_body("body", body)
    refuse_pickle(b)
    unknown = sorted(set(b) - set(fields))
    if unknown:
        raise InvalidRequest(
            f"unknown field(s) {unknown}; allowed: {list(fields)}", code="unknown_field", fields=unknown
        )
    return b


def _bool(body: dict[str, Any], field: str, default: bool) -> bool:
    value = body.get(field, default)
    if type(value) is not bool:
        raise InvalidRequest(f"{field} must be a boolean", code="wrong_type", field=field)
    return value


def _version(body: dict[str, Any]) -> dict[str, Any]:
    """``weight_version`` for a weightsync body: omitted when SGLang's is absent or null."""
    return {"weight_version": body["weight_version"]} if body.get("weight_version") is not None else {}


def _load_format(body: dict[str, Any], allowed: tuple[Any, ...]) -> Any:
    value = body.get("load_format")
    if value not in allowed:
        raise NotSupported(
            f"load_format {value!r} is not supported here; use one of {[a for a in allowed if a]}",
            code="not_supported",
            field="load_format",
        )
    return value


class SglangDialect:
    """The routes of SGLang's RL API over one controller (see the module docstring)."""

    def __init__(self, controller: Controller, calls: Calls) -> None:
        self.controller = controller
        self.call = calls

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

    async def _update(self, route: str, body: dict[str, Any], *, abort_all: bool, keep_pause: bool) -> None:
        """Run one update the SGLang way (see the module docstring)."""
        if self.controller.snapshot().session_open:
            await self.call(route, {**body, "session": True})
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
        body = _fields(
            await read_json_body(request),
            ("model_path", "load_format", "abort_all_requests", "weight_version", "is_async", "keep_pause",
             "flush_cache", "manifest", *SGLANG_IGNORED),
        )  # fmt: skip
        _load_format(body, SGLANG_LOAD_FORMATS)
        if _bool(body, "is_async", False):
            raise NotSupported("is_async updates are not supported: the reply says when the weights are in",
                               code="not_supported", field="is_async")  # fmt: skip
        if body.get("manifest") is not None:
            raise NotSupported("a request manifest is not read: the checkpoint's own manifest is",
                               code="not_supported", field="manifest")  # fmt: skip
        update = {"reset_prefix_cache": _bool(body, "flush_cache", True), **_version(body)}
        if "model_path" in body:
            update["model_path"] = body["model_path"]
        abort_all = _bool(body, "abort_all_requests", False)
        await self._update(
            "update_weights_from_disk",
            update,
            abort_all=abort_all,
            keep_pause=_bool(body, "keep_pause", False),
        )
        return self._updated("Succeeded to update model weights.", body, num_paused_requests=0)

    async def update_weights_from_distributed(self, request: Request) -> dict[str, Any]:
        body = _fields(
            await read_json_body(request),
            ("names", "dtypes", "dtype_names", "shapes", "group_name", "flush_cache", "abort_all_requests",
             "weight_version", "load_format", "hashes", *SGLANG_IGNORED),
        )  # fmt: skip
        fmt = _load_format(body, (None, "flattened_bucket"))
        if "dtypes" in body and "dtype_names" in body:
            raise InvalidRequest(
                "give dtypes or dtype_names, not both", code="conflicting_options", field="dtypes"
            )
        update: dict[str, Any] = {
            "names": body.get("names"),
            "dtypes": body.get("dtypes", body.get("dtype_names")),
            "shapes": body.get("shapes"),
            "group_name": body.get("group_name", DEFAULT_GROUP),
            "reset_prefix_cache": _bool(body, "flush_cache", True),
            **_version(body),
        }
        update = {k: v for k, v in update.items() if v is not None or k in ("names", "dtypes", "shapes")}
        for field in ("names", "dtypes", "shapes"):
            if update[field] is None:
                raise InvalidRequest(f"missing required field {field!r}", code="missing_field", field=field)
        if "hashes" in body:
            update["hashes"] = body["hashes"]
        if fmt == "flattened_bucket":
            update["packing"] = {"flat": True}
        await self._update(
            "update_weights_from_distributed", update,
            abort_all=_bool(body, "abort_all_requests", False), keep_pause=False,
        )  # fmt: skip
        return self._updated("Succeeded to update parameter online.", body)

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
        body = _fields(
            await read_json_body(request),
            ("master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"),
        )
        body = {"group_name": DEFAULT_GROUP, **body}
        if body.get("backend") == "gloo":  # SGLang's streams are bare: received by a helper
            body["receiver"] = "process"
        await self.call("init_weights_update_group", body)
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    async def destroy_weights_update_group(self, request: Request) -> dict[str, Any]:
        body = _fields(await read_json_body(request), ("group_name",))
        await self.call("destroy_weights_update_group", {"group_name": body.get("group_name", DEFAULT_GROUP)})
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    async def pause_generation(self, request: Request) -> dict[str, Any]:
        body = _fields(await read_json_body(request), ("mode",))
        mode = body.get("mode", "abort")
        if type(mode) is not str or mode not in SGLANG_PAUSE_MODES:
            raise InvalidRequest(
                f"mode must be one of {list(SGLANG_PAUSE_MODES)}", code="invalid_value", field="mode"
            )
        await self.call("pause_generation", {"mode": SGLANG_PAUSE_MODES[mode]})
        return {"success": True, "message": "Generation paused successfully.", "status": "ok"}

    async def continue_generation(self, request: Request) -> dict[str, Any]:
        body = _fields(await read_json_body(request), ("torch_empty_cache",))
        _bool(body, "torch_empty_cache", True)
        await self.call("resume_generation", {})
        return {"success": True, "message": "Generation continued successfully.", "status": "ok"}

    async def update_weight_version(self, request: Request) -> dict[str, Any]:
        body = _fields(await read_json_body(request), ("new_version", "abort_all_requests"))
        if "new_version" not in body:
            raise InvalidRequest(
                "missing required field 'new_version'", code="missing_field", field="new_version"
            )
        abort_all = _bool(body, "abort_all_requests", False)
        await self.call("set_weight_version", {"weight_version": body["new_version"]})
        if abort_all:
            await self._abort_all()
        version = body["new_version"]
        return {"success": True, "message": f"Weight version updated to {version}", "new_version": version}

    async def get_weight_version(self, request: Request) -> dict[str, Any]:
        return weight_label(self.controller)

    async def model_info(self, request: Request) -> dict[str, Any]:
        return {
            "model_path": self.controller.engine.name,
            "tokenizer_path": None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": (await self.get_weight_version(request))["weight_version"],
        }

    async def begin_weight_update(self, request: Request) -> dict[str, Any]:
        body = _fields(await read_json_body(request), ("selector",))
        selector = body.get("selector", "all")
        if selector not in ("all", "target"):
            raise NotSupported(
                f"selector {selector!r}: this worker serves one model (use 'all' or 'target')",
                code="not_supported",
                field="selector",
            )
        await self.call("begin_weight_update", {})
        return {"success": True, "message": "Weight update session started."}

    async def end_weight_update(self, request: Request) -> dict[str, Any]:
        body = _fields(await read_json_body(request), ("flush_cache", "weight_version", "run_post_load"))
        _bool(body, "run_post_load", True)
        finish = {"reset_prefix_cache": _bool(body, "flush_cache", True), **_version(body)}
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
        if body.get("weight_version") is not None:
            message += f" Weight version updated to {body['weight_version']}."
        snap = self.controller.snapshot()
        return {"success": True, "message": message, **extra, "digest": snap.digest}

    async def flush_cache(self, request: Request) -> Response:
        """SGLang answers text/plain: 200 when flushed, 400 when requests held the cache."""
        try:
            _fields(await read_json_body(request), ())
            await self.call("flush_cache", {})
        except WeightSyncError as exc:
            return PlainTextResponse(flush_refusal(exc), status_code=400)
        return PlainTextResponse("Cache flushed.\n", status_code=200)

    # ------------------------------------------------------------------ serving

    ROUTES: Final = (
        (("POST",), "/update_weights_from_disk", "update_weights_from_disk"),
        (("POST",), "/update_weights_from_distributed", "update_weights_from_distributed"),
        (("POST",), "/update_weights_from_tensor", "update_weights_from_tensor"),
        (("POST",), "/init_weights_update_group", "init_weights_update_group"),
        (("POST",), "/destroy_weights_update_group", "destroy_weights_update_group"),
        (("POST",), "/pause_generation", "pause_generation"),
        (("POST",), "/continue_generation", "continue_generation"),
        (("POST",), "/update_weight_version", "update_weight_version"),
        (("GET",), "/get_weight_version", "get_weight_version"),
        (("GET",), "/model_info", "model_info"),
        (("GET",), "/get_model_info", "model_info"),
        (("POST",), "/begin_weight_update", "begin_weight_update"),
        (("POST",), "/end_weight_update", "end_weight_update"),
    )

    def router(self, check: Callable[[Request], None]) -> APIRouter:
        router = APIRouter(tags=["sglang"])
        for methods, path, name in self.ROUTES:
            router.add_api_route(
                path,
                endpoint(f"sglang_{name}", check, getattr(self, name), self.failure),
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
        return router
