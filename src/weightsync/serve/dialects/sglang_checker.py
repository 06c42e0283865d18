"""SGLang 0.5.23's weight checks on a weightsync worker: ``/weights_checker`` and Miles'
``/parallelism_config?rank=R``, in the shapes of SGLang's server
(``sglang/srt/entrypoints/http_server.py`` ``check_weights``,
``sglang/srt/utils/weight_checker.py`` ``WeightChecker``).

``/weights_checker {action, allow_quant_error, skip_tensor_list, selector}``:

- ``checksum`` (the default): ``{success, message, ranks, per_engine_checksum}``; ``ranks``
  holds one entry, ``{checksums, per_gpu_checksum, parallelism_info}``, for the weights the
  engine serves (every tensor once, unsharded, hashed from the live weights as
  ``verify_weights`` hashes them: xxh3-64, 16 hex digits, where SGLang's GPU ranks hash their
  shards).  ``per_gpu_checksum`` and ``per_engine_checksum`` are computed as SGLang computes
  them (sha256 over the sorted names and checksums; sha256 over the ranks' checksums), so
  two workers serving the same bytes answer the same.
- ``snapshot``: remember the served weights' hashes; ``compare``: hash them again and compare,
  tensor by tensor (200, or 400 ``weights_differ`` naming the tensors that differ), then forget the snapshot, as
  SGLang does (``no_snapshot`` without one).  There is no quantization here:
  ``allow_quant_error`` changes nothing, every comparison is exact.
- ``reset_tensors``: SGLang overwrites every weight with random values so that a later
  ``compare`` proves the next update rewrote them all (Miles' ``--check-weight-update-equal``).
  Here it discards the weights (``release_memory`` with ``weights: discard``, then the memory
  back): the worker then holds no version's weights and stays paused until an update rewrites
  every tensor, which is the same proof, and a worker never serves random weights under a
  label.  ``skip_tensor_list`` (tensors to keep as they are) is refused for it: a discard keeps
  none.

``skip_tensor_list`` names substrings of tensor names left out of ``checksum`` and ``compare``.
``selector`` is SGLang's (``draft`` refused: there is one model).  Nothing here changes a
weight, a version or a cache, except ``reset_tensors``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, Final

from fastapi import Request

from weightsync.core.controller import Controller
from weightsync.core.engine import MemoryEngine, ParallelEngine
from weightsync.core.errors import IllegalState, InvalidRequest, NotSupported
from weightsync.edge.dialects import query, sglang_int, sglang_selector
from weightsync.serve.dialects.common import Calls, read_json_body
from weightsync.serve.dialects.sglang_fields import fields

ACTIONS: Final = ("checksum", "snapshot", "reset_tensors", "compare")
"""``CheckWeightsReqInput.action`` values (``checksum`` the default)."""

FIELDS: Final = ("action", "allow_quant_error", "skip_tensor_list", "selector", "rid")
"""``CheckWeightsReqInput``'s fields (``rid`` is every SGLang request's)."""

MAX_SKIP: Final = 1024
"""At most this many ``skip_tensor_list`` entries."""


def overall_checksum(checksums: Mapping[str, str]) -> str:
    """SGLang's ``overall_checksum``: sha256 over every name and its checksum, names sorted."""
    h = hashlib.sha256()
    for name in sorted(checksums):
        h.update(name.encode())
        h.update(checksums[name].encode())
    return h.hexdigest()


def _body(raw: Any) -> dict[str, Any]:
    b = fields({} if raw is None else raw, FIELDS)
    action = b.get("action", "checksum")
    if action not in ACTIONS:
        raise InvalidRequest(f"action must be one of {list(ACTIONS)}", code="invalid_value", field="action")
    if type(b.get("allow_quant_error", False)) is not bool:
        raise InvalidRequest(
            "allow_quant_error must be a boolean", code="wrong_type", field="allow_quant_error"
        )
    skip = b.get("skip_tensor_list")
    if skip is not None and (
        type(skip) is not list or len(skip) > MAX_SKIP or any(type(s) is not str or not s for s in skip)
    ):
        raise InvalidRequest(
            f"skip_tensor_list must be a list of at most {MAX_SKIP} non-empty strings, or null",
            code="invalid_value",
            field="skip_tensor_list",
        )
    sglang_selector(b.get("selector"))
    return {"action": action, "skip": tuple(skip or ())}


class SglangChecker:
    """``/weights_checker`` and ``/parallelism_config`` over one controller (see the module
    docstring)."""

    ROUTES: Final = (
        (("GET", "POST"), "/weights_checker", "weights_checker"),
        (("GET",), "/parallelism_config", "parallelism_config"),
    )

    def __init__(self, controller: Controller, calls: Calls) -> None:
        self.controller = controller
        self.call = calls
        self._snapshot: dict[str, str] | None = None

    def _world_size(self) -> int:
        engine = self.controller.engine
        return engine.world_size if isinstance(engine, ParallelEngine) else 1

    async def _hashes(self, skip: tuple[str, ...]) -> dict[str, str]:
        """The live weights' per-tensor hashes (``skip``'s substrings left out)."""
        found = await self.controller.verify_weights()
        if found.hashes is None:  # verify_weights hashes every tensor unless told otherwise
            raise NotSupported("the engine gave no per-tensor hashes", code="not_supported")
        return {n: h for n, h in found.hashes.items() if not any(s in n for s in skip)}

    async def weights_checker(self, request: Request) -> dict[str, Any]:
        body = _body(await read_json_body(request))
        action, skip = body["action"], body["skip"]
        if action == "checksum":
            return await self._checksum(skip)
        if action == "snapshot":
            self._snapshot = await self._hashes(())
            return {"success": True, "message": f"Snapshot of {len(self._snapshot)} tensors taken."}
        if action == "compare":
            return await self._compare(skip)
        return await self._reset(skip)

    async def _checksum(self, skip: tuple[str, ...]) -> dict[str, Any]:
        checksums = await self._hashes(skip)
        per_gpu = overall_checksum(checksums)
        size = self._world_size()
        info = {
            "role": "target",
            "tp_rank": 0,
            "tp_size": size,
            "dp_rank": 0,
            "dp_size": 1,
            "pp_rank": 0,
            "pp_size": 1,
            "rank": 0,
            "size": 1,
        }
        rank = {"checksums": checksums, "per_gpu_checksum": per_gpu, "parallelism_info": [info]}
        return {
            "success": True,
            "message": f"Checksums of {len(checksums)} tensors (xxh3-64 of the live weights, unsharded).",
            "ranks": [rank],
            "per_engine_checksum": hashlib.sha256(per_gpu.encode()).hexdigest(),
        }

    async def _compare(self, skip: tuple[str, ...]) -> dict[str, Any]:
        if self._snapshot is None:
            raise IllegalState("no snapshot to compare with: POST action snapshot first", code="no_snapshot")
        before = {n: h for n, h in self._snapshot.items() if not any(s in n for s in skip)}
        now = await self._hashes(skip)
        self._snapshot = None  # SGLang forgets it after a compare, equal or not
        differ = sorted(n for n in before.keys() | now.keys() if before.get(n) != now.get(n))
        if differ:
            shown = ", ".join(differ[:10]) + (f" and {len(differ) - 10} more" if len(differ) > 10 else "")
            raise IllegalState(
                f"{len(differ)} tensor(s) differ from the snapshot: {shown}", code="weights_differ"
            )
        return {"success": True, "message": f"All {len(now)} tensors equal the snapshot."}

    async def _reset(self, skip: tuple[str, ...]) -> dict[str, Any]:
        if skip:
            raise InvalidRequest(
                "reset_tensors discards every weight here (the next update must rewrite them all); "
                "it cannot keep the tensors of skip_tensor_list: leave it out",
                code="not_supported",
                field="skip_tensor_list",
            )
        if not isinstance(self.controller.engine, MemoryEngine):
            raise NotSupported(
                f"engine {self.controller.engine.name!r} cannot discard its weights, so reset_tensors "
                "is not available; every update is verified by its digest instead",
                code="not_supported",
            )
        pausing = not self.controller.snapshot().paused
        if pausing:
            await self.call("pause_generation", {"mode": "wait"})
        try:
            await self.call("release_memory", {"weights": "discard", "kv_cache": False})
        except Exception:
            if pausing:  # a refused discard changes nothing: the worker serves on
                await self.call("resume_generation", {})
            raise
        state = await self.call("resume_memory", {"weights": True, "kv_cache": False})
        return {
            "success": True,
            "message": "Weights discarded: the worker is paused and holds no version until an update "
            "rewrites every tensor (then POST /continue_generation).",
            "weights_released": state.get("weights_released", True),
        }

    async def parallelism_config(self, request: Request) -> dict[str, Any]:
        """SGLang's ``RankParallelismConfig`` of rank ``rank`` (Miles' ``get_parallelism_info``):
        tensor parallelism over the engine's world size, nothing else."""
        params = query(request.query_params.multi_items(), ("rank",))
        size = self._world_size()
        rank = sglang_int(params.get("rank", "0"))
        if type(rank) is not int or not 0 <= rank < size:
            raise InvalidRequest(
                f"rank must be an integer in [0, {size})", code="invalid_value", field="rank"
            )
        return {
            "tp_size": size,
            "tp_rank": rank,
            "pp_size": 1,
            "pp_rank": 0,
            "ep_size": 1,
            "ep_rank": 0,
            "moe_tp_size": size,
            "moe_tp_rank": rank,
            "attn_tp_size": size,
            "attn_tp_rank": rank,
            "attn_dp_size": 1,
            "attn_dp_rank": 0,
            "world_size": size,
            "global_rank": rank,
            "local_rank": rank,
        }
