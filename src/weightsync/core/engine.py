"""The protocol an engine implements so the controller can drive it.

Kept small on purpose (httpx's ``BaseTransport`` is the model): seven coroutines, all
side effects of the state machine happen through them, and none of them decides
legality — the controller has already done that when it calls one.

The controller's calls into its engine: failures mapped to the error family, optional
features looked up by their protocols (a missing one is ``NotSupported``), and what the
engine's features add up to (:meth:`EngineCalls.capabilities`).

Nothing here decides legality or commits the weight state: the controller has done the
first before it calls, and does the second after (a failed load hands its ending back to
the caller, which commits it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any, Protocol, TypeVar, cast, runtime_checkable

from weightsync.core.errors import CacheInUse, EngineFailure, NotSupported, WeightSyncError
from weightsync.core.requests import InitGroupRequest
from weightsync.core.snapshot import Attestation, LoadStats, PauseMode, PauseOutcome, Snapshot, WeightInfo
from weightsync.core.sources import DistributedSource, WeightSource
from weightsync.core.worker_state import load_failure


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
class MemoryEngine(Protocol):
    """Optional: engines that release and restore their memory (colocated RL).

    ``release_memory``: ``weights`` ``"offload"`` (kept off the device, restored as they were),
    ``"discard"`` (freed) or ``None`` (kept); the KV cache too when ``kv_cache`` (and with it
    every cached prefix).  All or nothing, except that a discard that fails part-way leaves the
    weights discarded.  ``restore_memory``: offloaded weights come back as they were, discarded
    ones come back as memory holding nothing; a released KV cache comes back empty.  A load
    while weights are discarded writes into memory the engine gives them first."""

    async def release_memory(self, weights: str | None, kv_cache: bool) -> None: ...

    async def restore_memory(self, weights: bool, kv_cache: bool) -> None: ...


@runtime_checkable
class DrainingEngine(Protocol):
    """Optional: engines whose weight channels keep their worker-side state in ``load_context``,
    where ``drain(source)`` joins (and discards) the broadcasts a trainer already sends for a
    refused update and ``abandon(group_name)`` leaves a group (both block, neither raises): how
    the controller settles the refusals the engine never saw (:meth:`EngineCalls.settle`)."""

    load_context: Any


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


@runtime_checkable
class DescribedEngine(Protocol):
    """Optional: engines that say what they serve, as the peers' servers report it (vLLM's
    ``/server_info`` and ``/v1/models``, SGLang's ``/get_server_info``): the model's dtype
    (torch's name, ``bfloat16``) and the longest sequence it takes (prompt plus output)."""

    @property
    def dtype(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...


log = logging.getLogger("weightsync.controller")
T = TypeVar("T")


class EngineCalls:
    """One engine, called the way the controller calls it."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._dry_runs = asyncio.Lock()  # one dry run's check at a time, outside the queue
        self._checks: set[asyncio.Future[Any]] = set()  # the dry runs' checks under way

    async def call(self, call: Awaitable[T]) -> T:
        """Await ``call``; an exception outside the error family becomes ``EngineFailure``."""
        try:
            return await call
        except WeightSyncError:
            raise
        except Exception as exc:
            raise EngineFailure(f"engine {self.engine.name!r} failed: {exc!r}") from exc

    async def load(self, source: WeightSource, failed: Callable[[str], Awaitable[None]]) -> LoadStats:
        """Load ``source``; on failure await ``failed(ending)`` (torn or untouched:
        :func:`~weightsync.core.worker_state.load_failure` decides, the caller commits it)
        and raise the error that ending carries."""
        try:
            return await self.engine.load_weights(source)
        except BaseException as exc:
            ending, error = load_failure(exc)
            await failed(ending)
            if error is exc:
                raise
            raise error from exc

    async def settle(self, debt: WeightSource | str | None) -> None:
        """Settle what a refused update owes a trainer that posts and broadcasts at once
        (:mod:`weightsync.transports.distributed.drain`): a bare or flat stream drained, or the
        group ``debt`` names left (its stream did not parse); nothing for weightsync's packed
        stream, another source or an engine that is no :class:`DrainingEngine`.  Never raises."""
        stream = isinstance(debt, DistributedSource) and debt.bucket_bytes is None
        if not (stream or isinstance(debt, str)) or not isinstance(self.engine, DrainingEngine):
            return
        context = self.engine.load_context
        try:
            await asyncio.to_thread(context.abandon if isinstance(debt, str) else context.drain, debt)
        except Exception:
            log.exception("could not settle a refused update's stream")

    async def check_source(self, source: WeightSource) -> Mapping[str, str] | None:
        """The checking engine's hashes of ``source`` (:meth:`CheckingEngine.check_source`),
        one check at a time; ``NotSupported`` when the engine cannot check a source without
        loading it.  A check whose caller went away still holds its turn until it ends (its
        read goes on in its thread), so many checks cannot fill the threads the commands'
        engine calls run in."""
        engine = self.checking()

        async def check() -> Mapping[str, str] | None:
            async with self._dry_runs:
                return await self.call(engine.check_source(source))

        task = asyncio.ensure_future(check())
        self._checks.add(task)  # kept alive even if its caller goes away
        task.add_done_callback(self._checked)
        return await asyncio.shield(task)

    def _checked(self, task: asyncio.Future[Mapping[str, str] | None]) -> None:
        """A check ended: forget it, and take its outcome (its caller may be gone)."""
        self._checks.discard(task)
        if not task.cancelled():
            task.exception()

    async def reset_cache(self) -> None:
        """Reset the prefix cache; ``CacheInUse`` (409 ``cache_in_use``) when it did not happen.

        An engine written against the older protocol returns ``False`` for a reset that did
        not happen; that is taken at its word, never as a reset."""
        result: object = await self.call(self.engine.reset_prefix_cache())
        if result is False:
            raise CacheInUse(
                f"engine {self.engine.name!r} returned False from reset_prefix_cache(): the prefix "
                "cache was not reset (engines now raise CacheInUse for this)"
            )

    async def cleared(self) -> bool:
        """Whether a prefix-cache reset happened (:func:`~weightsync.core.engine.cache_cleared`)."""
        return await cache_cleared(self.reset_cache())

    async def cleared_or_logged(self) -> bool:
        """:meth:`cleared`, with any other failure of the reset logged and reported as no
        reset (an update then tears rather than commit weights beside a stale cache)."""
        try:
            return await self.cleared()
        except Exception:
            log.exception("prefix cache reset failed")
            return False

    async def pause_torn(self) -> None:
        """Stop a running engine whose weights match no version (torn implies paused)."""
        try:
            await self.engine.pause(PauseMode.ABORT, False)
        except Exception:
            log.exception("could not pause the engine while marking it torn")

    def group(self) -> GroupEngine:
        """The engine as a :class:`GroupEngine`; ``NotSupported`` when it is not one."""
        return cast(GroupEngine, self._able(GroupEngine, "does not support weight-update groups"))

    def checking(self) -> CheckingEngine:
        """The engine as a :class:`CheckingEngine`; ``NotSupported`` when it is not one."""
        return cast(CheckingEngine, self._able(CheckingEngine, "cannot dry-run an update"))

    def memory(self) -> MemoryEngine:
        """The engine as a :class:`MemoryEngine`; ``NotSupported`` when it is not one."""
        return cast(MemoryEngine, self._able(MemoryEngine, "cannot release its memory"))

    def attesting(self) -> AttestingEngine:
        """The engine as an :class:`AttestingEngine`; ``NotSupported`` when it is not one."""
        return cast(AttestingEngine, self._able(AttestingEngine, "cannot attest its weights"))

    def _able(self, capability: Any, lacking: str) -> Any:
        """The engine, when it is a ``capability`` (a checked protocol); else ``NotSupported``
        (``engine <name> <lacking>``)."""
        if not isinstance(self.engine, capability):
            raise NotSupported(f"engine {self.engine.name!r} {lacking}")
        return self.engine

    @property
    def rpc_methods(self) -> tuple[str, ...]:
        """The engine's allow-listed rpc methods (none for an engine without rpc)."""
        return tuple(self.engine.rpc_methods) if isinstance(self.engine, RpcEngine) else ()

    async def rpc(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Call the allow-listed engine method ``method``; ``NotSupported`` for any other."""
        engine = self.engine
        if not isinstance(engine, RpcEngine) or method not in engine.rpc_methods:
            raise NotSupported(f"engine {engine.name!r} has no rpc method {method!r}")
        return await self.call(engine.rpc(method, args, kwargs))

    def capabilities(
        self, *, dialects: tuple[str, ...], digests: bool, session_deadline_s: float
    ) -> dict[str, Any]:
        """What a worker on this engine speaks and supports: the ``dialects`` its server
        answers, the weight channels, torch.distributed backends and streams, pause modes,
        whether ``digests`` are reported, dry runs and verification, the engine, its world
        size and the update session's deadline."""
        engine = self.engine
        groups = isinstance(engine, GroupEngine)
        return {
            "dialects": list(dialects),
            "engine": engine.name,
            "world_size": int(engine.world_size) if isinstance(engine, ParallelEngine) else 1,
            "channels": ["disk", *(["distributed"] if groups else []), "tensor"],
            "backends": ["gloo", "nccl"] if groups else [],
            "streams": ["packed", "per_tensor", "flat"] if groups else [],
            "pause_modes": [m.value for m in PauseMode],
            "digests": digests,
            "dry_run": isinstance(engine, CheckingEngine),
            "verify_weights": isinstance(engine, AttestingEngine),
            "memory_release": isinstance(engine, MemoryEngine),
            "session_deadline_s": session_deadline_s,
            "vllm_weight_transfer": ["weightsync", "nccl"] if groups else [],
        }
