"""vLLM's sleep mode on a weightsync worker: ``/sleep``, ``/wake_up`` and ``/is_sleeping``
(``vllm/entrypoints/serve/sleep/api_router.py``), onto the admin routes ``pause_generation``,
``release_memory``, ``resume_memory`` and ``resume_generation``.

Level 1 offloads the weights (they come back as they were), level 2 discards them (the worker
then holds no version until an update rewrites them), level 0 only pauses; both release the
KV cache.  A wake-up that leaves every part resident resumes generation, as vLLM's does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import attrs
from fastapi import Request

from weightsync.core.controller import Controller
from weightsync.core.errors import InvalidRequest
from weightsync.edge.dialects import query
from weightsync.serve.dialects import common
from weightsync.serve.dialects.common import read_json_body
from weightsync.serve.dialects.vllm_wire import only


@attrs.define(eq=False)
class VllmSleep:
    """vLLM's sleep-mode routes over one controller (see the module docstring); ``exact``
    as the vLLM dialect's; ``on_hold`` is called when a sleep pauses the worker (the caller
    holds that pause: an update's finish must not resume it)."""

    controller: Controller
    call: common.Calls
    exact: bool
    on_hold: Callable[[], None]

    ROUTES: ClassVar[tuple[tuple[str, str, str], ...]] = (
        *common.named_routes("POST", "sleep", "wake_up"),
        ("GET", "/is_sleeping", "is_sleeping"),
    )

    async def sleep(self, request: Request) -> dict[str, Any]:
        """vLLM's ``/sleep?level=0|1|2&mode=…``: pause (``mode``, vLLM's default ``abort``),
        then level 1 offloads the weights and releases the KV cache, level 2 discards both."""
        params = query(request.query_params.multi_items(), ("level", "mode"))
        only(await read_json_body(request), ())
        level = params.get("level", "1")
        if level not in ("0", "1", "2"):
            raise InvalidRequest("level must be 0, 1 or 2", code="invalid_value", field="query.level")
        mode = params.get("mode", "abort")
        if not self.controller.snapshot().paused:
            await self.call(
                "pause_generation", {"mode": mode, "clear_cache": level != "0" and mode != "keep"}
            )
        if level != "0":
            await self.call("release_memory", {"weights": "offload" if level == "1" else "discard"})
        self.on_hold()  # the caller holds the pause now
        return {"status": "sleeping", "level": int(level)}

    async def wake_up(self, request: Request) -> dict[str, Any]:
        """vLLM's ``/wake_up?tags=weights&tags=kv_cache`` (no tags: all; ``scheduling``: level
        0): restore the memory named, then resume once everything is resident, as vLLM does —
        unless the weights hold no version (discarded, or torn): then it stays asleep."""
        pairs = request.query_params.multi_items()
        query([(k, "") for k, _ in pairs if k != "tags"], ())
        tags = [v for _, v in pairs] or None
        if tags is not None and any(t not in ("weights", "kv_cache", "scheduling") for t in tags):
            raise InvalidRequest(
                "tags must be weights, kv_cache or scheduling", code="invalid_value", field="query.tags"
            )
        only(await read_json_body(request), ())
        names = set(tags or ("weights", "kv_cache"))
        await self.call("resume_memory", {"weights": "weights" in names, "kv_cache": "kv_cache" in names})
        snap = self.controller.snapshot()
        awake = snap.weights == "resident" and snap.kv_cache == "resident" and not snap.torn
        if awake and snap.paused:
            await self.call("resume_generation", {})
        reply = {"status": "awake" if awake else "sleeping", "tags": tags}
        return reply if self.exact or awake else {**reply, "weights": snap.weights, "torn": snap.torn}

    async def is_sleeping(self, request: Request) -> dict[str, Any]:
        query(request.query_params.multi_items(), ())
        snap = self.controller.snapshot()
        return {"is_sleeping": snap.paused or snap.weights != "resident" or snap.kv_cache != "resident"}
