"""Sample certificates checked against the fleet's journal: :func:`verify_samples`.

Every span a worker stamps on its tokens carries ``(version, epoch, digest, version_current)``:
the label, the fleet epoch it was committed under, the content digest of the weights that
produced those tokens, and whether the label described them.  A trainer that collected
samples (completion replies, choices, SGLang ``/generate`` replies — any framework's) asks
the journal whether those weights were what the fleet committed, and how far behind its
current step they are, before it learns from them:

- ``uncommitted``: a span names weights no commit in the journal describes (a forged or
  unknown digest, a version never committed, an undeclared worker, an epoch never issued);
- ``not_current``: a span whose label no longer described the weights (an update without a
  label landed mid-request);
- ``mixed``: with ``one_commit=True``, the tokens come from more than one commit;
- ``stale``: with ``max_staleness=k``, more than ``k`` other commits landed between the
  span's commit and the trainer's current one (the journal's newest, or ``current_epoch``);
- ``unstamped``: no span at all.

A peer's own span shape (vLLM 0.33's ``choices[i].weight_versions``, SGLang's
``meta_info.weight_versions``: ``{version, start, end}``) names a label only: it is matched by
version, and the verdict says so (``version_only``).  Nothing here trusts a sample's bytes
beyond reading them as JSON values: a malformed span is ``uncommitted``, never an exception.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

import attrs

from weightsync.fleet.journal import Journal

__all__ = ["REASONS", "Commit", "SampleReport", "SampleVerdict", "commits_of", "verify_samples"]

REASONS: Final = ("unstamped", "uncommitted", "not_current", "mixed", "stale")
"""Why a sample is dropped, in the order they are checked."""


@attrs.frozen
class Commit:
    """Weights the fleet committed: a version, under a fleet epoch, with a content digest."""

    version: Any
    epoch: int
    digest: str | None


@attrs.frozen
class SampleVerdict:
    """One sample's verdict: ``kept``, else ``reasons`` (from :data:`REASONS`); ``staleness``
    counts the other commits since its oldest span's (``None`` when it matched none);
    ``version_only`` when its spans were a peer's shape, matched by label alone."""

    index: int
    kept: bool
    reasons: tuple[str, ...] = ()
    staleness: int | None = None
    version_only: bool = False


@attrs.frozen
class SampleReport:
    """Every sample's :class:`SampleVerdict`, in order, with counts a loop can log."""

    verdicts: tuple[SampleVerdict, ...]

    @property
    def counts(self) -> dict[str, int]:
        """``samples``, ``kept``, ``dropped``, one count per reason and ``version_only``."""
        reasons = Counter(r for v in self.verdicts for r in v.reasons)
        kept = sum(v.kept for v in self.verdicts)
        out = {"samples": len(self.verdicts), "kept": kept, "dropped": len(self.verdicts) - kept}
        out.update({r: reasons[r] for r in REASONS})
        out["version_only"] = sum(v.version_only for v in self.verdicts)
        return out

    def keep(self, samples: Sequence[Any]) -> list[Any]:
        """The samples this report kept, in order."""
        return [samples[v.index] for v in self.verdicts if v.kept]


def commits_of(journal: Journal) -> list[Commit]:
    """Every commit ``journal`` records, by epoch: each committed transaction's (version,
    epoch, digest), each rollback's re-commit of what its workers held (under the rollback
    epoch), and each member's last commit (adopted fleets included)."""
    found: set[Commit] = set()
    for spec in journal.committed_specs():
        if spec.epoch is not None:
            found.add(Commit(_key(spec.version), spec.epoch, spec.expected_digest))
    for spec in journal.rolled_back_specs():
        for w in spec.workers:
            held = w.previous
            if spec.rollback_epoch is not None and held is not None and held.declared:
                found.add(Commit(_key(held.version), spec.rollback_epoch, held.digest))
    for row in journal.members().values():
        found.add(Commit(_key(row.version), row.epoch, row.digest))
    return sorted(found, key=lambda c: (c.epoch, str(c.version), c.digest or ""))


def verify_samples(
    samples: Sequence[Any],
    journal: Journal | str | os.PathLike[str] | Iterable[Commit],
    *,
    max_staleness: int | None = None,
    one_commit: bool = False,
    current_epoch: int | None = None,
) -> SampleReport:
    """Check each sample's spans against the commits of ``journal`` (a :class:`Journal`, its
    path, or :class:`Commit` values); see the module for the reasons a sample is dropped.

    ``max_staleness``: the most other commits allowed between a span's commit and the
    current one (``current_epoch``, default the journal's newest).  Raises ``ValueError`` for
    a negative ``max_staleness``."""
    if max_staleness is not None and (type(max_staleness) is not int or max_staleness < 0):
        raise ValueError(f"max_staleness must be an integer >= 0, got {max_staleness!r}")
    commits = _commits(journal)
    current = current_epoch if current_epoch is not None else max((c.epoch for c in commits), default=0)
    return SampleReport(
        tuple(_verdict(i, s, commits, max_staleness, one_commit, current) for i, s in enumerate(samples))
    )


def _commits(journal: Journal | str | os.PathLike[str] | Iterable[Commit]) -> list[Commit]:
    if isinstance(journal, Journal):
        return commits_of(journal)
    if isinstance(journal, str | os.PathLike):
        opened = Journal(journal, must_exist=True)
        try:
            return commits_of(opened)
        finally:
            opened.close()
    return sorted(journal, key=lambda c: (c.epoch, str(c.version), c.digest or ""))


def _key(version: Any) -> Any:
    """A version as a hashable key (any JSON value)."""
    return json.dumps(version, sort_keys=True) if isinstance(version, dict | list) else version


def _spans(sample: Any) -> tuple[list[Mapping[str, Any]], bool]:
    """The sample's spans and whether they are a peer's label-only shape."""
    if not isinstance(sample, Mapping):
        return [], False
    if isinstance(sample.get("choices"), list):  # every choice's own spans (the top level repeats one)
        spans: list[Mapping[str, Any]] = []
        only = False
        for choice in sample["choices"]:
            got, peer = _spans(choice)
            if not got:  # one choice without a certificate: the sample is not stamped
                return [], False
            spans += got
            only |= peer
        return spans, only
    if isinstance(sample.get("weight_version_spans"), list):
        return [s for s in sample["weight_version_spans"] if isinstance(s, Mapping)], False
    if isinstance(sample.get("meta_info"), Mapping):
        return _spans(sample["meta_info"])
    if isinstance(sample.get("weight_versions"), list):
        return [s for s in sample["weight_versions"] if isinstance(s, Mapping)], True
    return [], False


def _match(span: Mapping[str, Any], commits: list[Commit], label_only: bool) -> Commit | None:
    """The commit ``span`` names (the newest by epoch for a label-only span), or ``None``."""
    if not label_only and span.get("version_declared") is not True:
        return None
    version = _key(span.get("version")) if _hashable(span.get("version")) else object()
    if label_only:
        matches = [c for c in commits if c.version == version]
        return matches[-1] if matches else None
    epoch, digest = span.get("epoch"), span.get("digest")
    for c in commits:
        if c.version == version and c.epoch == epoch and c.digest is not None and c.digest == digest:
            return c
    return None


def _hashable(value: Any) -> bool:
    try:
        hash(_key(value))
    except TypeError:
        return False
    return True


def _verdict(
    index: int, sample: Any, commits: list[Commit], bound: int | None, one: bool, current: int
) -> SampleVerdict:
    spans, label_only = _spans(sample)
    if not spans:
        return SampleVerdict(index, False, ("unstamped",))
    reasons: list[str] = []
    matched = [_match(s, commits, label_only) for s in spans]
    if any(m is None for m in matched):
        reasons.append("uncommitted")
    if not label_only and any(s.get("version_current") is not True for s in spans):
        reasons.append("not_current")
    found = [m for m in matched if m is not None]
    if one and len({(m.version, m.epoch, m.digest) for m in found}) > 1:
        reasons.append("mixed")
    staleness = None
    if found:
        oldest = min(found, key=lambda m: m.epoch)
        later = {(c.version, c.digest) for c in commits if oldest.epoch < c.epoch <= current}
        staleness = len(later - {(oldest.version, oldest.digest)})
        if bound is not None and staleness > bound:
            reasons.append("stale")
    return SampleVerdict(index, not reasons, tuple(reasons), staleness, label_only)
