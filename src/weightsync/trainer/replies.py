"""The ok replies of a worker's admin routes, as typed dicts: what each
:class:`~weightsync.trainer.client.WorkerClient` method returns (the JSON object the worker
sent, ``status`` included).  Error replies never come back as values: they raise the
:mod:`weightsync.core.errors` family.  The JSON Schemas in ``weightsync.core.schemas`` are
the wire contract; these say the same for type checkers and ``help()``.
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict


class OkReply(TypedDict):
    """A route that answers only that it did what was asked."""

    status: Literal["ok"]


class StateReply(OkReply):
    """``get_weight_version``: the committed state."""

    version: Any
    """The declared version (any JSON value), ``None`` while undeclared."""
    version_declared: bool
    paused: bool
    torn: bool
    update_in_flight: bool
    digest: str | None
    """Digest of the weights held (``None`` when unknown)."""
    epoch: int | None
    version_digest: str | None
    """The digest the version was declared for."""
    version_current: bool
    """Whether the declared version still describes the weights held."""


class DeclaredReply(OkReply):
    """``set_weight_version``: the version now declared."""

    version: Any
    version_declared: bool
    digest: str | None
    epoch: int | None


class UpdateStats(TypedDict, total=False):
    """Figures of a completed load (engines may add keys, e.g. ``staged``)."""

    tensors: int
    bytes: int
    files: int
    seconds: float
    gb_per_s: float
    staged: bool


class UpdateReply(OkReply, total=False):
    """``update_weights_from_*``: a completed update (or, with ``dry_run``, its check)."""

    version: Any
    """This update's own label, ``"unknown"`` when it gave none (the declaration is kept)."""
    version_declared: bool
    prefix_cache_reset: bool
    digest: str | None
    epoch: int | None
    stats: UpdateStats
    state: StateReply
    """The worker's resulting state, as ``get_weight_version`` would report it."""
    dry_run: bool


class PauseReply(OkReply):
    """``pause_generation``."""

    mode: str
    clear_cache: bool
    aborted: int
    already_paused: bool


class FlushReply(OkReply):
    """``flush_cache``: ``flushed`` is true only if the reset really happened."""

    flushed: bool


class AliveReply(OkReply):
    """``liveness_probe``."""

    alive: bool


class ClockReply(OkReply):
    """``clock``: the worker's clock when it replied."""

    clock: float
    """Unix seconds, by the worker's clock."""


class WeightInfoReply(OkReply):
    """``weight_info``: the served weights, one list entry per tensor."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]


class VerifyReply(OkReply):
    """``verify_weights``: the digest of the weights served against the one recorded."""

    digest: str | None
    recorded_digest: str | None
    match: bool
    scope: Any


class RpcReply(OkReply):
    """``engine_rpc``: the engine method's result."""

    result: Any


class RoutesReply(OkReply):
    """``GET /engine/routes``."""

    routes: list[str]
    engine: str
    world_size: int


class SessionReply(OkReply):
    """``begin_weight_update``: the session is open until ``deadline_s`` from now."""

    session_open: bool
    deadline_s: float | None


class AbandonReply(OkReply):
    """``abort_weight_update``: the state the abandoned session left."""

    torn: bool
    paused: bool
    digest: str | None


class CapabilitiesReply(OkReply, total=False):
    """``capabilities``: what this worker speaks and supports (keys vary by engine)."""
