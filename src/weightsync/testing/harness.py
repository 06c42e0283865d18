"""How the conformance state machine (:mod:`weightsync.testing.stateful`) reaches a worker: a
:class:`Harness` sends admin routes and reads the weights; :class:`ControllerHarness` drives a
controller in process through the route registry (the HTTP code path without the HTTP).
Subclass :class:`Harness` to run the machine against your engine or transport.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Hashable
from typing import Any

from weightsync.core.controller import Controller
from weightsync.core.engine import GeneratingEngine, MemoryEngine, PrefixCacheProbe
from weightsync.core.errors import WeightSyncError
from weightsync.core.routes import dispatch
from weightsync.testing.fake import ScriptableEngine

UPDATE_KINDS = ("ok", "invalid", "tear")
PROMPTS = ("alpha", "beta", "gamma")


class Harness(abc.ABC):
    """How the state machine reaches one worker.  One instance per hypothesis example."""

    invalid_code: str = "weights_mismatch"
    """The error code the worker answers to an ``invalid`` update."""

    update_kinds: tuple[str, ...] = UPDATE_KINDS
    """The update kinds this harness can produce (drop ``tear`` if it cannot inject one)."""

    unpaused_tear_code: str | None = None
    """For an engine that stages ``allow_unpaused`` loads (writes them into a copy of the
    weights and swaps it in only once complete, as the reference engine does): the error
    code a ``tear`` answers on a running worker, which then fails and changes nothing.
    ``None``: a tear tears whatever the generation state."""

    @abc.abstractmethod
    def call(self, route: str, body: Any) -> tuple[int, dict[str, Any]]:
        """Send ``body`` to admin ``route``; return the HTTP-style status and the reply."""

    @abc.abstractmethod
    def update_request(self, kind: str, tag: str) -> tuple[str, dict[str, Any]]:
        """Route and source fields of an update of ``kind``: ``ok`` (loads weights ``tag``),
        ``invalid`` (refused before writing, code ``weights_mismatch``) or ``tear``
        (fails after writing began)."""

    @abc.abstractmethod
    def fingerprint(self) -> Hashable:
        """A value that changes whenever the served weights change."""

    def fingerprint_for(self, tag: str) -> Hashable | None:
        """The fingerprint after an ``ok`` update with ``tag``, or ``None`` if unknown."""
        return None

    def engine_calls(self) -> int | None:
        """How many engine calls were made so far, or ``None`` if the harness cannot see."""
        return None

    observes_prefix_cache: bool = False
    """Set when :meth:`warm_cache` and :meth:`prefix_cached` are implemented."""

    releases_memory: bool = False
    """Set when the engine releases memory (``release_memory`` / ``resume_memory``)."""

    def warm_cache(self, prompt: str) -> None:
        """Generate from ``prompt`` (while running) so that its prefix is cached."""
        raise NotImplementedError

    def prefix_cached(self, prompt: str) -> bool:
        """Whether ``prompt``'s prefix would be served from the worker's cache now."""
        raise NotImplementedError

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the worker."""


class ControllerHarness(Harness):
    """Drives a :class:`Controller` in process through :func:`dispatch` (the HTTP code path)."""

    def __init__(self, engine: Any | None = None) -> None:
        self.engine = engine if engine is not None else ScriptableEngine()
        self.loop = asyncio.new_event_loop()
        self.controller = Controller(self.engine)
        # The probe is the engine's; warming needs a ``generate(prompt)`` coroutine.
        self.observes_prefix_cache = isinstance(self.engine, PrefixCacheProbe) and isinstance(
            self.engine, GeneratingEngine
        )
        self.releases_memory = isinstance(self.engine, MemoryEngine)

    def warm_cache(self, prompt: str) -> None:
        self.loop.run_until_complete(self.engine.generate(prompt))

    def prefix_cached(self, prompt: str) -> bool:
        return bool(self.loop.run_until_complete(self.engine.prefix_cached(prompt)))

    def call(self, route: str, body: Any) -> tuple[int, dict[str, Any]]:
        try:
            return 200, self.loop.run_until_complete(dispatch(self.controller, route, body))
        except WeightSyncError as exc:
            return exc.http_status, exc.to_reply()

    def update_request(self, kind: str, tag: str) -> tuple[str, dict[str, Any]]:
        path = {"ok": f"ok:{tag}", "invalid": "invalid", "tear": "tear"}[kind]
        return "update_weights_from_disk", {"model_path": path}

    def fingerprint(self) -> Hashable:
        return self.engine.fingerprint()  # type: ignore[no-any-return]

    def fingerprint_for(self, tag: str) -> Hashable:
        return self.engine.fingerprint_for(tag)  # type: ignore[no-any-return]

    def engine_calls(self) -> int:
        return len(self.engine.calls)

    def close(self) -> None:
        self.loop.close()
