"""A transaction's working state as frozen values, each with a versioned JSON form.

The journal stores these and nothing else: :class:`TransactionSpec` (what the transaction
is: version, policy, quorum, batches, the epoch the journal issued, and per worker a
:class:`WorkerRecord` with the source it loads and what it :class:`Held` before),
:class:`~weightsync.fleet._decide.Progress` (where the transaction is) and, per worker, the
:class:`CommittedRow` of its last fleet commit.  ``from_json`` refuses a form it does not
know with ``InvalidRequest`` (``bad_journal``): a journal from another release, or damaged,
is never half-read.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Final

import attrs

from weightsync.core.errors import InvalidRequest

SCHEMA: Final = 2
"""The version of every JSON form in this module (and of the journal that stores them)."""

POLICIES: Final = ("rollback", "fence")
PAUSE_MODES: Final = ("keep", "wait", "abort")
KINDS: Final = ("disk", "push", "plan", "delta")

Kind = type | tuple[type, ...]
_NOT_TEXT: Final = object()


def bad_journal(message: str) -> InvalidRequest:
    return InvalidRequest(message, code="bad_journal")


def _field(data: Mapping[str, Any], key: str, kind: Kind, what: str) -> Any:
    if key not in data:
        raise bad_journal(f"{what} has no {key!r}")
    value = data[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _kinds(kind)):
        raise bad_journal(f"{what}.{key} is {type(value).__name__}, not {kind}")
    return value


def _fields(data: Mapping[str, Any], kinds: Mapping[str, Kind], what: str) -> dict[str, Any]:
    """Each field of ``kinds`` read from ``data`` and checked, in that order (the first bad
    one is the error)."""
    return {key: _field(data, key, kind, what) for key, kind in kinds.items()}


def _kinds(kind: Kind) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _schema(data: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise bad_journal(f"{what} is not a JSON object")
    if data.get("schema") != SCHEMA:
        raise bad_journal(f"{what} has schema {data.get('schema')!r}; this release reads schema {SCHEMA}")
    return data


def _moment(value: Any) -> None:
    """A spec's ``not_after``: ``None``, or a finite number of unix seconds above 0."""
    if value is not None and not (type(value) in (int, float) and 0 < value < math.inf):
        raise ValueError(f"not_after must be unix seconds (a finite number above 0), got {value!r}")


_OPT_INT = (int, type(None))
_OPT_STR = (str, type(None))

_HELD: Final[Mapping[str, Kind]] = {
    "declared": bool, "epoch": _OPT_INT, "digest": _OPT_STR, "paused": bool, "torn": bool, "source": _OPT_STR,
}  # fmt: skip
_WORKER: Final[Mapping[str, Kind]] = {"url": str, "source": _OPT_STR}
_SPEC: Final[Mapping[str, Kind]] = {
    "policy": str, "min_workers": int, "max_unavailable": int, "pause_mode": str, "kind": str,
    "expected_digest": _OPT_STR, "epoch": _OPT_INT, "rollback_epoch": _OPT_INT,
}  # fmt: skip


@attrs.frozen
class Held:
    """What a worker held when the transaction found it: the state a rollback restores.

    ``source`` is where those weights can be loaded from again (the journal's last commit,
    or the caller's initial source), ``None`` when nothing is known.
    """

    version: Any = None
    declared: bool = False
    epoch: int | None = None
    digest: str | None = None
    paused: bool = False
    torn: bool = False
    source: str | None = None

    @classmethod
    def from_status(cls, reply: Mapping[str, Any], source: str | None) -> Held:
        """From a ``get_weight_version`` reply (anything unexpected reads as unknown)."""
        epoch = reply.get("epoch")
        digest = reply.get("digest")
        return cls(
            version=reply.get("version"),
            declared=reply.get("version_declared") is True,
            epoch=epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None,
            digest=digest if isinstance(digest, str) else None,
            paused=reply.get("paused") is True,
            torn=reply.get("torn") is True,
            source=source,
        )

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> Held:
        if not isinstance(data, Mapping):
            raise bad_journal("a worker's previous state is not a JSON object")
        return cls(version=data.get("version"), **_fields(data, _HELD, "held"))


@attrs.frozen
class WorkerRecord:
    """One worker of a transaction: its URL, the source it loads (a path as the worker sees
    it; ``None`` for a push) and what it held before (``None`` until prepared)."""

    url: str
    source: str | None = None
    previous: Held | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "source": self.source,
            "previous": None if self.previous is None else self.previous.to_json(),
        }

    @classmethod
    def from_json(cls, data: Any) -> WorkerRecord:
        if not isinstance(data, Mapping):
            raise bad_journal("a worker record is not a JSON object")
        prev = data.get("previous")
        fields = _fields(data, _WORKER, "worker")
        return cls(**fields, previous=None if prev is None else Held.from_json(prev))


def _paths(value: Mapping[str, str]) -> dict[str, str]:
    return dict(value)


@attrs.frozen
class DeltaRecord:
    """A delta transaction's delta: the base and target it joins (each a version and the
    digest ``get_weight_version`` reports) and the delta checkpoint's path per worker (as
    that worker sees it).  A committed one is a link in the chain catch-up follows."""

    base_version: Any
    base_digest: str
    target_version: Any
    target_digest: str
    paths: Mapping[str, str] = attrs.field(converter=_paths)

    def path_for(self, url: str) -> str:
        """The path ``url`` reads: its own, else the one most workers read (a shared disk)."""
        if url in self.paths:
            return self.paths[url]
        values = sorted(self.paths.values())
        return max(values, key=values.count)

    def to_json(self) -> dict[str, Any]:
        return {
            "base": {"version": self.base_version, "digest": self.base_digest},
            "target": {"version": self.target_version, "digest": self.target_digest},
            "paths": dict(self.paths),
        }

    @classmethod
    def from_json(cls, data: Any) -> DeltaRecord:
        if not isinstance(data, Mapping):
            raise bad_journal("a transaction's delta is not a JSON object")
        base, target = (_field(data, k, Mapping, "delta") for k in ("base", "target"))
        paths = _field(data, "paths", Mapping, "delta")
        if not paths or not all(isinstance(k, str) and isinstance(v, str) for k, v in paths.items()):
            raise bad_journal("a transaction's delta paths are not a map of worker to path")
        return cls(
            base.get("version"),
            _field(base, "digest", str, "delta.base"),
            target.get("version"),
            _field(target, "digest", str, "delta.target"),
            paths,
        )


def _records(value: Any) -> tuple[WorkerRecord, ...]:
    return tuple(value)


def _one_to_every_worker(name: str) -> Callable[[TransactionSpec, Any, int], None]:
    """A validator: the field ``name`` counts workers, from one to every one of them."""

    def check(spec: TransactionSpec, _: Any, value: int) -> None:
        if not 1 <= value <= len(spec.workers):
            raise InvalidRequest(
                f"{name} must be between 1 and {len(spec.workers)}, got {value}", code="invalid_value"
            )

    return check


@attrs.frozen
class TransactionSpec:
    """What one transaction is.  ``evolve`` re-runs the validators, so every step is checked.

    ``epoch`` is the epoch the journal issued for this commit and ``rollback_epoch`` the one
    it issued for a rollback (both ``None`` until issued); ``expected_digest`` the digest
    every worker must hold before it may commit; ``not_after`` the expiry (unix seconds, the
    coordinator's clock; each worker was sent it in its own) of the commits sent so far
    (``None`` before any: a spec an older release wrote has none), which a recovery waits out,
    plus :data:`~weightsync.fleet.clocks.CLOCK_SKEW_S`, before it undoes them.
    """

    version: Any
    workers: tuple[WorkerRecord, ...] = attrs.field(converter=_records)
    policy: str = attrs.field(default="rollback", validator=attrs.validators.in_(POLICIES))
    min_workers: int = attrs.field(default=1, validator=_one_to_every_worker("min_workers"))
    max_unavailable: int = attrs.field(default=1, validator=_one_to_every_worker("max_unavailable"))
    pause_mode: str = attrs.field(default="keep", validator=attrs.validators.in_(PAUSE_MODES))
    kind: str = attrs.field(default="disk", validator=attrs.validators.in_(KINDS))
    expected_digest: str | None = None
    epoch: int | None = None
    rollback_epoch: int | None = None
    delta: DeltaRecord | None = attrs.field(default=None)
    not_after: float | None = attrs.field(default=None, validator=lambda _, __, v: _moment(v))

    @workers.validator
    def _unique(self, _: Any, value: tuple[WorkerRecord, ...]) -> None:
        urls = [w.url for w in value]
        if not urls:
            raise InvalidRequest("a fleet needs at least one worker", code="no_workers")
        if len(set(urls)) != len(urls):
            raise InvalidRequest("a worker URL is named twice", code="duplicate_worker")

    @delta.validator
    def _delta_kind(self, _: Any, value: DeltaRecord | None) -> None:
        if (value is None) != (self.kind != "delta"):
            raise InvalidRequest("a delta transaction, and only one, names its delta", code="invalid_value")

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(w.url for w in self.workers)

    def worker(self, url: str) -> WorkerRecord:
        for w in self.workers:
            if w.url == url:
                return w
        raise KeyError(url)

    def with_worker(self, record: WorkerRecord) -> TransactionSpec:
        return attrs.evolve(self, workers=tuple(record if w.url == record.url else w for w in self.workers))

    def to_json(self) -> dict[str, Any]:
        out = attrs.asdict(self, recurse=False)
        out["workers"] = [w.to_json() for w in self.workers]
        out["delta"] = None if self.delta is None else self.delta.to_json()
        return {"schema": SCHEMA, **out}

    @classmethod
    def from_json(cls, data: Any) -> TransactionSpec:
        """Raises ``InvalidRequest`` (``bad_journal``) for any other form or schema."""
        d = _schema(data, "a transaction spec")
        workers = _field(d, "workers", list, "spec")
        try:
            records = tuple(WorkerRecord.from_json(x) for x in workers)
            delta = None if d.get("delta") is None else DeltaRecord.from_json(d["delta"])
            fields = _fields(d, _SPEC, "spec")
            return cls(
                version=d.get("version"), workers=records, **fields, delta=delta, not_after=d.get("not_after")
            )
        except (ValueError, TypeError, InvalidRequest) as exc:
            if isinstance(exc, InvalidRequest) and exc.code == "bad_journal":
                raise
            raise bad_journal(f"a transaction spec does not validate: {exc}") from None


@attrs.frozen
class CommittedRow:
    """A worker's last fleet commit (``source`` is what a rollback reloads)."""

    source: str | None
    version: Any
    epoch: int
    digest: str | None

    @classmethod
    def from_columns(cls, worker: Any, source: Any, version: Any, epoch: Any, digest: Any) -> CommittedRow:
        """A ``committed`` table row, each column checked (a source and digest that are text or
        null, a version that is strict JSON, an epoch that is an integer from 1 to 2^63-1).

        Raises ``InvalidRequest`` (``bad_journal``) naming the worker for any other row."""
        from weightsync.core.snapshot import json_problem
        from weightsync.core.validation import strict_loads

        what = f"the committed row of {str(worker)[:200]!r}"
        if not isinstance(worker, str):
            raise bad_journal(f"a committed row's worker is not text ({type(worker).__name__})")
        for name, value in (("source", source), ("digest", digest)):
            if value is not None and not isinstance(value, str):
                raise bad_journal(f"{what} has a {name} that is not text ({type(value).__name__})")
        if type(epoch) is not int or not 1 <= epoch < 2**63:
            raise bad_journal(
                f"{what} has an epoch that is not an integer from 1 to 2^63-1: {str(epoch)[:60]!r}"
            )
        try:
            value = strict_loads(version, finite=True) if isinstance(version, str) else _NOT_TEXT
        except (ValueError, RecursionError):
            value = _NOT_TEXT
        if value is _NOT_TEXT or json_problem(value) is not None:
            raise bad_journal(f"{what} has a version that is not a JSON value: {str(version)[:60]!r}")
        return cls(source, value, epoch, digest)

    def get(self, key: str, default: Any = None) -> Any:
        """Mapping-style read (``"path"`` is ``source``), for callers that read rows as dicts."""
        name = "source" if key == "path" else key
        return getattr(self, name, default) if name in ("source", "version", "epoch", "digest") else default

    def __getitem__(self, key: str) -> Any:
        if key not in ("path", "source", "version", "epoch", "digest"):
            raise KeyError(key)
        return self.get(key)
