"""The protocol an engine implements so the controller can drive it.

Kept small on purpose (httpx's ``BaseTransport`` is the model): seven coroutines, all
side effects of the state machine happen through them, and none of them decides
legality — the controller has already done that when it calls one.
"""

from __future__ import annotations

from collections.abc import Awaitable, Collection, Mapping
from typing import Any, Protocol, runtime_checkable

from weightsync.core.errors import CacheInUse
from weightsync.core.requests import InitGroupRequest
from weightsync.core.snapshot import Attestation, LoadStats, PauseMode, PauseOutcome, Snapshot, WeightInfo
from weightsync.core.sources import WeightSource


@runtime_checkable
class Engine(Protocol):
    """What weightsync needs from an inference engine.

    Errors: every method raises the :mod:`weightsync.core.errors` family.  ``load_weights``
    raises :class:`~weightsync.core.errors.LoadFailed` with ``wrote`` telling whether any
    weight was written before the failure; it must validate the whole source before the
    first write whenever the source allows it.
    """

    name: str

    async def pause(self, mode: PauseMode, clear_cache: bool) -> PauseOutcome:
        """Stop generation in ``mode``; return how many requests were aborted."""
        ...

    async def resume(self) -> None:
        """Continue generation (kept requests continue where they stopped)."""
        ...

    async def load_weights(self, source: WeightSource) -> LoadStats:
        """Load every tensor of ``source`` into the served weights."""
        ...

    async def reset_prefix_cache(self) -> None:
        """Drop the prefix cache.  Raises :class:`~weightsync.core.errors.CacheInUse`, and
        drops nothing, when requests hold it: returning means it really happened."""
        ...

    async def weight_info(self) -> WeightInfo:
        """Names, dtypes and shapes of the served weights."""
        ...

    async def is_alive(self) -> bool:
        """Whether the engine can serve (a cheap check)."""
        ...

    async def abort_request(self, request_id: str) -> bool:
        """Abort one request; return ``False`` when no such request is in flight."""
        ...


async def cache_cleared(reset: Awaitable[object]) -> bool:
    """Whether the prefix-cache reset ``reset`` (an engine's ``reset_prefix_cache()``)
    happened: ``False`` when it raised ``CacheInUse``.  For a pause or an update, where a
    reset that did not happen is a fact to report or to tear on, not a refusal."""
    try:
        result: object = await reset
    except CacheInUse:
        return False
    return result is not False  # an engine of the older protocol says False for no reset


# Optional features.  The controller checks each one with ``isinstance`` against these
# runtime-checkable protocols (zarr's ``SupportsGetSync`` is the model), never by looking up
# method names: an engine lacking a feature gets ``NotSupported`` (501) for the routes that
# need it and keeps every other route.


@runtime_checkable
class GroupEngine(Protocol):
    """Optional: engines that can join a torch.distributed weight-update group."""

    async def init_group(self, request: InitGroupRequest) -> None: ...

    async def destroy_group(self, group_name: str) -> None: ...


@runtime_checkable
class StampingEngine(Protocol):
    """Optional: engines that stamp outputs with versions learn every committed state."""

    def observe_commit(self, snapshot: Snapshot) -> None: ...


@runtime_checkable
class RpcEngine(Protocol):
    """Optional: engines that expose an allow-list of methods through ``engine_rpc``."""

    rpc_methods: Collection[str]

    async def rpc(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...


@runtime_checkable
class HashingEngine(Protocol):
    """Optional: engines that know which weights they start with, so a worker reports a
    content digest from the start.

    ``initial_hashes`` is read once, when the controller is created: ``name -> xxh3-64 hex``
    of every served weight at start (``None`` when unknown); afterwards the controller keeps
    the map from the hashes each load reports in ``LoadStats.hashes``.
    """

    def initial_hashes(self) -> Mapping[str, str] | None: ...


@runtime_checkable
class CheckingEngine(Protocol):
    """Optional: engines that can dry-run an update.

    ``check_source`` validates a source exactly as ``load_weights`` would before its first
    write, writes nothing, and returns the hashes of the tensors it would write when the
    source declares them (a checkpoint manifest), else ``None``; it raises the 4xx refusals
    a load would.
    """

    async def check_source(self, source: WeightSource) -> Mapping[str, str] | None: ...


@runtime_checkable
class AttestingEngine(Protocol):
    """Optional: engines that hash the weights they actually serve, for ``verify_weights``."""

    async def attest(self) -> Attestation: ...


@runtime_checkable
class PrefixCacheProbe(Protocol):
    """Optional, for engines whose prefix cache a conformance test should observe."""

    async def prefix_cached(self, prompt: str) -> bool:
        """Whether ``prompt``'s prefix would be served from the cache now, with the weights
        loaded now (a prefix computed with other weights must not count)."""
        ...


# Optional features the serving edge (not the controller) uses.


@runtime_checkable
class GeneratingEngine(Protocol):
    """Optional: engines that generate; the HTTP transport then serves ``/v1/completions``
    and the conformance kit can warm a prefix cache through it."""

    async def generate(self, prompt: Any, *args: Any, **kwargs: Any) -> Any: ...


@runtime_checkable
class TrackingEngine(Protocol):
    """Optional: engines that list the ids of the requests they hold (queued, kept or
    running), so ``/health`` counts them and a shutdown aborts them."""

    def in_flight(self) -> Collection[str]: ...


@runtime_checkable
class StartingEngine(Protocol):
    """Optional: engines with work to start on the server's running event loop."""

    def start(self) -> None: ...


@runtime_checkable
class ClosingEngine(Protocol):
    """Optional: engines that release resources when the server stops."""

    async def close(self) -> None: ...


@runtime_checkable
class ParallelEngine(Protocol):
    """Optional: engines served by several workers (tensor parallelism); ``routes`` reports
    ``world_size``, 1 for an engine without it."""

    world_size: int
