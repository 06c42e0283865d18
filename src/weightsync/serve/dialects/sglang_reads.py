"""What an SGLang client reads of a worker: whether it can generate (``/health_generate``),
its server arguments (``/get_server_info``), the model it serves (``/get_model_info``), the
weight version and its load, in the shapes of SGLang's own server
(``sglang/srt/entrypoints/http_server.py``).  None of them changes anything.

``model_path`` says what is held: the path of the checkpoint an SGLang disk update loaded
(:class:`ServedModel`, written by :mod:`weightsync.serve.dialects.sglang`) while the worker
still holds exactly those weights (the same digest), else the engine's own name — before any
load, and after a push, a tensor update or another load replaced them.  SGLang's "reload the
current ``model_path``" idiom then posts a real path only when reloading it changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any, Final

import attrs
from fastapi import Request

from weightsync import __version__
from weightsync.core.controller import Controller
from weightsync.core.engine import (
    DescribedEngine,
    GeneratingEngine,
    MemoryEngine,
    ParallelEngine,
    TrackingEngine,
)
from weightsync.core.errors import EngineUnavailable, NotSupported, WeightSyncError
from weightsync.core.snapshot import Snapshot
from weightsync.serve.dialects.common import Calls, weight_label
from weightsync.serve.replies import JSONReply

LOAD_FORMAT: Final = "auto"
"""SGLang's ``load_format`` a worker reports: it reads safetensors checkpoints, SGLang's default."""

HEALTH_CHECK_TIMEOUT_S: Final = 20.0
"""How long ``/health_generate`` waits for its one-token generation (SGLang's
``SGLANG_HEALTH_CHECK_TIMEOUT`` default)."""


@attrs.define
class ServedModel:
    """The checkpoint an SGLang client is told the worker serves."""

    name: str
    """The engine's name: what ``model_path`` says while no checkpoint's weights are held."""
    loaded: str | None = None
    """The path of the last checkpoint an SGLang ``/update_weights_from_disk`` loaded, as the
    client gave it (``None`` before any)."""
    digest: str | None = None
    """The digest the worker held right after that load (``None`` when unknown)."""

    def record(self, path: str, snapshot: Snapshot) -> None:
        """A disk update of ``path`` committed ``snapshot``."""
        self.loaded, self.digest = path, snapshot.digest

    def model_path(self, snapshot: Snapshot) -> str:
        """The loaded checkpoint's path while ``snapshot`` holds its weights, else the name."""
        held = self.loaded is not None and self.digest is not None and snapshot.digest == self.digest
        return self.loaded if held and self.loaded is not None else self.name


class SglangReads:
    """SGLang's read routes over one controller (see the module docstring)."""

    def __init__(self, controller: Controller, calls: Calls, served: ServedModel) -> None:
        self.controller = controller
        self.call = calls
        self.served = served

    async def health_generate(self, request: Request) -> JSONReply:
        """200 once the engine generated a token (or is serving requests: SGLang skips its
        probe then), else 503 with SGLang's failure body and why: an engine that does not
        generate or is not alive, a paused or torn worker (a generation would wait), a
        generation that failed or took longer than :data:`HEALTH_CHECK_TIMEOUT_S`."""
        try:
            message = await self._probe()
        except EngineUnavailable as exc:
            return JSONReply({"success": False, "message": exc.message, "code": exc.code}, status_code=503)
        return JSONReply({"success": True, "message": message})

    async def _probe(self) -> str:
        engine = self.controller.engine
        if not isinstance(engine, GeneratingEngine):
            raise EngineUnavailable("this engine does not generate", code="not_generating")
        if not await self.controller.is_alive():
            raise EngineUnavailable("the engine is not alive", code="engine_unavailable")
        snap = self.controller.snapshot()
        if snap.torn:
            raise EngineUnavailable(
                "the weights are torn: nothing is generated until an update heals them", code="weights_torn"
            )
        if snap.paused:
            raise EngineUnavailable("generation is paused (POST /continue_generation)", code="paused")
        if isinstance(engine, TrackingEngine) and engine.in_flight():
            return "The engine is serving requests."
        rid = f"HEALTH_CHECK_{uuid.uuid4().hex}"
        try:
            await asyncio.wait_for(
                engine.generate([0], max_tokens=1, temperature=0.0, request_id=rid), HEALTH_CHECK_TIMEOUT_S
            )
        except Exception as exc:
            with contextlib.suppress(WeightSyncError):  # the probe may have ended meanwhile
                await self.call("abort_request", {"request_id": rid})
            raise EngineUnavailable(
                f"the one-token generation failed: {type(exc).__name__}: {exc}", code="engine_unavailable"
            ) from None
        return "The engine generated a token."

    async def model_info(self, request: Request) -> dict[str, Any]:
        return {
            "model_path": self.served.model_path(self.controller.snapshot()),
            "tokenizer_path": None,
            "is_generation": isinstance(self.controller.engine, GeneratingEngine),
            "preferred_sampling_params": None,
            "weight_version": weight_label(self.controller)["weight_version"],
            "served_model_name": self.controller.engine.name,  # SGLang 0.5.23
            "load_format": LOAD_FORMAT,
        }

    async def get_weight_version(self, request: Request) -> dict[str, Any]:
        return weight_label(self.controller)

    async def server_info(self, request: Request) -> dict[str, Any]:
        """SGLang's server arguments that mean something here, the weight version (SGLang
        keeps it among its server arguments), one data-parallel rank's ``internal_states``
        and the weightsync version; nothing secret (no API key)."""
        engine = self.controller.engine
        host, port = request.scope.get("server") or (None, None)
        label = weight_label(self.controller)
        snap = self.controller.snapshot()
        return {
            "model_path": self.served.model_path(snap),
            "tokenizer_path": None,
            "served_model_name": engine.name,
            "host": host,
            "port": port,
            "tp_size": engine.world_size if isinstance(engine, ParallelEngine) else 1,
            "dp_size": 1,
            "pp_size": 1,
            "ep_size": 1,
            "nnodes": 1,
            "node_rank": 0,
            # what Miles' external engines assert equal to their own computed arguments
            # (SGLangEngine._init_external): one engine on consecutive devices from the first
            "gpu_id_step": 1,
            "base_gpu_id": 0,
            "enable_memory_saver": isinstance(engine, MemoryEngine),
            "load_format": LOAD_FORMAT,
            "dtype": engine.dtype if isinstance(engine, DescribedEngine) else "auto",
            "context_length": engine.max_model_len if isinstance(engine, DescribedEngine) else None,
            "weight_version": label["weight_version"],
            "internal_states": [
                {
                    "status": "UnHealthy" if snap.torn else "Up",
                    "weight_version": label["weight_version"],
                    "version_declared": label["version_declared"],
                    "paused": snap.paused,
                    "torn": snap.torn,
                    "digest": snap.digest,
                }
            ],
            "engine": engine.name,
            "weightsync_version": __version__,
        }

    async def get_load(self, request: Request) -> list[dict[str, Any]]:
        """One entry per data-parallel rank (one here), as SGLang's ``GetLoadReqOutput``:
        ``num_reqs`` the requests the engine holds; ``num_waiting_reqs`` all of them while
        paused (nothing runs), else 0 (a request waiting for a free slot counts as running).
        Raises ``NotSupported`` for an engine that does not list its requests."""
        engine = self.controller.engine
        if not isinstance(engine, TrackingEngine):
            raise NotSupported("this engine does not list the requests it holds", code="not_supported")
        held = len(engine.in_flight())
        waiting = held if self.controller.snapshot().paused else 0
        return [{"dp_rank": 0, "num_reqs": held, "num_waiting_reqs": waiting}]

    ROUTES: Final = (
        (("GET",), "/get_server_info", "server_info"),
        (("GET",), "/server_info", "server_info"),
        (("GET",), "/model_info", "model_info"),
        (("GET",), "/get_model_info", "model_info"),
        (("GET",), "/get_weight_version", "get_weight_version"),
        (("GET",), "/get_load", "get_load"),
    )
