"""Typed clients for a worker's admin routes: :class:`WorkerClient` (sync) and
:class:`AsyncWorkerClient` (async), both on httpx.

Each admin route is one method, generated from a signature (:func:`route`).  An error reply raises the matching
:mod:`weightsync.core.errors` class, with the server's ``code`` and ``message``.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import inspect
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import httpx

from weightsync.core import errors

from .replies import (
    AbandonReply,
    AliveReply,
    CapabilitiesReply,
    DeclaredReply,
    FlushReply,
    OkReply,
    PauseReply,
    RoutesReply,
    RpcReply,
    SessionReply,
    StateReply,
    UpdateReply,
    VerifyReply,
    WeightInfoReply,
)

R = TypeVar("R")
Reply = dict[str, Any]


class _Unset:
    """The default of an option the caller did not give: it is left out of the request body,
    so the worker applies its own default."""

    _instance: _Unset | None = None

    def __new__(cls) -> _Unset:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNSET"

    def __bool__(self) -> bool:
        return False


UNSET: Any = _Unset()
"""Default of an optional field: left out of the body, so the worker's default applies."""
_UNSET: Any = UNSET


def raise_for_reply(status: int, reply: Any, url: str = "") -> Reply:
    """Return ``reply`` if it is a success; raise the error family otherwise."""
    if isinstance(reply, dict) and reply.get("status") == "ok" and status < 400:
        return reply
    if not isinstance(reply, dict):
        raise errors.EngineFailure(f"{url}: HTTP {status} with a non-JSON-object body", code="bad_reply")
    exc = errors.WeightSyncError.from_reply(reply, status)
    exc.details.setdefault("url", url)
    raise exc


def _decode(response: httpx.Response) -> Reply:
    try:
        body = response.json()
    except ValueError:
        body = None
    return raise_for_reply(response.status_code, body, str(response.url))


def route(stub: Callable[..., Any]) -> Callable[..., Any]:
    """Turn ``stub`` into the client method of the admin route named like it.

    The route name is the method's name (spelled once, in :data:`weightsync.core.routes.ROUTES`;
    a test checks every route has a method whose parameters are its body's fields).  The body
    is the arguments the caller gave plus the stub's defaults, options left at ``_UNSET``
    dropped, unless the stub returns a body of its own (``engine_rpc`` does).  The stub's
    docstring and return annotation (a :mod:`weightsync.trainer.replies` type) are the method's.
    """
    signature = inspect.signature(stub)

    @functools.wraps(stub)
    def method(self: _Routes[Any], *args: Any, **kwargs: Any) -> Any:
        body = stub(self, *args, **kwargs)
        if body is None:
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            body = {k: v for k, v in list(bound.arguments.items())[1:] if v is not _UNSET}
        return self._call(stub.__name__, body)

    return method


class _Routes(Generic[R]):
    """One method per admin route (see :func:`route`); ``_call`` does the transport (sync,
    async, or many workers at once).  Each method returns the worker's ok reply (typed in
    :mod:`weightsync.trainer.replies`; awaited on the async client, one per worker on a
    fleet) and raises the :mod:`weightsync.core.errors` class of an error reply, with the
    worker's ``code`` and ``message``."""

    def _call(self, route: str, body: Reply) -> R:
        raise NotImplementedError

    @route
    def get_weight_version(self) -> StateReply:
        """The committed version and state: ``version`` (``None`` while undeclared), ``paused``,
        ``torn``, ``update_in_flight``, the held weights' ``digest`` and whether the version
        still describes them (``version_current``).  A read: never waits for an update."""

    @route
    def set_weight_version(
        self, weight_version: Any, *, epoch: Any = _UNSET, expected_digest: Any = _UNSET
    ) -> DeclaredReply:
        """Declare ``weight_version`` (any JSON value) for the weights held; never touches them.

        ``epoch``: a fleet epoch (a smaller one than the worker's is refused, ``stale_epoch``);
        ``expected_digest``: refuse (``digest_mismatch``) unless the held weights have it.
        Raises ``IllegalState`` on either guard (nothing changed)."""

    @route
    def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: Any = _UNSET,
        allow_unpaused: Any = _UNSET,
        reset_prefix_cache: Any = _UNSET,
        dry_run: Any = _UNSET,
        allow_partial: Any = _UNSET,
        allow_dtype_cast: Any = _UNSET,
        session: Any = _UNSET,
    ) -> UpdateReply:
        """Load a safetensors checkpoint directory (``model_path``) into the served weights.

        On success the reply has ``version`` (this update's label), ``digest``, ``stats`` and
        the resulting ``state``; ``weight_version`` declares it (omitted: the old
        declaration is kept, and ``state.version_current`` turns false).  ``dry_run`` checks
        without loading.  Raises ``IllegalState`` while running without ``allow_unpaused``,
        ``InvalidRequest`` for a refused checkpoint (nothing written), ``WeightsTorn`` when
        the load failed after writing began (the worker stays paused until an update works).
        """

    @route
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
        dry_run: Any = _UNSET,
        packing: Any = _UNSET,
        hashes: Any = _UNSET,
        session: Any = _UNSET,
    ) -> UpdateReply:
        """Receive the tensors ``names`` (with ``dtypes`` and ``shapes``) that a trainer
        broadcasts over the weight-update group ``group_name`` (see
        :class:`~weightsync.trainer.broadcast.Broadcaster`).  Reply and errors as for
        :meth:`update_weights_from_disk`."""

    @route
    def update_weights_from_plan(
        self,
        group_name: str,
        stream_id: str,
        plan: Reply,
        *,
        weight_version: Any = _UNSET,
        allow_unpaused: Any = _UNSET,
        reset_prefix_cache: Any = _UNSET,
        dry_run: Any = _UNSET,
        session: Any = _UNSET,
    ) -> UpdateReply:
        """Receive this worker's part of a sharded transfer ``plan`` (see ``weightsync plan``)
        as stream ``stream_id`` over the weight-update group ``group_name``.  Reply and errors
        as for :meth:`update_weights_from_disk`."""

    @route
    def update_weights_from_tensor(
        self,
        tensors: list[Reply],
        *,
        weight_version: Any = _UNSET,
        allow_unpaused: Any = _UNSET,
        reset_prefix_cache: Any = _UNSET,
        dry_run: Any = _UNSET,
        session: Any = _UNSET,
    ) -> UpdateReply:
        """Load tensors a colocated trainer shared (shared-memory or CUDA-IPC handles, one
        dict per tensor: name, dtype, shape, handle).  Reply and errors as for
        :meth:`update_weights_from_disk`."""

    @route
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
    ) -> OkReply:
        """Join the torch.distributed weight-update group ``group_name`` as ranks from
        ``rank_offset`` (the trainer is rank 0 of ``world_size``).  Raises ``EngineFailure``
        when the group does not form within ``timeout_s`` (the worker keeps serving),
        ``NotSupported`` when the engine has no groups."""

    @route
    def destroy_weights_update_group(self, group_name: str) -> OkReply:
        """Leave the weight-update group ``group_name``."""

    @route
    def pause_generation(self, mode: str = "keep", *, clear_cache: bool = False) -> PauseReply:
        """Pause generation: ``keep`` holds running requests, ``wait`` lets them finish,
        ``abort`` ends them (``aborted`` counts them).  Idempotent (``already_paused``)."""

    @route
    def resume_generation(self) -> OkReply:
        """Resume generation.  Raises ``IllegalState`` (``weights_torn``) while torn."""

    @route
    def flush_cache(self) -> FlushReply:
        """Reset the prefix cache.  Raises ``IllegalState`` (``cache_in_use``) when requests
        hold it (pause with ``abort`` or ``wait`` first)."""

    @route
    def abort_request(self, request_id: str) -> OkReply:
        """Abort the in-flight request ``request_id``; ``NotFound`` when there is none."""

    @route
    def liveness_probe(self) -> AliveReply:
        """Whether the engine can serve (``alive``)."""

    @route
    def weight_info(self) -> WeightInfoReply:
        """Names, dtypes (torch names such as ``bfloat16``) and shapes of the served weights."""

    @route
    def verify_weights(self) -> VerifyReply:
        """Hash the weights actually served and compare with the recorded digest (``match``).
        Raises ``NotSupported`` when the engine cannot attest its weights."""

    @route
    def begin_weight_update(self) -> SessionReply:
        """Open an update session (paused or torn worker): updates sent with ``session=True``
        stream into it and nothing is committed until :meth:`end_weight_update`.  The reply
        says ``session_open`` and its ``deadline_s``.  Raises ``IllegalState`` while running."""

    @route
    def end_weight_update(
        self, *, weight_version: Any = _UNSET, reset_prefix_cache: Any = _UNSET
    ) -> UpdateReply:
        """Finish the update session: reset the prefix cache, commit ``weight_version``.
        Reply as for :meth:`update_weights_from_disk`; ``IllegalState`` without a session."""

    @route
    def abort_weight_update(self) -> AbandonReply:
        """Abandon the update session: the worker is torn if it wrote, untouched otherwise
        (the reply's ``torn``, ``paused`` and ``digest`` say which)."""

    @route
    def capabilities(self) -> CapabilitiesReply:
        """What this worker speaks and supports (dialects, sources, engine features)."""

    @route
    def engine_rpc(self, method: str, *args: Any, **kwargs: Any) -> RpcReply:
        """Call the engine method ``method`` (only names on its allow-list; others are
        ``InvalidRequest``) with ``args`` and ``kwargs``; the reply's ``result`` is its value."""
        return {"method": method, "args": list(args), "kwargs": kwargs}


def _check_url(url: str) -> str:
    """``url`` without a trailing slash, once it is a worker's base URL: ``http`` or ``https``,
    with a host, and nothing after the port but an optional path prefix.

    :raises InvalidRequest: ``bad_worker_url``, naming the fix (``127.0.0.1:8000`` → add
        ``http://``).
    """
    if not isinstance(url, str):
        raise errors.InvalidRequest(
            f"a worker URL must be a string, not {type(url).__name__}", code="bad_worker_url"
        )
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError, TypeError):
        parsed = None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host:
        hint = f" (did you mean 'http://{url}'?)" if "://" not in url else ""
        raise errors.InvalidRequest(
            f"{url!r} is not a worker URL: give http://HOST:PORT or https://HOST:PORT{hint}",
            code="bad_worker_url",
        )
    return url.rstrip("/")


def _headers(api_key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {api_key}"} if api_key else {}


# httpx writes a request's headers and body separately; without TCP_NODELAY, Nagle's
# algorithm holds the body until the server's delayed ACK (~40 ms per request on Linux).
NODELAY = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]


def sync_transport() -> httpx.HTTPTransport:
    """An httpx transport with ``TCP_NODELAY`` (no ~40 ms Nagle stall per request)."""
    return httpx.HTTPTransport(socket_options=NODELAY)


def async_transport() -> httpx.AsyncHTTPTransport:
    """The async :func:`sync_transport`."""
    return httpx.AsyncHTTPTransport(socket_options=NODELAY)


class WorkerClient(_Routes[Reply]):
    """Blocking client for one worker.  ``base_url`` like ``http://127.0.0.1:8000`` (one
    without a scheme is refused, ``InvalidRequest`` ``bad_worker_url``); ``api_key`` is sent
    as a bearer token; ``timeout`` bounds each call in seconds.  Use ``with`` or
    :meth:`close`.  Every admin route is a method returning the worker's ok reply."""

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout: float = 600.0) -> None:
        self.base_url = _check_url(base_url)
        self.http = httpx.Client(
            base_url=self.base_url, headers=_headers(api_key), timeout=timeout, transport=sync_transport()
        )

    def _call(self, route: str, body: Reply) -> Reply:
        return _decode(self.http.post(f"/engine/{route}", json=body))

    def routes(self) -> RoutesReply:
        """The admin routes the worker serves, its engine's name and world size."""
        return _decode(self.http.get("/engine/routes"))  # type: ignore[return-value]

    def complete(self, prompt: str | list[int], **options: Any) -> Reply:
        """``POST /v1/completions`` with ``prompt`` (text or token ids) and OpenAI-style
        ``options`` (``max_tokens``, ``temperature`` …); returns the completion object, whose
        choices carry the weight version that produced them.  Raises the error family."""
        response = self.http.post("/v1/completions", json={"prompt": prompt, **options})
        body = response.json()
        if response.status_code >= 400:
            raise_for_reply(response.status_code, body, str(response.url))
        return body  # type: ignore[no-any-return]

    def close(self) -> None:
        """Close the client's connections."""
        self.http.close()

    def __enter__(self) -> WorkerClient:
        """The client itself; closed when the ``with`` block ends."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Close the client."""
        self.close()


class AsyncWorkerClient(_Routes[Awaitable[Reply]]):
    """Async client for one worker (use ``async with`` or ``await client.aclose()``).

    ``retries``: how many times a request that could not *connect* is sent again (it never
    reached the worker, so even a load is safe to resend), after ``backoff_s``, doubling up
    to ``max_backoff_s``.  :meth:`within` gives a view bounded by a deadline: every call then
    waits at most until it, and no retry starts that could not finish before it.  A call
    raises the worker's refusal, or ``EngineUnavailable`` with code ``unreachable`` (no
    connection) or ``timeout`` (no answer in time).  ``transport``: any httpx async
    transport (``httpx.ASGITransport`` over a worker app runs it in-process).
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout: float = 600.0,
        transport: httpx.AsyncBaseTransport | None = None,
        retries: int = 0,
        backoff_s: float = 0.05,
        max_backoff_s: float = 1.0,
    ) -> None:
        self.base_url = _check_url(base_url)
        self.timeout = timeout
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.deadline: float | None = None  # time.monotonic() value
        self.http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=_headers(api_key),
            timeout=timeout,
            transport=transport or async_transport(),
        )

    def within(self, deadline: float | None) -> AsyncWorkerClient:
        """This client (same connections) with every call bounded by ``deadline``, a
        :func:`time.monotonic` value (``None``: only the client's timeout)."""
        view = copy.copy(self)
        view.deadline = deadline
        return view

    def _left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    async def _post(self, route: str, body: Reply) -> Reply:
        attempt = 0
        while True:
            left = self._left()
            if left is not None and left <= 0:
                raise errors.EngineUnavailable(
                    f"{self.base_url}: no time left for {route}", code="timeout", url=self.base_url
                )
            timeout = self.timeout if left is None else min(self.timeout, left)
            try:
                response = await asyncio.wait_for(
                    self.http.post(f"/engine/{route}", json=body, timeout=timeout), timeout
                )
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                backoff = min(self.max_backoff_s, self.backoff_s * 2**attempt)
                left = self._left()
                if attempt >= self.retries or (left is not None and backoff >= left):
                    raise errors.EngineUnavailable(
                        f"{self.base_url}: {route}: {exc or type(exc).__name__} "
                        f"(after {attempt + 1} attempt(s))",
                        code="unreachable",
                        url=self.base_url,
                    ) from None
                attempt += 1
                await asyncio.sleep(backoff)
                continue
            except (httpx.TimeoutException, asyncio.TimeoutError):
                raise errors.EngineUnavailable(
                    f"{self.base_url}: {route} did not answer in time", code="timeout", url=self.base_url
                ) from None
            except httpx.HTTPError as exc:
                raise errors.EngineUnavailable(
                    f"{self.base_url}: {route}: {exc!r}", code="unreachable", url=self.base_url
                ) from None
            return _decode(response)

    def _call(self, route: str, body: Reply) -> Awaitable[Reply]:
        return self._post(route, body)

    async def routes(self) -> RoutesReply:
        """The admin routes the worker serves, its engine's name and world size."""
        return _decode(await self.http.get("/engine/routes"))  # type: ignore[return-value]

    async def complete(self, prompt: str | list[int], **options: Any) -> Reply:
        """``POST /v1/completions`` with ``prompt`` (text or token ids) and OpenAI-style
        ``options``; returns the completion object.  Raises the error family."""
        response = await self.http.post("/v1/completions", json={"prompt": prompt, **options})
        body = response.json()
        if response.status_code >= 400:
            raise_for_reply(response.status_code, body, str(response.url))
        return body  # type: ignore[no-any-return]

    async def aclose(self) -> None:
        """Close the client's connections (every :meth:`within` view shares them)."""
        await self.http.aclose()

    async def __aenter__(self) -> AsyncWorkerClient:
        """The client itself; closed when the ``async with`` block ends."""
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Close the client."""
        await self.aclose()
