"""vLLM's LoRA routes on a weightsync worker: ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter`` (``vllm/entrypoints/serve/lora/api_router.py``), over the
worker's adapter slots.

Replies take vLLM's shapes: a success is ``200`` with vLLM's plain-text body (``Success: LoRA
adapter 'x' added successfully.``), a failure vLLM's error object ``{"error": {"message",
"type", "param", "code"}}`` with its status, ``type`` being weightsync's machine-readable code
(as on every vLLM route here).  Where vLLM refuses, these refuse with vLLM's status: a name
loaded already without ``load_inplace`` is ``400``, an unknown name to unload ``404``, the
base's name ``400``.  Where vLLM would go on, these are stricter and say so: an adapter that
fails verification is refused before anything changes (``400``), a load past ``serve
--max-loras`` is ``409 adapter_slots_full``, and weightsync's ``weight_version`` names the
adapter's version (else its manifest's).

Unloading never cuts a request short: requests that hold the version finish with it, and it
is freed when the last one ends.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from weightsync.core import events
from weightsync.core.errors import WeightSyncError
from weightsync.edge.dialects import internal, vllm_error
from weightsync.lora.commands import AdapterSlots
from weightsync.lora.requests import LoadAdapter, UnloadAdapter
from weightsync.serve.edge import read_json_body
from weightsync.serve.replies import JSONReply

PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


def _failure(exc: Exception) -> Response:
    return JSONReply(*vllm_error(exc if isinstance(exc, WeightSyncError) else internal(exc)))


def add_lora_routes(app: FastAPI, slots: AdapterSlots, check: Callable[[Request], None]) -> None:
    """Serve vLLM's two LoRA routes on ``app`` over ``slots`` (``check``: the bearer token)."""

    async def load(request: Request) -> Response:
        parsed = LoadAdapter.from_vllm(await read_json_body(request))
        outcome = await slots.load(parsed)
        slot = outcome.slot
        reply = slot.to_reply()
        fields = {
            "adapter": slot.name,
            "version": reply["version"],
            "version_declared": reply["version_declared"],
        }
        events.adapter_changed("lora_loaded", {**fields, "digest": slot.digest, "replaced": outcome.replaced})
        return Response(f"Success: LoRA adapter '{parsed.name}' added successfully.", status_code=200)

    async def unload(request: Request) -> Response:
        parsed = UnloadAdapter.from_vllm(await read_json_body(request))
        await slots.unload(parsed.name)
        events.adapter_changed("lora_unloaded", {"adapter": parsed.name})
        return Response(f"Success: LoRA adapter '{parsed.name}' removed successfully.", status_code=200)

    def route(
        name: str, handler: Callable[[Request], Awaitable[Response]]
    ) -> Callable[[Request], Awaitable[Response]]:
        async def handle(request: Request) -> Response:
            try:
                check(request)
                return await handler(request)
            except Exception as exc:  # answer, log, keep serving
                if isinstance(exc, WeightSyncError):
                    events.route_refused(name.removeprefix("vllm_"), exc)
                return _failure(exc)

        handle.__name__ = name
        return handle

    for path, handler in ((PATHS[0], load), (PATHS[1], unload)):
        name = f"vllm_{path.rsplit('/', 1)[-1]}"
        summary = f"vLLM: {path} (see docs/lora.md)"
        app.add_api_route(path, route(name, handler), methods=["POST"], summary=summary)
