"""A scriptable in-memory engine for unit tests of the core and of transports.

Its "weights" are one label per tensor; a disk source's ``model_path`` scripts the load:

* ``ok:<tag>`` loads weights labelled ``<tag>``;
* ``invalid`` fails validation before writing (a 400, nothing changes);
* ``tear`` writes half the tensors, then fails (the worker becomes torn).

``reset_results`` scripts what ``reset_prefix_cache`` answers, and ``load_delay`` keeps a
load in flight long enough for concurrency tests.  Every call is logged in ``calls``.

Its prefix cache is honest and observable: :meth:`ScriptableEngine.generate` caches a
prompt's prefix under the weights that computed it, and :meth:`prefix_cached` (the probe of
:class:`weightsync.testing.PrefixCacheProbe`) says whether a prompt would be served from it
now, which is never after the weights changed or the cache was reset.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import deque
from typing import Any

from weightsync.core.errors import CacheInUse, InvalidRequest, LoadFailed, NotSupported
from weightsync.core.snapshot import LoadStats, PauseMode, PauseOutcome, TensorSpec, WeightInfo
from weightsync.core.sources import DiskSource, WeightSource

NAMES = ("embed", "layer0", "layer1", "head")


class ScriptableEngine:
    """Implements :class:`weightsync.core.Engine` in memory."""

    name = "fake"
    rpc_methods = ("weight_labels",)

    def __init__(self, *, tag: str = "init", load_delay: float = 0.0) -> None:
        self.weights: dict[str, str] = dict.fromkeys(NAMES, tag)
        self.running = True
        self.load_delay = load_delay
        self.reset_results: deque[bool] = deque()
        self.calls: list[tuple[str, Any]] = []
        self.requests: set[str] = set()  # ids of requests in flight (a test adds them)
        self.prefix_cache: dict[str, tuple[str, ...]] = {}  # prompt -> weights that computed it
        self.offloaded: dict[str, str] | None = None  # the weights moved out by release_memory

    # ---- test helpers
    def fingerprint(self) -> tuple[str, ...]:
        return tuple(self.weights[n] for n in NAMES)

    @staticmethod
    def fingerprint_for(tag: str) -> tuple[str, ...]:
        return (tag,) * len(NAMES)

    async def generate(self, prompt: str) -> str:
        """Serve ``prompt``: its prefix is cached under the current weights."""
        self.calls.append(("generate", prompt))
        self.prefix_cache[prompt] = self.fingerprint()
        return f"{prompt}:{'/'.join(self.fingerprint())}"

    async def prefix_cached(self, prompt: str) -> bool:
        """Whether ``prompt``'s prefix would be served from the cache now."""
        return self.prefix_cache.get(prompt) == self.fingerprint()

    # ---- Engine protocol
    async def pause(self, mode: PauseMode, clear_cache: bool) -> PauseOutcome:
        self.calls.append(("pause", mode))
        self.running = False
        if clear_cache:
            self.prefix_cache.clear()
        aborted = len(self.requests) if mode is PauseMode.ABORT else 0
        if mode is PauseMode.ABORT:
            self.requests.clear()
        return PauseOutcome(aborted=aborted, cache_cleared=clear_cache)

    async def resume(self) -> None:
        self.calls.append(("resume", None))
        self.running = True

    async def load_weights(self, source: WeightSource) -> LoadStats:
        self.calls.append(("load_weights", source))
        if not isinstance(source, DiskSource):
            raise NotSupported("the fake engine loads only scripted disk sources")
        path = source.model_path
        if self.load_delay:
            await asyncio.sleep(self.load_delay)
        if path == "invalid":
            raise LoadFailed(
                "refused", wrote=False, cause=InvalidRequest("scripted mismatch", code="weights_mismatch")
            )
        if path == "tear":
            for n in NAMES[: len(NAMES) // 2]:
                self.weights[n] = "torn"
            raise LoadFailed("scripted failure after writing", wrote=True)
        if not path.startswith("ok:"):
            raise LoadFailed(
                f"no such source {path!r}",
                wrote=False,
                cause=InvalidRequest("bad path", code="path_not_found"),
            )
        for n in NAMES:
            self.weights[n] = path[3:]
        tag_hash = hashlib.blake2b(path[3:].encode(), digest_size=8).hexdigest()
        hashes = dict.fromkeys(NAMES, tag_hash)
        return LoadStats(tensors=len(NAMES), bytes=16 * len(NAMES), seconds=self.load_delay, hashes=hashes)

    async def release_memory(self, weights: str | None, kv_cache: bool) -> None:
        """Offloaded weights are kept aside and served as ``"released"``; discarded ones are gone."""
        self.calls.append(("release_memory", (weights, kv_cache)))
        if weights == "offload" and self.offloaded is None and "released" not in self.weights.values():
            self.offloaded = dict(self.weights)
        if weights is not None:
            self.weights = dict.fromkeys(NAMES, "released")
        if weights == "discard":
            self.offloaded = None
        if kv_cache:
            self.prefix_cache.clear()

    async def restore_memory(self, weights: bool, kv_cache: bool) -> None:
        self.calls.append(("restore_memory", (weights, kv_cache)))
        if weights and self.offloaded is not None:
            self.weights, self.offloaded = self.offloaded, None

    async def reset_prefix_cache(self) -> None:
        self.calls.append(("reset_prefix_cache", None))
        if not (self.reset_results.popleft() if self.reset_results else True):
            raise CacheInUse()
        self.prefix_cache.clear()

    async def weight_info(self) -> WeightInfo:
        return WeightInfo([TensorSpec(n, "float32", (4,)) for n in NAMES])

    async def is_alive(self) -> bool:
        return True

    async def abort_request(self, request_id: str) -> bool:
        self.calls.append(("abort_request", request_id))
        if request_id in self.requests:
            self.requests.discard(request_id)
            return True
        return False

    def in_flight(self) -> list[str]:
        """The ids of the requests in flight (:class:`weightsync.core.engine.TrackingEngine`)."""
        return sorted(self.requests)

    async def rpc(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.calls.append(("rpc", method))
        return dict(self.weights)
