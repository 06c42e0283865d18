"""Typed clients for a worker's admin routes: :class:`WorkerClient` (sync) and
:class:`AsyncWorkerClient` (async), both on httpx.

Each admin route is one method.  An error reply raises the matching
:mod:`weightsync.core.errors` class, with the server's ``code`` and ``message``.
"""

from __future__ import annotations

import socket
from collections.abc import Awaitable
from typing import Any, Generic, TypeVar

import httpx

from weightsync.core import errors

R = TypeVar("R")
Reply = dict[str, Any]

_BY_STATUS: dict[int, type[errors.WeightSyncError]] = {
    400: errors.InvalidRequest,
    401: errors.Unauthorized,
    403: errors.Forbidden,
    404: errors.NotFound,
    409: errors.IllegalState,
    413: errors.PayloadTooLarge,
    415: errors.UnsupportedMediaType,
    501: errors.NotSupported,
    503: errors.EngineUnavailable,
}
_TORN_CODES = frozenset({"weights_torn", "cache_reset_failed"})
_UNSET: Any = object()


def raise_for_reply(status: int, reply: Any, url: str = "") -> Reply:
    """Return ``reply`` if it is a success; raise the error family otherwise."""
    if isinstance(reply, dict) and reply.get("status") == "ok" and status < 400:
        return reply
    if not isinstance(reply, dict):
        raise errors.EngineFailure(f"{url}: HTTP {status} with a non-JSON-object body", code="bad_reply")
    code = str(reply.get("code", "error"))
    cls = _BY_STATUS.get(status, errors.EngineFailure)
    if status >= 500 and code in _TORN_CODES:  # an update that tore (a 409 weights_torn is a refusal)
        cls = errors.WeightsTorn
    details = reply.get("details") or {}
    raise cls(str(reply.get("message", f"HTTP {status}")), code=code, **({"url": url} | details))


def _decode(response: httpx.Response) -> Reply:
    try:
        body = response.json()
    except ValueError:
        body = None
    return raise_for_reply(response.status_code, body, str(response.url))


def _fields(arguments: dict[str, Any]) -> Reply:
    """A method's arguments (``locals()``) as a route body: ``self`` and unset options dropped."""
    return {k: v for k, v in arguments.items() if k != "self" and v is not _UNSET}


class _Routes(Generic[R]):
    """One method per admin route; ``_call`` does the transport (sync or async)."""

    def _call(self, route: str, body: Reply) -> R:
        raise NotImplementedError

    def get_weight_version(self) -> R:
        return self._call("get_weight_version", {})

    def set_weight_version(self, weight_version: Any) -> R:
        return self._call("set_weight_version", {"weight_version": weight_version})

    def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: Any = _UNSET,
        allow_unpaused: Any = _UNSET,
        reset_prefix_cache: Any = _UNSET,
        allow_partial: Any = _UNSET,
        allow_dtype_cast: Any = _UNSET,
    ) -> R:
        return self._call(
            "update_weights_from_disk",
            _fields(locals()),
        )

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        *,
        weight_version: Any = _UNSET,
        allow_unpaused: Any = _UNSET,
        reset_prefix_cache: Any = _UNSET,
        packing: Any = _UNSET,
    ) -> R:
        return self._call(
            "update_weights_from_distributed",
            _fields(locals()),
        )

    def update_weights_from_tensor(
        self,
        tensors: list[Reply],
        *,
        weight_version: Any = _UNSET,
        allow_unpaused: Any = _UNSET,
        reset_prefix_cache: Any = _UNSET,
    ) -> R:
        return self._call(
            "update_weights_from_tensor",
            _fields(locals()),
        )

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        *,
        backend: str = "nccl",
        timeout_s: float = 60.0,
    ) -> R:
        return self._call(
            "init_weights_update_group",
            _fields(locals()),
        )

    def destroy_weights_update_group(self, group_name: str) -> R:
        return self._call("destroy_weights_update_group", {"group_name": group_name})

    def pause_generation(self, mode: str = "keep", *, clear_cache: bool = False) -> R:
        return self._call("pause_generation", {"mode": mode, "clear_cache": clear_cache})

    def resume_generation(self) -> R:
        return self._call("resume_generation", {})

    def flush_cache(self) -> R:
        return self._call("flush_cache", {})

    def abort_request(self, request_id: str) -> R:
        return self._call("abort_request", {"request_id": request_id})

    def liveness_probe(self) -> R:
        return self._call("liveness_probe", {})

    def weight_info(self) -> R:
        return self._call("weight_info", {})

    def engine_rpc(self, method: str, *args: Any, **kwargs: Any) -> R:
        return self._call("engine_rpc", {"method": method, "args": list(args), "kwargs": kwargs})


def _headers(api_key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {api_key}"} if api_key else {}


# httpx writes a request's headers and body separately; without TCP_NODELAY, Nagle's
# algorithm holds the body until the server's delayed ACK (~40 ms per request on Linux).
NODELAY = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]


def sync_transport() -> httpx.HTTPTransport:
    return httpx.HTTPTransport(socket_options=NODELAY)


def async_transport() -> httpx.AsyncHTTPTransport:
    return httpx.AsyncHTTPTransport(socket_options=NODELAY)


class WorkerClient(_Routes[Reply]):
    """Blocking client for one worker.  ``base_url`` like ``http://127.0.0.1:8000``."""

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.http = httpx.Client(
            base_url=self.base_url, headers=_headers(api_key), timeout=timeout, transport=sync_transport()
        )

    def _call(self, route: str, body: Reply) -> Reply:
        return _decode(self.http.post(f"/engine/{route}", json=body))

    def routes(self) -> Reply:
        return _decode(self.http.get("/engine/routes"))

    def complete(self, prompt: str | list[int], **options: Any) -> Reply:
        response = self.http.post("/v1/completions", json={"prompt": prompt, **options})
        body = response.json()
        if response.status_code >= 400:
            raise_for_reply(response.status_code, body, str(response.url))
        return body  # type: ignore[no-any-return]

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> WorkerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncWorkerClient(_Routes[Awaitable[Reply]]):
    """Async client for one worker (use ``async with`` or ``await client.aclose()``)."""

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.http = httpx.AsyncClient(
            base_url=self.base_url, headers=_headers(api_key), timeout=timeout, transport=async_transport()
        )

    async def _post(self, route: str, body: Reply) -> Reply:
        return _decode(await self.http.post(f"/engine/{route}", json=body))

    def _call(self, route: str, body: Reply) -> Awaitable[Reply]:
        return self._post(route, body)

    async def routes(self) -> Reply:
        return _decode(await self.http.get("/engine/routes"))

    async def complete(self, prompt: str | list[int], **options: Any) -> Reply:
        response = await self.http.post("/v1/completions", json={"prompt": prompt, **options})
        body = response.json()
        if response.status_code >= 400:
            raise_for_reply(response.status_code, body, str(response.url))
        return body  # type: ignore[no-any-return]

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> AsyncWorkerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
