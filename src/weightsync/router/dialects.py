"""vLLM's RL API and SGLang's RL routes on the router, in each dialect's shapes.

A trainer written against vLLM or SGLang can point the calls that concern the whole fleet at
the router: they run as the router's fleet operations, with its journal, one at a time — an
update is one fleet transaction (rolling, by policy), a pause or a resume reaches every
worker, a relabel is the transaction of ``/fleet/set_weight_version``, and the version
reported is the one the fleet committed.  The routes that stream weights into one worker's
group (vLLM's weight-transfer engine, SGLang's distributed and tensor updates and its
update session) or name one worker's requests are refused with ``not_supported``: a
broadcast group has one receiver per worker, so a trainer sends those to each worker (or
updates the fleet from a checkpoint here).  The mapping, route by route and field by field,
is in ``docs/router.md``.

Errors: vLLM's routes answer vLLM's error shape (``{"error": {"message", "type", "param",
"code"}}``, ``type`` the machine-readable code, ``code`` the HTTP status); SGLang's answer
``{"success": false, "message", "code"}`` with 400 (401/403/413/415 from the edge keep
theirs), as on a worker: both shape them with :mod:`weightsync.edge.dialects`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from weightsync.core.errors import NotSupported, WeightSyncError
from weightsync.core.validation import Body, any_json, boolean, one_of
from weightsync.edge.dialects import (
    DEFAULT_VERSION,
    SGLANG_IGNORED,
    SGLANG_LOAD_FORMATS,
    SGLANG_PAUSE_MODES,
    flush_refusal,
    internal,
    query,
    query_bool,
    sglang_error,
    sglang_status,
    vllm_error,
)
from weightsync.router.answers import Answer
from weightsync.router.requests import parse_update
from weightsync.router.service import Router

__all__ = ["DIALECT_PATHS", "dialect_routes"]

VLLM_PAUSE_MODES: Final = ("abort", "wait", "keep")

ROUTER_UPDATE_FIELDS: Final = ("policy", "min_workers", "deadline_s", "max_unavailable", "expected_digest")
"""The router's own fields of a fleet update, accepted beside SGLang's."""

VLLM_PER_WORKER: Final = (
    "/init_weight_transfer_engine", "/shutdown_weight_transfer_engine", "/start_weight_update",
    "/start_draft_weight_update", "/update_weights", "/finish_weight_update", "/abort_requests",
    "/weight_checker",
)  # fmt: skip
SGLANG_PER_WORKER: Final = (
    "/init_weights_update_group", "/destroy_weights_update_group", "/update_weights_from_distributed",
    "/update_weights_from_tensor", "/begin_weight_update", "/end_weight_update",
)  # fmt: skip

Reader = Callable[[Request], Awaitable[dict[str, Any]]]
Check = Callable[[Request], None]
Shaper = Callable[[WeightSyncError], tuple[dict[str, Any], int]]


class FleetFailed(WeightSyncError):
    """A fleet operation the dialect ran did not succeed; the router's answer says why."""

    def __init__(self, answer: Answer) -> None:
        body = answer.body
        super().__init__(str(body.get("message") or "the fleet operation failed"), code=body.get("code"))
        self.http_status = answer.status  # type: ignore[misc]
        self.answer = body


def succeeded(answer: Answer) -> dict[str, Any]:
    """The router's answer to a fleet operation when it succeeded; else raises ``FleetFailed``."""
    if answer.status != 200:
        raise FleetFailed(answer)
    return answer.body


class FleetDialects:
    """The dialect routes over one :class:`Router`; ``read`` reads a JSON-object body."""

    def __init__(self, router: Router, read: Reader) -> None:
        self.router = router
        self.read = read

    # ------------------------------------------------------------------ what the fleet holds

    def label(self) -> dict[str, Any]:
        """The version the fleet committed last (vLLM's and SGLang's ``"default"`` while none
        was declared), its epoch and digest."""
        newest = self.router.view.newest
        declared = newest is not None and newest.declared
        return {
            "weight_version": newest.version if newest is not None and declared else DEFAULT_VERSION,
            "version_declared": declared,
            "weight_epoch": newest.epoch if newest is not None else None,
            "digest": newest.digest if newest is not None else None,
        }

    # ------------------------------------------------------------------ vLLM

    async def vllm_pause(self, request: Request) -> dict[str, Any]:
        params = query(request.query_params.multi_items(), ("mode", "clear_cache"))
        Body(await self.read(request), ())
        mode = one_of(VLLM_PAUSE_MODES)("mode", params.get("mode", "abort"))
        clear = query_bool("clear_cache", params["clear_cache"]) if "clear_cache" in params else True
        # vLLM ignores the deprecated clear_cache in mode keep (kept requests hold the cache).
        done = succeeded(await self.router.pause(mode, clear and mode != "keep"))
        return {"status": "paused", "workers": done["workers"]}

    async def vllm_resume(self, request: Request) -> dict[str, Any]:
        query(request.query_params.multi_items(), ())
        Body(await self.read(request), ())
        done = succeeded(await self.router.resume())
        return {"status": "resumed", "workers": done["workers"]}

    async def vllm_is_paused(self, request: Request) -> dict[str, Any]:
        query(request.query_params.multi_items(), ())
        paused = [w.url for w in self.router.view.workers.values() if w.state == "paused"]
        return {"is_paused": bool(paused), "paused_workers": paused}

    async def vllm_weight_info(self, request: Request) -> dict[str, Any]:
        query(request.query_params.multi_items(), ())
        return self.label()

    # ------------------------------------------------------------------ shared

    async def update_weight_version(self, request: Request) -> dict[str, Any]:
        b = Body(await self.read(request), ("new_version", "abort_all_requests"))
        version = b.get("new_version", any_json)
        if b.get("abort_all_requests", boolean, False):
            raise NotSupported(
                "abort_all_requests is not supported on the router: a relabel reloads the "
                "committed weights under a new epoch without dropping requests",
                code="not_supported",
                field="abort_all_requests",
            )
        done = succeeded(await self.router.set_version(version))
        return {
            "success": True,
            "message": f"Weight version updated to {version}",
            "new_version": version,
            "weight_epoch": done.get("epoch"),
        }

    # ------------------------------------------------------------------ SGLang

    async def sglang_update_weights_from_disk(self, request: Request) -> dict[str, Any]:
        fields = ("model_path", "load_format", "abort_all_requests", "weight_version", "is_async",
                  "keep_pause", "flush_cache", *SGLANG_IGNORED, *ROUTER_UPDATE_FIELDS)  # fmt: skip
        body = await self.read(request)
        b = Body(body, fields)
        if b.get("load_format", any_json, None) not in SGLANG_LOAD_FORMATS:
            raise NotSupported(
                "load_format must be auto or safetensors", code="not_supported", field="load_format"
            )
        for name, why in (
            ("is_async", "the reply says when the weights are in"),
            ("keep_pause", "a fleet transaction resumes the workers it commits; pause the fleet after it"),
        ):
            if b.get(name, boolean, False):
                raise NotSupported(
                    f"{name} is not supported on the router: {why}", code="not_supported", field=name
                )
        b.get("flush_cache", boolean, True)  # a fleet commit always resets the caches it serves from
        update: dict[str, Any] = {
            k: body[k] for k in ("model_path", "weight_version", *ROUTER_UPDATE_FIELDS) if k in body
        }
        if b.get("abort_all_requests", boolean, False):
            update["pause_mode"] = "abort"
        done = succeeded(await self.router.update(parse_update(update, len(self.router.urls))))
        return {
            "success": True,
            "message": "Succeeded to update model weights.",
            "num_paused_requests": 0,
            **self.label(),
            "transaction": {k: v for k, v in done.items() if k != "status"},
        }

    async def sglang_pause_generation(self, request: Request) -> dict[str, Any]:
        b = Body(await self.read(request), ("mode",))
        mode = b.get("mode", one_of(tuple(SGLANG_PAUSE_MODES)), "abort")
        done = succeeded(await self.router.pause(SGLANG_PAUSE_MODES[mode], False))
        return {
            "success": True,
            "message": "Generation paused successfully.",
            "status": "ok",
            "workers": done["workers"],
        }

    async def sglang_continue_generation(self, request: Request) -> dict[str, Any]:
        b = Body(await self.read(request), ("torch_empty_cache",))
        b.get("torch_empty_cache", boolean, True)
        done = succeeded(await self.router.resume())
        return {
            "success": True,
            "message": "Generation continued successfully.",
            "status": "ok",
            "workers": done["workers"],
        }

    async def sglang_get_weight_version(self, request: Request) -> dict[str, Any]:
        return self.label()

    async def sglang_flush_cache(self, request: Request) -> Response:
        """Every worker's ``flush_cache``; text/plain like SGLang: 200, or 400 naming who refused."""
        Body(await self.read(request), ())
        answer = await self.router.flush()
        if answer.status == 200:
            return PlainTextResponse("Cache flushed.\n", 200)
        return PlainTextResponse(f"Cache not flushed: {answer.body.get('message')}\n", 400)


def _per_worker(path: str) -> Callable[[Request], Awaitable[dict[str, Any]]]:
    async def refuse(request: Request) -> dict[str, Any]:
        raise NotSupported(
            f"{path} streams weights into one worker (or names its requests): send it to each "
            "worker, or update the fleet from a checkpoint with /update_weights_from_disk or "
            "/fleet/update_weights_from_disk",
            code="not_supported",
        )

    return refuse


def dialect_routes(router: Router, read: Reader, check: Check) -> list[Route]:
    """The dialect routes over ``router``; ``check`` is the bearer-token check of its routes."""
    d = FleetDialects(router, read)
    vllm: list[tuple[str, str, Callable[[Request], Awaitable[dict[str, Any]]]]] = [
        ("POST", "/pause", d.vllm_pause),
        ("POST", "/resume", d.vllm_resume),
        ("GET", "/is_paused", d.vllm_is_paused),
        ("GET", "/weight_info", d.vllm_weight_info),
        *(("POST", p, _per_worker(p)) for p in VLLM_PER_WORKER),
    ]
    sglang: list[tuple[str, str, Callable[[Request], Awaitable[dict[str, Any]]]]] = [
        ("POST", "/update_weights_from_disk", d.sglang_update_weights_from_disk),
        ("POST", "/pause_generation", d.sglang_pause_generation),
        ("POST", "/continue_generation", d.sglang_continue_generation),
        ("POST", "/update_weight_version", d.update_weight_version),
        ("GET", "/get_weight_version", d.sglang_get_weight_version),
        *(("POST", p, _per_worker(p)) for p in SGLANG_PER_WORKER),
    ]
    routes = [Route(p, _wrap(check, h, vllm_error), methods=[m]) for m, p, h in vllm]
    routes += [Route(p, _wrap(check, h, sglang_error), methods=[m]) for m, p, h in sglang]

    async def flush(request: Request) -> Response:
        try:
            check(request)
            return await d.sglang_flush_cache(request)
        except WeightSyncError as exc:
            return PlainTextResponse(flush_refusal(exc), sglang_status(exc))

    routes.append(Route("/flush_cache", flush, methods=["GET", "POST"]))
    return routes


def _wrap(
    check: Check,
    handler: Callable[[Request], Awaitable[Mapping[str, Any]]],
    shape: Shaper,
) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        try:
            check(request)
            return JSONResponse(dict(await handler(request)))
        except WeightSyncError as exc:
            return JSONResponse(*shape(exc))
        except Exception as exc:  # answer, and keep serving
            return JSONResponse(*shape(internal(exc)))

    return endpoint


DIALECT_PATHS: Final = frozenset(
    ["/pause", "/resume", "/is_paused", "/weight_info", "/update_weights_from_disk", "/pause_generation",
     "/continue_generation", "/update_weight_version", "/get_weight_version", "/flush_cache",
     *VLLM_PER_WORKER, *SGLANG_PER_WORKER]
)  # fmt: skip
"""The paths :func:`dialect_routes` answers (their POSTs may come without a body)."""
