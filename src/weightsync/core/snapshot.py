"""Frozen value types: versions, pause modes, snapshots and command results.

Every class is a frozen ``attrs`` class with validators, so a value that exists is a
valid value; ``attrs.evolve`` re-runs the validators on each step.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Iterable, Mapping
from typing import Any, Final, Union

import attrs

JSONValue = Any
"""A JSON value that can be written back (the caller's choice of version label): see
:func:`json_problem` for the bounds."""

MAX_JSON_DEPTH: Final = 32
"""Containers nested deeper than this are refused: replies, stamps and metrics encode the
value again, and nothing may recurse far enough to fail."""

MAX_JSON_BYTES: Final = 64 << 10
"""The largest accepted value, serialised as compact UTF-8 JSON."""


def json_problem(
    value: Any, *, max_depth: int = MAX_JSON_DEPTH, max_bytes: int = MAX_JSON_BYTES
) -> str | None:
    """Why ``value`` is not a JSON value that every reply can write back, or ``None`` if it is.

    A value is ``None``, a bool, an int, a finite float, a string that is valid UTF-8 (a
    lone surrogate such as ``"\\ud800"`` is not), a list or tuple of values, or a dict with
    such string keys; at most ``max_depth`` containers deep and ``max_bytes`` serialised.
    The walk is iterative, so no input can exhaust the stack.
    """
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if item is None or isinstance(item, (bool, int)):
            continue
        if isinstance(item, float):
            if not math.isfinite(item):
                return f"{item} is not a finite number"
            continue
        if isinstance(item, str):
            if not _utf8(item):
                return "a string is not valid UTF-8 (a lone surrogate)"
            continue
        if isinstance(item, (list, tuple, dict)):
            if depth >= max_depth:
                return f"nested more than {max_depth} levels deep"
            if isinstance(item, dict):
                for key, inner in item.items():
                    if not isinstance(key, str):
                        return f"an object key is {type(key).__name__}, not a string"
                    if not _utf8(key):
                        return "an object key is not valid UTF-8 (a lone surrogate)"
                    stack.append((inner, depth + 1))
            else:
                stack.extend((inner, depth + 1) for inner in item)
            continue
        return f"{type(item).__name__} is not a JSON type"
    size = len(json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode())
    if size > max_bytes:
        return f"{size} bytes serialised, over the limit of {max_bytes}"
    return None


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class NotJSON(ValueError):
    """A value that is not a JSON value every reply can write back; ``problem`` says why."""

    def __init__(self, name: str, problem: str) -> None:
        super().__init__(f"{name} must be a JSON value: {problem}")
        self.problem = problem


def _check_json(_inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
    problem = json_problem(value)
    if problem is not None:
        raise NotJSON(attr.name, problem)


@attrs.frozen
class _Undeclared:
    """No version was ever declared.  Distinct from ``Declared(None)`` and ``Declared("initial")``."""

    def __repr__(self) -> str:
        return "UNDECLARED"


UNDECLARED: Final = _Undeclared()


@attrs.frozen(eq=True, hash=False)
class Declared:
    """A version the caller declared; ``value`` is any JSON value, ``None`` included."""

    value: JSONValue = attrs.field(validator=_check_json)


Version = Union[_Undeclared, Declared]  # noqa: UP007


class Generation(enum.Enum):
    """Whether the engine runs requests.  ``TORN`` is paused with weights that match no version;
    ``UPDATING`` and ``UPDATING_TORN`` are paused with an update session open (the weights
    still those of the version, or matching none)."""

    RUNNING = "running"
    PAUSED = "paused"
    TORN = "torn"
    UPDATING = "updating"
    UPDATING_TORN = "updating_torn"


class PauseMode(enum.Enum):
    """vLLM's pause modes: freeze in-flight requests, drain them, or abort them."""

    KEEP = "keep"
    WAIT = "wait"
    ABORT = "abort"


@attrs.frozen(eq=True, hash=False)
class Snapshot:
    """The last committed state, as every read reports it.  Reads never wait for updates."""

    version: Version
    generation: Generation
    update_in_flight: bool = False
    commits: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    digest: str | None = None
    """The content digest of the weights held (:mod:`weightsync.core.held`), ``None`` while unknown."""
    epoch: int | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.ge(0)))
    """The fleet epoch declared with the version, ``None`` before any fleet commit."""
    version_digest: str | None = None
    """The digest the weights had when the current label was declared (``None`` when unknown)."""
    version_current: bool = False
    """Whether the declared label still describes the weights held: true from a declaration
    (``set_weight_version``, or an update that carried ``weight_version``) until the weights
    change without one — an update that omits ``weight_version`` keeps the label, as the
    route contract says, but then the label no longer describes new weights.  Always false
    while undeclared."""
    verified: bool = True
    """``False`` while some held tensor came from a stream no sender's hash checked (a bare
    per-tensor broadcast sent without ``hashes``): its bytes are whatever arrived."""
    weights: str = "resident"
    """Where the weights are: ``resident``, ``offloaded`` (restored as they were) or
    ``discarded`` (the worker holds no version's weights until an update rewrites them)."""
    kv_cache: str = "resident"
    """``resident``, or ``released`` (restored empty)."""

    @property
    def paused(self) -> bool:
        return self.generation is not Generation.RUNNING

    @property
    def torn(self) -> bool:
        """The loaded weights match no version (an update tore, or an open session wrote)."""
        return self.generation in (Generation.TORN, Generation.UPDATING_TORN)

    @property
    def weights_released(self) -> bool:
        """The weights were discarded: this worker holds no version's weights (digest ``None``)."""
        return self.weights == "discarded"

    @property
    def session_open(self) -> bool:
        return self.generation in (Generation.UPDATING, Generation.UPDATING_TORN)

    @property
    def version_declared(self) -> bool:
        return isinstance(self.version, Declared)

    @property
    def version_value(self) -> JSONValue:
        """The declared value, or ``None`` while undeclared (check ``version_declared``)."""
        return self.version.value if isinstance(self.version, Declared) else None

    def to_reply(self) -> dict[str, Any]:
        return {
            "version": self.version_value,
            "version_declared": self.version_declared,
            "paused": self.paused,
            "torn": self.torn,
            "update_in_flight": self.update_in_flight,
            "session_open": self.session_open,
            "verified": self.verified,
            "digest": self.digest,
            "epoch": self.epoch,
            "version_digest": self.version_digest,
            "version_current": self.version_current,
            "weights": self.weights,
            "kv_cache": self.kv_cache,
            "weights_released": self.weights_released,
        }


@attrs.frozen
class PauseOutcome:
    """What an engine's pause did: how many requests it aborted, whether it cleared the cache."""

    aborted: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    cache_cleared: bool = False


@attrs.frozen
class LoadStats:
    """Figures an engine reports for a completed load."""

    tensors: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    bytes: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    seconds: float = attrs.field(default=0.0, validator=attrs.validators.ge(0.0))
    files: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    extra: dict[str, Any] = attrs.field(factory=dict)
    hashes: dict[str, str] | None = attrs.field(default=None, repr=False)
    """``name -> xxh3-64 hex`` of every tensor written, as the channel hashed it while
    copying; ``None`` when some written tensor was not hashed (the digest becomes unknown)."""
    hashed_in_place: bool = False
    """Whether every one of ``hashes`` was taken from the memory the engine serves, after the
    bytes were written there and with nothing writing it since within the load (the disk
    channel reading straight into the engine's tensors).  Only then may ``verify_weights``
    with ``allow_load_digest`` report their digest without hashing the weights again."""

    def to_reply(self) -> dict[str, Any]:
        gbps = self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0
        return {
            "tensors": self.tensors,
            "bytes": self.bytes,
            "files": self.files,
            "seconds": round(self.seconds, 6),
            "gb_per_s": round(gbps, 3),
            **self.extra,
        }

    @property
    def verified(self) -> bool:
        """Whether the written bytes were checked against their source's hashes:
        ``extra["verified"]`` is ``True`` or a level at which bytes were checked (the disk
        reader's ``"tensors"`` or ``"files"``; its ``"none"``, a checkpoint without a manifest,
        is not).  An engine that reports nothing is taken at the default: verified."""
        level = self.extra.get("verified", True)
        return level is True or (isinstance(level, str) and level in VERIFIED_LEVELS)


VERIFIED_LEVELS = frozenset({"tensors", "files"})
"""The disk reader's ``verified`` levels that mean bytes were checked (``"none"`` does not)."""


@attrs.frozen(eq=True, hash=False)
class UpdateOutcome:
    """The result of a successful update, committed before it is returned."""

    snapshot: Snapshot
    declared: bool
    prefix_cache_reset: bool
    stats: LoadStats


@attrs.frozen(eq=True, hash=False)
class JournalEntry:
    """One mutating command as it was carried out: arrival number, name, and outcome code."""

    seq: int
    command: str
    outcome: str  # "ok" or the error code
    snapshot: Snapshot


@attrs.frozen
class PauseResult:
    """What a pause did, and whether the worker was paused already."""

    snapshot: Snapshot
    outcome: PauseOutcome
    was_paused: bool


@attrs.frozen(eq=True, hash=False)
class DryRunOutcome:
    """What a dry run found: the source is acceptable now, and the digest the worker would
    hold after applying it (``None`` when that cannot be known without reading the data)."""

    snapshot: Snapshot
    digest: str | None


@attrs.frozen
class Attestation:
    """Per-tensor hashes recomputed from the weights an engine actually serves.

    ``scope`` says what was hashed: ``"live_weights"`` (the served tensors themselves) or
    what weaker evidence the engine could honestly give instead."""

    hashes: dict[str, str]
    scope: str


@attrs.frozen
class Verification:
    """A recomputed digest against the one the controller recorded."""

    digest: str
    recorded_digest: str | None
    scope: str
    hashes: Mapping[str, str] | None = attrs.field(default=None, eq=False)
    """The per-tensor hashes the digest was computed from (``None`` for a load's digest
    reported again); not part of the reply."""

    @property
    def match(self) -> bool:
        return self.digest == self.recorded_digest

    def to_reply(self) -> dict[str, Any]:
        return {
            "digest": self.digest,
            "recorded_digest": self.recorded_digest,
            "scope": self.scope,
            "match": self.match,
        }


def _ints(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(values)


def specs(values: Iterable[TensorSpec]) -> tuple[TensorSpec, ...]:
    """Converter for fields holding tensor specs (keeps mypy's attrs plugin precise)."""
    return tuple(values)


@attrs.frozen
class TensorSpec:
    """One served weight: its name, torch dtype name (``bfloat16``) and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...] = attrs.field(converter=_ints)


@attrs.frozen
class WeightInfo:
    """The names, dtypes and shapes an engine serves, in its own order."""

    tensors: tuple[TensorSpec, ...] = attrs.field(converter=specs)

    def by_name(self) -> dict[str, TensorSpec]:
        return {t.name: t for t in self.tensors}

    def to_reply(self) -> dict[str, Any]:
        return {
            "names": [t.name for t in self.tensors],
            "dtypes": [t.dtype for t in self.tensors],
            "shapes": [list(t.shape) for t in self.tensors],
        }
