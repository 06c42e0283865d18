"""What a worker holds: the hash of every tensor, the names whose content is unknown, and the
digest of the two when it can be known.

One value for everyone who keeps that bookkeeping: the controller (from the engine's initial
hashes, then from the hashes each load reports as its bytes pass through) and the vLLM worker
extension (from the served checkpoint, then from what each load handed to vLLM).  The rules:
a complete load merges its hashes over the map; a load that wrote tensors nobody hashed, and
a torn one, make every entry unknown; a refusal changes nothing (there is no step for it).


The content digest of a worker's weights: evidence beside the version label.

A worker's *digest* is an order-independent combination of per-tensor hashes: each tensor
is hashed once as its bytes pass through a load (xxh3-64 of the raw bytes, lowercase hex,
computed by the channels), and the digest combines the ``name -> hash`` map.  Sorting by
name makes the combination independent of the order tensors arrived in, and keeps the map
mergeable: a partial update replaces some entries and the digest is simply recomputed.

Two workers (or a worker and a checkpoint manifest) hold the same weights exactly when
their digests are equal.  Pure standard library, so core stays importable anywhere.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

import attrs

from weightsync.core.errors import IllegalState

_EMPTY: Final[Mapping[str, str]] = MappingProxyType({})


def _digest_of(held: HeldWeights) -> str | None:
    if not held.attested or held.unknown or not held.hashes or held.weights == "discarded":
        return None
    return weights_digest(held.hashes)


@attrs.frozen(eq=True, hash=False)
class HeldWeights:
    """``hashes`` (``name -> xxh3-64 hex``) of the weights held, the ``unknown`` names among
    them, and whether the starting weights were known at all (``attested``).

    ``digest`` is the content digest (:func:`~weightsync.core.held.weights_digest`) of the
    map, or ``None`` while anything is unknown.  ``in_place``: every hash of the map was taken
    by the last load, from the very memory the engine serves, after its bytes were written
    there (the disk channel reading into the engine's own tensors) — a load of every held
    tensor; any later step that can write weights builds a new value without it.  Build one
    with :meth:`starting_with`.

    Where the weights and the KV cache are (``weights``, ``kv_cache``: states of the memory
    parts of :mod:`weightsync.core._state`) is part of what is held: ``discarded`` weights are
    nobody's, so the digest is ``None`` until a load rewrote every ``missing`` name.
    """

    hashes: Mapping[str, str] = _EMPTY
    unknown: frozenset[str] = frozenset()
    attested: bool = False
    in_place: bool = False
    weights: str = "resident"
    kv_cache: str = "resident"
    missing: frozenset[str] = frozenset()
    """The names discarded (``discard_weights``) that no load has written since."""
    digest: str | None = attrs.field(init=False, default=attrs.Factory(_digest_of, takes_self=True))

    @classmethod
    def starting_with(cls, hashes: Mapping[str, str] | None) -> HeldWeights:
        """The weights a worker starts with: their hashes, or ``None`` when nobody knows them
        (the digest then stays unknown, whatever is loaded later)."""
        if hashes is None:
            return cls()
        return cls(MappingProxyType(dict(hashes)), frozenset(), True)

    def loaded(
        self,
        hashes: Mapping[str, str] | None,
        written: int,
        *,
        in_place: bool = False,
        names: frozenset[str] = frozenset(),
    ) -> HeldWeights:
        """After a successful load of ``written`` tensors, ``hashes`` the channel computed for
        them (``None``, or fewer than ``written``, when some tensor went unhashed: every entry
        is then unknown).  ``in_place``: the channel took every one of ``hashes`` from the
        served memory after writing it; the result is :attr:`in_place` only when the load
        also covered every held tensor (an entry it left alone was hashed earlier, and
        nothing says its memory stayed as it was).  ``names``: the tensors written, by name
        (taken off :attr:`missing` with ``hashes``' names)."""
        missing = self.missing.difference(names, hashes or ())
        if hashes is None or len(hashes) != written:
            return self if not written else attrs.evolve(self.torn(), missing=missing)
        merged = MappingProxyType({**self.hashes, **hashes})
        whole = in_place and bool(hashes) and hashes.keys() >= self.hashes.keys()
        return attrs.evolve(
            self, hashes=merged, unknown=self.unknown.difference(hashes), in_place=whole, missing=missing
        )

    @property
    def in_place_digest(self) -> str | None:
        """:attr:`digest` when it is :attr:`in_place` (the digest of the served memory as the
        last load left it, nothing having written since), else ``None``."""
        return self.digest if self.in_place else None

    def torn(self) -> HeldWeights:
        """After a load that failed once writing began: which tensors it wrote is unknown, so
        is every hash."""
        return attrs.evolve(self, unknown=frozenset(self.hashes), in_place=False)

    def written_over(self) -> HeldWeights:
        """After a write these hashes do not yet describe (an update inside a session, whose
        hashes count at its finish): no longer :attr:`in_place`."""
        return attrs.evolve(self, in_place=False)

    def in_memory(self, weights: str, kv_cache: str, discarded: frozenset[str] = frozenset()) -> HeldWeights:
        """After a memory command left the weights ``weights`` and the KV cache ``kv_cache``;
        ``discarded``: the names whose memory it freed.  Weights that moved (offloaded, restored,
        discarded) were written behind any load's hashes, so they are no longer :attr:`in_place`;
        weights that stayed where they were keep it (a KV-only release, an update's own step)."""
        missing = self.missing | discarded if weights == "discarded" else frozenset()
        kept = self.in_place and weights == self.weights and not discarded
        return attrs.evolve(self, in_place=kept, weights=weights, kv_cache=kv_cache, missing=missing)

    def digest_after(self, hashes: Mapping[str, str] | None) -> str | None:
        """The digest the worker would hold after a load of exactly ``hashes`` (a dry run's
        prediction): ``None`` when anything would stay unknown or the load would add names."""
        if hashes is None or not self.attested or self.unknown.difference(hashes) or self.missing:
            return None
        if not self.hashes.keys() >= hashes.keys():
            return None
        return weights_digest({**self.hashes, **hashes})


DIGEST_BYTES: Final = 16


def weights_digest(hashes: Mapping[str, str]) -> str:
    """Combine per-tensor hashes (``name -> lowercase hex``) into one lowercase hex digest.

    The result does not depend on the mapping's order.  Raises ``ValueError`` for a name or
    hash containing a tab or newline (they would make the encoding ambiguous).
    """
    h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=b"weightsync/1")
    for name in sorted(hashes):
        value = hashes[name]
        if any(c in s for s in (name, value) for c in "\t\n"):
            raise ValueError(f"tensor name or hash contains a tab or newline: {name!r}")
        h.update(f"{name}\t{value}\n".encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def check_declare(
    *, digest: str | None, expected_digest: str | None, epoch: int | None, new_epoch: int | None
) -> None:
    """Refuse a declaration whose guards fail; nothing changes.

    Raises ``IllegalState``: ``digest_mismatch`` when ``expected_digest`` is given and the
    weights held have another (or an unknown) digest; ``stale_epoch`` when ``new_epoch`` is
    below the current ``epoch`` (an epoch never goes backwards; an equal one re-declares).
    """
    if expected_digest is not None and digest != expected_digest:
        raise IllegalState(
            f"the weights held have digest {digest or 'unknown'}, not the expected {expected_digest}",
            code="digest_mismatch",
            digest=digest,
            expected_digest=expected_digest,
        )
    if new_epoch is not None and epoch is not None and new_epoch < epoch:
        raise IllegalState(
            f"epoch {new_epoch} is older than this worker's epoch {epoch}; an epoch never goes backwards",
            code="stale_epoch",
            epoch=epoch,
        )


def check_not_after(not_after: float | None, now: float | None = None) -> None:
    """Refuse a declaration read after its ``not_after`` (unix seconds, the worker's clock: a
    fleet coordinator converts its deadline with the ``clock`` the worker reports), compared
    with ``now`` (default: this process's clock); nothing changes.

    A fleet commit carries the deadline of its phase: one that reaches the worker late (it
    was stopped, say, while the request sat in its socket) could otherwise declare a version
    its coordinator has since rolled back.  Raises ``IllegalState`` (``commit_expired``).
    """
    now = time.time() if now is None else now
    if not_after is not None and now > not_after:
        raise IllegalState(
            f"this declaration expired at {not_after:.3f} (unix seconds) and reached the worker at "
            f"{now:.3f}: its sender no longer waits for it, so nothing was declared",
            code="commit_expired",
            not_after=not_after,
            now=now,
        )
