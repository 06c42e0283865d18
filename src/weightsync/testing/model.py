"""A pure model of what a worker must report, written without the state table.

The stateful tests compare the real thing against this; because it is written
independently (plain ``if`` statements, not the table), a typo in either shows up.
"""

from __future__ import annotations

from typing import Any

import attrs


class _Sentinel:
    """A named marker whose repr reads well in hypothesis' falsifying examples."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name


_UNDECLARED: Any = _Sentinel("UNDECLARED")

OMITTED: Any = _Sentinel("OMITTED")
"""Pass as ``version`` to :meth:`PureModel.update` when the request omits ``weight_version``."""


@attrs.define
class Session:
    """An open update session: what it wrote (the last tag) and the version it carries."""

    wrote: str | None = None
    version: Any = OMITTED


@attrs.define(repr=False)
class PureModel:
    """Expected state: version label, paused, torn, and which weights are loaded."""

    version: Any = _UNDECLARED
    paused: bool = False
    torn: bool = False
    weights: str | None = "init"  # tag of the loaded weights; None when torn
    session: Session | None = None  # the open update session
    memory: str = "resident"  # where the weights are: resident, offloaded or discarded
    kv_cache: str = "resident"  # or released

    @classmethod
    def from_reply(cls, reply: dict[str, Any]) -> PureModel:
        """The model of a worker in the state ``get_weight_version`` reported."""
        version = reply["version"] if reply["version_declared"] else _UNDECLARED
        return cls(version, reply["paused"], reply["torn"], None if reply["torn"] else "init")

    @property
    def declared(self) -> bool:
        return self.version is not _UNDECLARED

    def __repr__(self) -> str:
        # A declared null must not read like "never declared".
        version = f"declared({self.version!r})" if self.declared else "undeclared"
        return (
            f"PureModel(version={version}, paused={self.paused}, torn={self.torn}, weights={self.weights!r}, "
            f"session={self.session!r})"
        )

    def reply(self) -> dict[str, Any]:
        return {
            "version": self.version if self.declared else None,
            "version_declared": self.declared,
            "paused": self.paused,
            "torn": self.torn,
            "update_in_flight": False,
            "session_open": self.session is not None,
            "weights": self.memory,
            "kv_cache": self.kv_cache,
            "weights_released": self.memory == "discarded",
        }

    # Each method returns the expected error code, or None when the command succeeds.

    def declare(self, value: Any) -> str | None:
        if self.session is not None:
            return "session_open"
        self.version = value
        return None

    def pause(self) -> str | None:
        self.paused = True
        return None

    def resume(self) -> str | None:
        if self.session is not None:
            return "session_open"
        if self.torn:
            return "weights_torn"
        refused = {"discarded": "weights_released", "offloaded": "weights_offloaded"}.get(self.memory)
        if refused or self.kv_cache == "released":
            return refused or "kv_released"
        self.paused = False
        return None

    # Memory release (paused or torn) and restore (always legal).

    def release(self, weights: str | None, kv_cache: bool) -> str | None:
        if self.session is not None:
            return "session_open"
        if not self.paused:
            return "not_paused"
        if weights == "discard" or (weights == "offload" and self.memory == "resident"):
            self.memory = "discarded" if weights == "discard" else "offloaded"
        self.kv_cache = "released" if kv_cache else self.kv_cache
        return None

    def restore(self, weights: bool, kv_cache: bool) -> str | None:
        self.memory = "resident" if weights and self.memory == "offloaded" else self.memory
        self.kv_cache = "resident" if kv_cache else self.kv_cache
        return None

    def update(
        self,
        kind: str,
        tag: str,
        version: Any,
        allow_unpaused: bool,
        reset: bool,
        invalid_code: str = "weights_mismatch",
        unpaused_tear_code: str | None = None,
    ) -> str | None:
        if allow_unpaused and reset:
            return "conflicting_options"
        if self.session is not None:
            return "session_open"
        if not self.paused and not allow_unpaused:
            return "not_paused"
        if self.memory == "offloaded":
            return "weights_offloaded"
        if kind == "invalid":
            return invalid_code
        if kind == "tear" and not self.paused and unpaused_tear_code is not None:
            return unpaused_tear_code  # a staged load failed: the served weights never changed
        if kind == "tear":
            self.paused, self.torn, self.weights = True, True, None
            return "weights_torn"
        self.torn, self.memory = False, "resident" if self.memory == "discarded" else self.memory
        self.weights = tag
        if version is not OMITTED:
            self.version = version
        return None

    # An update session (begin / update with session=true / end / abort).

    def begin(self) -> str | None:
        if self.session is not None:
            return "session_open"
        if not self.paused:
            return "not_paused"
        if self.memory == "offloaded":
            return "weights_offloaded"
        self.session = Session()
        return None

    def session_update(
        self, kind: str, tag: str, version: Any, invalid_code: str = "weights_mismatch"
    ) -> str | None:
        if self.session is None:
            return "no_session"
        if kind == "invalid":
            return invalid_code
        if kind == "tear":  # the session ends as a failed update does
            self.session = None
            self.torn, self.weights = True, None
            return "weights_torn"
        self.session.wrote = tag
        if version is not OMITTED:
            self.session.version = version
        self.torn, self.weights = True, None  # in flux until the finish
        return None

    def finish(self, version: Any) -> str | None:
        session = self.session
        if session is None:
            return "no_session"
        if session.wrote is None and self.torn:
            return "weights_torn"  # began torn and wrote nothing
        self.session = None
        if session.wrote is not None:
            self.torn, self.weights = False, session.wrote
            self.memory = "resident" if self.memory == "discarded" else self.memory
        version = version if version is not OMITTED else session.version
        if version is not OMITTED:
            self.version = version
        return None

    def abandon(self) -> str | None:
        if self.session is None:
            return "no_session"
        self.session = None  # torn stays as it is: torn if it wrote or began torn
        return None
