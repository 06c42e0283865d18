"""The controller's calls into its engine: failures mapped to the error family, optional
features looked up by their protocols (a missing one is ``NotSupported``), and what the
engine's features add up to (:meth:`EngineCalls.capabilities`).

Nothing here decides legality or commits the weight state: the controller has done the
first before it calls, and does the second after (a failed load hands its ending back to
the caller, which commits it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from weightsync.core.engine import (
    AttestingEngine,
    CheckingEngine,
    Engine,
    GroupEngine,
    ParallelEngine,
    RpcEngine,
    cache_cleared,
)
from weightsync.core.errors import CacheInUse, EngineFailure, NotSupported, WeightSyncError
from weightsync.core.snapshot import LoadStats, PauseMode
from weightsync.core.sources import WeightSource
from weightsync.core.worker_state import load_failure

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
        if not isinstance(self.engine, GroupEngine):
            raise NotSupported(f"engine {self.engine.name!r} does not support weight-update groups")
        return self.engine

    def checking(self) -> CheckingEngine:
        """The engine as a :class:`CheckingEngine`; ``NotSupported`` when it is not one."""
        if not isinstance(self.engine, CheckingEngine):
            raise NotSupported(f"engine {self.engine.name!r} cannot dry-run an update")
        return self.engine

    def attesting(self) -> AttestingEngine:
        """The engine as an :class:`AttestingEngine`; ``NotSupported`` when it is not one."""
        if not isinstance(self.engine, AttestingEngine):
            raise NotSupported(f"engine {self.engine.name!r} cannot attest its weights")
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
            "session_deadline_s": session_deadline_s,
            "vllm_weight_transfer": ["weightsync", "nccl"] if groups else [],
        }
