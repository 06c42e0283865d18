"""Catch-up: bring a worker to a digest the journal knows how to reach, and prove it.

A worker that is behind the fleet's committed version (restarted on an older checkpoint,
added, fenced), or that a rollback must take back, is moved by *hops*: applying a delta the
journal committed (its base digest to its target digest) or loading a full checkpoint the
journal knows the digest of.  :func:`route` picks the cheapest chain of hops from the digest
the worker holds to the one wanted — a delta costs 1, a full checkpoint :data:`FULL_COST` —
so a short chain of deltas wins and a long one (or none: the worker holds weights no delta
starts from, or it is torn) loses to the nearest full checkpoint followed by deltas.

What the journal knows (:meth:`Known.of`): every committed delta transaction's delta, every
committed disk transaction's checkpoint (its expected digest), every checkpoint a prepare
proved loads a worker's previous digest (a commit's source, an ``--initial-source``) and
every worker's committed source.  Paths are as the workers see them: a shared disk.

Every hop is checked: a delta is checked by the worker against its base (``409
base_mismatch``, nothing written) and its reply must name the hop's digest; a load must land
the checkpoint's digest (``digest_mismatch`` otherwise).  :func:`catch_up` ends with the
committed declaration read back (version, epoch, digest): only then is the worker admitted.
"""

from __future__ import annotations

import heapq
import itertools
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

import attrs

from weightsync.core.errors import IllegalState, WeightSyncError
from weightsync.fleet.calls import Call, Note, Reply, Script, declare, declaring, load, mismatch, one, state
from weightsync.fleet.delta_channel import apply_delta
from weightsync.fleet.events import short_digest
from weightsync.fleet.records import CommittedRow, DeltaRecord, TransactionSpec

if TYPE_CHECKING:
    from weightsync.fleet.journal import Journal

__all__ = ["FULL_COST", "Hop", "Known", "catch_up", "newest", "reach", "route"]

FULL_COST: Final = 4
"""What a full checkpoint load costs against one delta (1): the issue's goal puts a 1 % delta
at a quarter of a full push, so four deltas are worth one full load."""


@attrs.frozen
class Hop:
    """One step of a catch-up: apply the delta (``kind`` ``"delta"``) or load the checkpoint
    (``"disk"``) at ``path``; the worker then holds ``digest``.  A delta's ``base`` is the
    version its base must be declared as (the delta checks it)."""

    kind: str
    path: str
    digest: str
    base: Any = None
    base_digest: str | None = None


@attrs.frozen
class Known:
    """What the journal knows how to reach: its committed deltas and the full checkpoints
    whose digest it knows (digest → path)."""

    deltas: tuple[DeltaRecord, ...] = ()
    checkpoints: Mapping[str, str] = attrs.field(factory=dict)

    @classmethod
    def of(cls, journal: Journal, also: TransactionSpec | None = None) -> Known:
        """Everything ``journal`` committed (see the module), and ``also``'s delta (a
        transaction past its commit point, not yet finished)."""
        deltas: list[DeltaRecord] = []
        checkpoints: dict[str, str] = {}
        specs = journal.committed_specs()
        for spec in [*specs, *([also] if also is not None else [])]:
            if spec.delta is not None:
                deltas.append(spec.delta)
            for w in spec.workers:
                if w.previous is not None and w.previous.source and w.previous.digest:
                    checkpoints.setdefault(w.previous.digest, w.previous.source)
                if spec.kind == "disk" and w.source and spec.expected_digest:
                    checkpoints.setdefault(spec.expected_digest, w.source)
        for row in journal.members().values():
            if row.source and row.digest:
                checkpoints.setdefault(row.digest, row.source)
        return cls(tuple(deltas), checkpoints)


def newest(journal: Journal) -> CommittedRow | None:
    """The fleet's committed version: the member row with the highest epoch (``None`` before
    any commit)."""
    rows = list(journal.members().values())
    return max(rows, key=lambda r: r.epoch) if rows else None


def route(known: Known, held: str | None, want: str, url: str) -> tuple[Hop, ...]:
    """The cheapest hops that take ``url`` from digest ``held`` (``None``: unknown or torn) to
    ``want`` (none when it holds it).

    Raises ``IllegalState`` (``no_catch_up_route``) when nothing the journal knows reaches it.
    """
    if held == want:
        return ()
    order = itertools.count()
    queue: list[tuple[int, int, str | None, tuple[Hop, ...]]] = [(0, next(order), held, ())]
    done: set[str | None] = set()
    while queue:
        cost, _, node, hops = heapq.heappop(queue)
        if node == want:
            return hops
        if node in done:
            continue
        done.add(node)
        for d in known.deltas:
            if d.base_digest == node and d.target_digest not in done:
                hop = Hop("delta", d.path_for(url), d.target_digest, d.base_version, d.base_digest)
                heapq.heappush(queue, (cost + 1, next(order), d.target_digest, (*hops, hop)))
        for digest, path in known.checkpoints.items():
            if digest not in done:
                hop = Hop("disk", path, digest)
                heapq.heappush(queue, (cost + FULL_COST, next(order), digest, (*hops, hop)))
    if want not in known.checkpoints and not any(d.target_digest == want for d in known.deltas):
        raise IllegalState(
            f"{url}: the journal knows no checkpoint or delta of the weights {short_digest(want)} (a push "
            "committed them, and the trainer's memory is their only copy), so nothing can bring this worker "
            "onto them; it was left as it was. Include it in the fleet's next push or update (every worker "
            "it names moves together), or save a checkpoint of the committed weights and update the fleet "
            "from it",
            code="no_catch_up_route",
            url=url,
        )
    raise IllegalState(
        f"{url}: holds digest {short_digest(held)} and the journal knows no chain of deltas or full "
        f"checkpoint that reaches {short_digest(want)}: load a checkpoint of it, or update the fleet "
        "with this worker named",
        code="no_catch_up_route",
        url=url,
    )


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def reach(url: str, known: Known, now: Reply, want: str, not_after: float) -> Script[Reply]:
    """Take ``url`` (paused; ``now`` its state) along :func:`route` to digest ``want``; the
    value is its state after.  A delta's base label is declared first when the worker's label
    is another (guarded by the base digest: the content is proven, only the name changes;
    expiring at ``not_after``, the coordinator's clock).

    Raises ``IllegalState`` (``no_catch_up_route``; ``digest_mismatch`` when a hop lands
    another digest) or the worker's refusal of a hop."""
    held = now.get("digest") if now.get("torn") is not True else None
    for hop in route(known, held if isinstance(held, str) else None, want, url):
        if hop.kind == "delta":
            if now.get("version_declared") is True and _canonical(now.get("version")) != _canonical(hop.base):
                yield from declaring(url, hop.base, None, hop.base_digest, not_after)
            call: Call = apply_delta(url, hop.path)
        else:
            call = load(url, hop.path)
        reply = yield from one(call)
        if reply.get("digest") != hop.digest:
            raise mismatch(
                url, f"the {hop.kind} {hop.path} landed digest {reply.get('digest')}, not {hop.digest}"
            )
        yield Note(url, f"caught up by {hop.kind}", f"{hop.path}: digest {short_digest(hop.digest)}")
        now = yield from one(state(url))
    return now


def served_digest(url: str) -> Script[str | None]:
    """The digest of the weights ``url`` serves, recomputed from them (``verify_weights``):
    what a joining worker reports is a claim, this is the proof.  ``None`` from a worker
    that cannot attest its weights (its reported digest then stands)."""
    try:
        reply = yield Call(url, "verify_weights")
    except WeightSyncError as exc:
        if exc.code not in ("unknown_route", "not_found", "not_supported"):
            raise
        return None
    digest = reply.get("digest")
    return digest if isinstance(digest, str) else None


def catch_up(
    url: str, known: Known, row: CommittedRow, not_after: float, pause_mode: str = "keep"
) -> Script[Reply]:
    """Bring ``url`` onto the commit ``row`` (version, epoch, digest) and admit it: unless it
    holds exactly that already — reported, and proven by re-hashing what it serves
    (:func:`served_digest`) — and once a route there is known (else refused before it is
    paused), pause it, :func:`reach` the digest, declare the version at the
    epoch guarded by the digest (expiring at ``not_after``, the coordinator's clock) and read
    it back; then resume it.  The value is its state.

    Raises as :func:`reach` does, or ``IllegalState`` (``commit_not_read_back``); the worker
    then stays paused."""
    if row.digest is None:
        raise IllegalState(f"the commit {row.version!r} has no digest: nothing to prove", code="no_digest")
    now = yield from one(state(url))
    served = yield from served_digest(url)
    if served is not None and served != now.get("digest"):  # changed behind the control plane
        yield Note(url, "serves other weights than it reports", f"digest {short_digest(served)}")
        now = {**now, "digest": served, "torn": False}
    held = (now.get("version"), now.get("epoch"), now.get("digest"), now.get("torn"))
    if held != (row.version, row.epoch, row.digest, False) or now.get("version_declared") is not True:
        digest = now.get("digest") if now.get("torn") is not True else None
        route(known, digest if isinstance(digest, str) else None, row.digest, url)  # or refused, untouched
        yield Call(url, "pause_generation", {"mode": pause_mode})
        now = yield from reach(url, known, now, row.digest, not_after)
        yield from declare(url, row.version, row.epoch, row.digest, not_after)
    yield Call(url, "resume_generation")
    yield Note(
        url, "admitted", f"version {row.version!r}, epoch {row.epoch}, digest {short_digest(row.digest)}"
    )
    return (yield from one(state(url)))
