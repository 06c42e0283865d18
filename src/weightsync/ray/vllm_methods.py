"""The methods vLLM's ``RayVLLMWeightSyncClient`` calls on an ``AsyncLLM`` actor, answered
by the worker's vLLM dialect.

Each method hands its arguments, as the JSON body of the vLLM route of the same name, to
:class:`~weightsync.serve.dialects.vllm.VllmDialect` (the object ``weightsync serve``
answers vLLM's HTTP routes with), so what vLLM's trainer says over Ray is translated,
checked and refused exactly as over HTTP, and a refusal is the same error family with the
same ``code``.  Two additions, both because an actor is one replica of several:

* ``init_info``'s ``rank_offset`` is moved past the replicas before this one (by
  ``replica_index × world_size``, as vLLM places its data-parallel ranks), so the one
  ``init_info`` the client sends every handle gives each actor distinct ranks;
* ``finish_weight_update(weight_version=…)`` commits the version in the finish itself.
  vLLM's unchanged client finishes without one and labels afterwards
  (``update_weight_version``): in between the worker reports ``version_current: false``,
  so the label is never taken for a description of the new weights.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from starlette.requests import Request

from weightsync.core.errors import InvalidRequest
from weightsync.serve.dialects.vllm import VllmDialect

__all__ = ["VllmMethods", "as_request"]


def as_request(body: Any) -> Request:
    """``body`` as the JSON request a dialect route reads.  Raises ``InvalidRequest``
    (``wrong_type``) for a value JSON cannot carry."""
    try:
        raw = json.dumps(body, allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"the arguments are not JSON values: {exc}", code="wrong_type") from None

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": raw, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/", "headers": [], "query_string": b""}
    return Request(scope, receive)


def _field(request: Any, name: str) -> Any:
    """vLLM's request object's ``name`` (its dataclass, or a mapping with that key)."""
    if isinstance(request, Mapping):
        if name in request:
            return request[name]
    elif hasattr(request, name):
        return getattr(request, name)
    raise InvalidRequest(
        f"expected vLLM's request object with {name!r}, got {type(request).__name__}",
        code="wrong_type",
        field=name,
    )


class VllmMethods:
    """``AsyncLLM``'s weight-transfer methods over one worker's vLLM dialect (see the module
    docstring).  ``world_size``: the worker's ranks (its tensor-parallel size)."""

    def __init__(self, dialect: VllmDialect, replica_index: int, world_size: int) -> None:
        self.dialect = dialect
        self.replica_index = replica_index
        self.world_size = world_size

    def ranked(self, init_info: Any) -> Any:
        """``init_info`` with ``rank_offset`` past the replicas before this one (anything that
        is not an integer offset is left for the dialect to refuse)."""
        if not isinstance(init_info, dict) or type(init_info.get("rank_offset")) is not int:
            return init_info
        shift = self.replica_index * self.world_size
        return {**init_info, "rank_offset": init_info["rank_offset"] + shift}

    async def init_weight_transfer_engine(self, request: Any) -> None:
        info = self.ranked(_field(request, "init_info"))
        await self.dialect.init_weight_transfer_engine(as_request({"init_info": info}))

    async def shutdown_weight_transfer_engine(self) -> None:
        await self.dialect.shutdown_weight_transfer_engine(as_request({}))

    async def start_weight_update(self) -> None:
        await self.dialect.start_weight_update(as_request({}))

    async def update_weights(self, request: Any) -> None:
        info = _field(request, "update_info")
        await self.dialect.update_weights(as_request({"update_info": info}))

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        body = {} if weight_version is None else {"weight_version": weight_version}
        await self.dialect.finish_weight_update(as_request(body))

    async def update_weight_version(self, new_version: str) -> None:
        await self.dialect.update_weight_version(as_request({"new_version": new_version}))
