"""vLLM's native RL API (``vllm/entrypoints/rl/online/api_router.py``) on a weightsync worker.

Each route renames vLLM's fields into a weightsync admin route's body and calls the route
registry; the registry's parsers validate and the controller decides legality, so vLLM's
clients get weightsync's rules unchanged (validation before the first write, torn state,
honest cache resets, undeclared vs declared, digests).  The mapping, route by route and field
by field, is in ``docs/dialects.md``.

Errors use vLLM's error shape, ``{"error": {"message", "type", "param", "code"}}``, where
``type`` is weightsync's machine-readable code and ``code`` the HTTP status.

vLLM has one weight-transfer engine per server, so the dialect keeps one weight-update
group, named :data:`GROUP`, and what ``/init_weight_transfer_engine`` said about the stream
(:class:`Transfer`): the stock ``nccl`` backend's per-tensor or packed stream, or the
``weightsync`` backend's packed, checksummed one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Final

import attrs
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from weightsync.core.controller import Controller
from weightsync.core.engine import TrackingEngine
from weightsync.core.errors import InvalidRequest, NotFound, NotSupported, WeightSyncError
from weightsync.edge.dialects import internal, query, query_bool, vllm_error
from weightsync.serve.dialects import common
from weightsync.serve.dialects.common import dict_body, read_json_body
from weightsync.serve.replies import JSONReply

GROUP: Final = "vllm"
"""The weight-update group the vLLM dialect joins at ``/init_weight_transfer_engine``."""

DEFAULT_PACKED_BUFFER_BYTES: Final = 1024 * 1024 * 1024
"""vLLM's ``DEFAULT_PACKED_BUFFER_SIZE_BYTES``: the chunk size of its packed stream."""

STREAM_FORMATS: Final = ("nccl", "weightsync")


@attrs.define
class Transfer:
    """What the trainer said at ``/init_weight_transfer_engine`` about the stream to come."""

    stream: str = "nccl"  # "nccl": vLLM's stock stream; "weightsync": the packed, checksummed one
    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_BYTES


def _failure(exc: Exception) -> JSONReply:
    """``exc`` in vLLM's error shape (anything unexpected as ``internal_error``)."""
    return JSONReply(*vllm_error(exc if isinstance(exc, WeightSyncError) else internal(exc)))


def _only(body: Any, fields: tuple[str, ...]) -> dict[str, Any]:
    """``body`` as an object with no field outside ``fields`` (400 otherwise)."""
    b = dict_body("body", body)
    unknown = sorted(set(b) - set(fields))
    if unknown:
        raise InvalidRequest(
            f"unknown field(s) {unknown}; allowed: {list(fields)}", code="unknown_field", fields=unknown
        )
    return b


def init_body(init_info: Any) -> tuple[dict[str, Any], Transfer]:
    """``init_info`` (vLLM's stock ``nccl`` shape, or the ``weightsync`` backend's) as the body
    of ``init_weights_update_group`` and the :class:`Transfer` it announces.  Fields left
    over stay in the body, for the registry's parser to refuse."""
    info = dict(dict_body("init_info", init_info))
    if info.get("nccl_unique_id_b64") is not None:
        raise NotSupported(
            "a pre-shared NCCL unique id is not supported: pass master_address and master_port "
            "(a TCPStore rendezvous)",
            code="not_supported",
            field="init_info.nccl_unique_id_b64",
        )
    info.pop("nccl_unique_id_b64", None)
    stream = info.pop("stream", "nccl")
    if stream not in STREAM_FORMATS:
        raise InvalidRequest(
            f"init_info.stream must be one of {list(STREAM_FORMATS)}",
            code="invalid_value",
            field="init_info.stream",
        )
    packed = info.pop("packed", False)
    if type(packed) is not bool:
        raise InvalidRequest(
            "init_info.packed must be a boolean", code="wrong_type", field="init_info.packed"
        )
    size = info.pop("packed_buffer_size_bytes", DEFAULT_PACKED_BUFFER_BYTES)
    if type(size) is not int or size < 1:
        raise InvalidRequest(
            "init_info.packed_buffer_size_bytes must be a positive integer",
            code="invalid_value",
            field="init_info.packed_buffer_size_bytes",
        )
    buffers = info.pop("packed_num_buffers", 2)
    if type(buffers) is not int or buffers < 1:
        raise InvalidRequest(
            "init_info.packed_num_buffers must be a positive integer",
            code="invalid_value",
            field="init_info.packed_num_buffers",
        )
    info.setdefault("backend", "nccl")  # vLLM's stock backend; the weightsync backend names its own
    if stream == "nccl" and info["backend"] == "gloo":
        info.setdefault("receiver", "process")  # a bare stream's sizes are the request's word
    return {**info, "group_name": GROUP}, Transfer(stream, packed, size)


def update_body(update_info: Any, transfer: Transfer, index: int | None = None) -> dict[str, Any]:
    """One ``update_info`` object as the body of ``update_weights_from_distributed``.

    The stock ``nccl`` shape (``names``, ``dtype_names``, ``shapes``) is one broadcast per
    tensor, or vLLM's packed stream when the init said ``packed``; the ``weightsync`` backend
    adds ``packing`` (bucket size and stream id) for its packed, checksummed stream.  Optional
    ``hashes`` (xxh3-64 per tensor) make a bare per-tensor stream verified.  Pickled payloads
    are refused."""
    where = "update_info" if index is None else f"update_info[{index}]"
    info = dict(dict_body(where, update_info))
    common.refuse_pickle(info)
    if "packed" in info:  # older vLLM carried the wire params per update
        packed = info.pop("packed")
        if type(packed) is not bool:
            raise InvalidRequest(f"{where}.packed must be a boolean", code="wrong_type", field="packed")
        transfer = attrs.evolve(transfer, packed=packed)
    for legacy in ("packed_buffer_size_bytes", "packed_num_buffers"):
        info.pop(legacy, None)
    body: dict[str, Any] = {"group_name": GROUP}
    for ours, theirs in (("names", "names"), ("dtypes", "dtype_names"), ("shapes", "shapes")):
        if theirs in info:
            body[ours] = info.pop(theirs)
    if transfer.stream == "weightsync":
        if "packing" not in info:
            raise InvalidRequest(
                f"{where}.packing is required on the weightsync stream", code="missing_field", field="packing"
            )
        body["packing"] = info.pop("packing")
    elif transfer.packed:
        body["packing"] = {"flat": True, "flat_bucket_bytes": transfer.packed_buffer_size_bytes}
    return {**info, **body}  # anything left is refused by the registry's parser


class VllmDialect:
    """The routes of vLLM's RL API over one controller (see the module docstring)."""

    def __init__(self, controller: Controller, calls: common.Calls, world_size: int) -> None:
        self.controller = controller
        self.call = calls
        self.world_size = world_size
        self.transfer = Transfer()

    # ------------------------------------------------------------------ routes

    async def pause(self, request: Request) -> dict[str, Any]:
        params = query(request.query_params.multi_items(), ("mode", "clear_cache"))
        _only(await read_json_body(request), ())
        mode = params.get("mode", "abort")
        clear = query_bool("clear_cache", params["clear_cache"]) if "clear_cache" in params else True
        # vLLM ignores the deprecated clear_cache in mode keep (kept requests hold the cache).
        await self.call("pause_generation", {"mode": mode, "clear_cache": clear and mode != "keep"})
        return {"status": "paused"}

    async def resume(self, request: Request) -> dict[str, Any]:
        _only(await read_json_body(request), ())
        await self.call("resume_generation", {})
        return {"status": "resumed"}

    async def is_paused(self, request: Request) -> dict[str, Any]:
        query(request.query_params.multi_items(), ())
        return {"is_paused": self.controller.snapshot().paused}

    async def abort_requests(self, request: Request) -> dict[str, Any]:
        body = _only(await read_json_body(request), ("request_ids",))
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
        body = _only(await read_json_body(request), ("init_info",))
        if "init_info" not in body:
            raise InvalidRequest(
                "missing required field 'init_info'", code="missing_field", field="init_info"
            )
        group, transfer = init_body(body["init_info"])
        await self.call("init_weights_update_group", group)
        self.transfer = transfer
        return {"message": "Weight transfer initialized"}

    async def shutdown_weight_transfer_engine(self, request: Request) -> dict[str, Any]:
        _only(await read_json_body(request), ())
        with contextlib.suppress(NotFound):  # vLLM's shutdown of an engine never initialised: a no-op
            await self.call("destroy_weights_update_group", {"group_name": GROUP})
        self.transfer = Transfer()
        return {"message": "Weight transfer shut down"}

    async def start_weight_update(self, request: Request) -> dict[str, Any]:
        _only(await read_json_body(request), ())
        await self.call("begin_weight_update", {})
        return {"message": "Weight update started"}

    async def start_draft_weight_update(self, request: Request) -> dict[str, Any]:
        raise NotSupported("this worker serves no speculative draft model", code="not_supported")

    async def update_weights(self, request: Request) -> dict[str, Any]:
        body = _only(await read_json_body(request), ("update_info",))
        if "update_info" not in body:
            raise InvalidRequest(
                "missing required field 'update_info'", code="missing_field", field="update_info"
            )
        info = body["update_info"]
        items = info if type(info) is list else [info]
        # Every item is translated (and so checked) before the first one runs.
        bodies = [
            {**update_body(item, self.transfer, i if type(info) is list else None), "session": True}
            for i, item in enumerate(items)
        ]
        for one in bodies:
            await self.call("update_weights_from_distributed", one)
        return {"message": "Weights updated"}

    async def finish_weight_update(self, request: Request) -> dict[str, Any]:
        body = _only(await read_json_body(request), ("weight_version",))
        finish: dict[str, Any] = {}
        if body.get("weight_version") is not None:
            finish["weight_version"] = body["weight_version"]
        await self.call("end_weight_update", finish)
        return {"message": "Weight update finished"}

    async def weight_info(self, request: Request) -> dict[str, Any]:
        query(request.query_params.multi_items(), ())
        return common.weight_label(self.controller)

    async def weight_checker(self, request: Request) -> dict[str, Any]:
        body = _only(await read_json_body(request), ("action", "baseline"))
        action = body.get("action")
        if action not in ("checksum", "reset", "compare"):
            raise InvalidRequest(
                "action must be one of 'checksum', 'reset', 'compare'", code="invalid_value", field="action"
            )
        if action == "reset":
            raise NotSupported(
                "resetting weights outside an update is refused: load known weights with an update instead",
                code="not_supported",
                field="action",
            )
        baseline = body.get("baseline")
        if action == "compare":
            if type(baseline) is not dict or any(type(v) is not str for v in baseline.values()):
                raise InvalidRequest(
                    "action='compare' requires a 'baseline' object of name -> checksum strings",
                    code="invalid_value",
                    field="baseline",
                )
        elif baseline is not None:
            raise InvalidRequest(
                "baseline is only for action='compare'", code="unknown_field", field="baseline"
            )
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

    # ------------------------------------------------------------------ serving

    ROUTES: Final = (
        ("POST", "/pause", "pause"),
        ("POST", "/resume", "resume"),
        ("GET", "/is_paused", "is_paused"),
        ("POST", "/abort_requests", "abort_requests"),
        ("POST", "/init_weight_transfer_engine", "init_weight_transfer_engine"),
        ("POST", "/shutdown_weight_transfer_engine", "shutdown_weight_transfer_engine"),
        ("POST", "/start_weight_update", "start_weight_update"),
        ("POST", "/start_draft_weight_update", "start_draft_weight_update"),
        ("POST", "/update_weights", "update_weights"),
        ("POST", "/finish_weight_update", "finish_weight_update"),
        ("GET", "/weight_info", "weight_info"),
        ("POST", "/weight_checker", "weight_checker"),
        ("GET", "/get_world_size", "get_world_size"),
    )

    def router(self, check: Callable[[Request], None]) -> APIRouter:
        router = APIRouter(tags=["vllm"])
        for method, path, name in self.ROUTES:
            router.add_api_route(
                path,
                common.endpoint(f"vllm_{name}", check, getattr(self, name), _failure),
                methods=[method],
                summary=f"vLLM RL API: {path} (see docs/dialects.md)",
                response_class=JSONResponse,
                include_in_schema=False,  # documented in docs/dialects.md
            )
        return router
