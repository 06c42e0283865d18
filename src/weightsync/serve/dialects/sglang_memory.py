"""SGLang's memory routes on a weightsync worker: ``/release_memory_occupation`` and
``/resume_memory_occupation`` (``ReleaseMemoryOccupationReqInput`` / ``ResumeMemoryOccupationReqInput``:
``tags``, a list of ``weights``, ``kv_cache``, ``cuda_graph``; null or empty = all).

Each maps onto the admin routes ``release_memory`` / ``resume_memory``.  SGLang's ``weights``
tag frees the weights without keeping them (unless SGLang runs with a CPU backup, a server
flag), so it is a *discard*: the worker then holds no version's weights until an update rewrote
them (slime and verl resume the ``weights`` memory, update, then resume ``kv_cache``).
``cuda_graph`` is accepted and means nothing here (no CUDA graphs).  SGLang releases an idle
engine without a pause; a worker releases only while paused, so a release on a serving worker
pauses it first (mode ``wait``: running requests finish), and the resume that makes every part
resident again resumes it, when the weights hold a version.
"""

from __future__ import annotations

from typing import Any, Final

from fastapi import Request

from weightsync.core.controller import Controller
from weightsync.core.errors import InvalidRequest
from weightsync.serve.dialects.common import Calls, dict_body, read_json_body

TAGS: Final = ("weights", "kv_cache", "cuda_graph")
"""SGLang's memory tags (``sglang.srt.constants``)."""


def _tags(body: Any) -> set[str]:
    b = dict_body("body", body)
    unknown = sorted(set(b) - {"tags"})
    if unknown:
        raise InvalidRequest(
            f"unknown field(s) {unknown}; allowed: ['tags']", code="unknown_field", fields=unknown
        )
    tags = b.get("tags")
    if tags is None or tags == []:
        return set(TAGS)
    if type(tags) is not list or any(type(t) is not str or t not in TAGS for t in tags):
        raise InvalidRequest(
            f"tags must be a list of {list(TAGS)}, or null", code="invalid_value", field="tags"
        )
    return set(tags)


class SglangMemory:
    """The memory routes of SGLang's API over one controller (see the module docstring)."""

    ROUTES: Final = (
        (("GET", "POST"), "/release_memory_occupation", "release_memory_occupation"),
        (("GET", "POST"), "/resume_memory_occupation", "resume_memory_occupation"),
    )

    def __init__(self, controller: Controller, calls: Calls) -> None:
        self.controller = controller
        self.call = calls
        self.paused_here = False  # a release paused a serving worker: the full resume resumes it

    async def release_memory_occupation(self, request: Request) -> dict[str, Any]:
        tags = _tags(await read_json_body(request))
        body = {"weights": "discard" if "weights" in tags else "keep", "kv_cache": "kv_cache" in tags}
        pausing = not self.controller.snapshot().paused
        if pausing:
            await self.call("pause_generation", {"mode": "wait"})
        try:
            state = await self.call("release_memory", body)
        except Exception:
            if pausing:
                await self.call("resume_generation", {})  # a refused release changes nothing
            raise
        self.paused_here = self.paused_here or pausing
        return {"success": True, "message": "Memory released.", **_state(state)}

    async def resume_memory_occupation(self, request: Request) -> dict[str, Any]:
        tags = _tags(await read_json_body(request))
        state = await self.call(
            "resume_memory", {"weights": "weights" in tags, "kv_cache": "kv_cache" in tags}
        )
        snap = self.controller.snapshot()
        serving = snap.weights == "resident" and snap.kv_cache == "resident" and not snap.torn
        if self.paused_here and serving and snap.paused:
            await self.call("resume_generation", {})
            self.paused_here = False
        message = "Memory resumed." + (
            " The weights hold no version: update them." if snap.weights_released else ""
        )
        return {"success": True, "message": message, **_state(state)}


def _state(reply: dict[str, Any]) -> dict[str, Any]:
    return {k: reply[k] for k in ("weights", "kv_cache", "weights_released", "digest")}
