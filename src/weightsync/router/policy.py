"""Freshness policies: which committed weights a completion may be served from.

A caller bounds freshness per request, in the body (``min_weight_epoch``, ``max_staleness``,
``weight_version``) or in the ``x-weightsync-version-policy`` header (``any``, ``latest``,
``min-epoch:N``, ``max-staleness:K``); ``weightsync router --version-policy`` sets the
default, used when a request says nothing.  When both the header and body fields are given,
every bound applies.  Staleness counts fleet epochs behind the newest committed epoch, so
``latest`` is ``max-staleness:0``.

Everything here is pure: parsing is strict (a bad policy is a 400 ``invalid_policy``) and
:func:`choose` picks a worker from plain values.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs

from weightsync.core.errors import InvalidRequest
from weightsync.core.requests import MAX_EPOCH
from weightsync.core.validation import any_json, integer
from weightsync.router._state import Label, canonical

HEADER: Final = "x-weightsync-version-policy"
BODY_FIELDS: Final = ("min_weight_epoch", "max_staleness", "weight_version")
_UNSET: Final[Any] = object()
_FORM = re.compile(r"(any|latest|min-epoch:(\d{1,19})|max-staleness:(\d{1,19}))")


@attrs.frozen
class Policy:
    """Bounds on the weights a request may be served from; all ``None``: any committed weights."""

    min_epoch: int | None = None
    max_staleness: int | None = None
    version: Any = _UNSET  # an exact version (any JSON value, null included), or unset

    @property
    def has_version(self) -> bool:
        return self.version is not _UNSET

    @property
    def bounded(self) -> bool:
        return self.min_epoch is not None or self.max_staleness is not None or self.has_version

    def also(self, other: Policy) -> Policy:
        """Both policies' bounds (the tighter one where both bound the same thing)."""
        return Policy(
            _tighter(self.min_epoch, other.min_epoch, max),
            _tighter(self.max_staleness, other.max_staleness, min),
            other.version if other.has_version else self.version,
        )

    def allows(self, label: Label, newest_epoch: int) -> bool:
        """Whether weights with ``label`` may serve, when ``newest_epoch`` is the fleet's newest."""
        epoch = label.epoch or 0
        if self.min_epoch is not None and epoch < self.min_epoch:
            return False
        if self.max_staleness is not None and newest_epoch - epoch > self.max_staleness:
            return False
        return not self.has_version or (label.declared and label.canonical_version == canonical(self.version))

    def describe(self) -> str:
        parts = []
        if self.min_epoch is not None:
            parts.append(f"epoch >= {self.min_epoch}")
        if self.max_staleness is not None:
            parts.append(f"at most {self.max_staleness} epoch(s) behind the newest")
        if self.has_version:
            parts.append(f"version {canonical(self.version)[:60]}")
        return " and ".join(parts) or "any committed version"


def _tighter(a: int | None, b: int | None, pick: Any) -> int | None:
    return b if a is None else a if b is None else int(pick(a, b))


ANY: Final = Policy()


def parse_policy(text: Any, where: str = HEADER) -> Policy:
    """A policy written as ``any``, ``latest``, ``min-epoch:N`` or ``max-staleness:K``.

    Raises ``InvalidRequest`` (``invalid_policy``) for anything else (N, K non-negative
    integers up to 2**63-1).
    """
    m = _FORM.fullmatch(text.strip()) if isinstance(text, str) else None
    if m is None or any(g is not None and int(g) > MAX_EPOCH for g in m.groups()[1:]):
        shown = repr(text[:60]) if isinstance(text, str) else type(text).__name__
        raise InvalidRequest(
            f"{where} must be any, latest, min-epoch:N or max-staleness:K (N, K integers >= 0), got {shown}",
            code="invalid_policy",
            field=where,
        )
    if m[1] == "any":
        return ANY
    if m[1] == "latest":
        return Policy(max_staleness=0)
    if m[2] is not None:
        return Policy(min_epoch=int(m[2]))
    return Policy(max_staleness=int(m[3]))


def body_policy(body: Mapping[str, Any]) -> Policy:
    """The bounds a completion body sets (fields of :data:`BODY_FIELDS`; others are ignored).

    Raises ``InvalidRequest`` for a field of the wrong type or range.
    """

    def epoch(field: str, value: Any) -> int:
        return integer(field, value, 0, MAX_EPOCH)

    return Policy(
        epoch("min_weight_epoch", body["min_weight_epoch"]) if "min_weight_epoch" in body else None,
        epoch("max_staleness", body["max_staleness"]) if "max_staleness" in body else None,
        any_json("weight_version", body["weight_version"]) if "weight_version" in body else _UNSET,
    )


def request_policy(body: Mapping[str, Any], header: str | None, default: Policy) -> Policy:
    """The policy of one request: its header and body bounds together, else ``default``."""
    policy = body_policy(body)
    if header is not None:
        policy = parse_policy(header).also(policy)
    return policy if policy.bounded or header is not None else default


@attrs.frozen
class Candidate:
    """A routable worker as :func:`choose` sees it."""

    url: str
    label: Label
    in_flight: int


@attrs.frozen
class Refusal:
    """Why no worker was chosen: ``no_worker`` (none routable) or ``no_fresh_worker``."""

    code: str
    message: str


def choose(
    candidates: Sequence[Candidate],
    policy: Policy,
    newest_epoch: int,
    *,
    exclude: frozenset[str] = frozenset(),
    start: int = 0,
) -> Candidate | Refusal:
    """The qualifying candidate with the fewest requests in flight (ties go round-robin
    from index ``start``), or the :class:`Refusal` that says why there is none."""
    usable = [c for c in candidates if c.url not in exclude]
    if not usable:
        return Refusal("no_worker", "no worker is routable now (all fenced, unreachable or being updated)")
    fresh = [(i, c) for i, c in enumerate(usable) if policy.allows(c.label, newest_epoch)]
    if not fresh:
        have = sorted({c.label.epoch or 0 for c in usable})
        return Refusal(
            "no_fresh_worker",
            f"no routable worker serves {policy.describe()} (fleet epoch {newest_epoch}; "
            f"routable workers are at epoch(s) {have})",
        )
    n = len(usable)
    return min(fresh, key=lambda ic: (ic[1].in_flight, (ic[0] - start) % n))[1]
