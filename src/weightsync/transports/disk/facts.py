"""What a dry run verified of a checkpoint, kept for the update that follows it.

A dry run (``check_source``, legal while the worker serves) reads every byte of the
checkpoint once.  The worker keeps what it learnt — for every shard the header that was
checked and the identity of the file it was read from (device, inode, size, modification
and change times: :class:`~.format.ShardHeader`), the manifest and index, and the xxh3-64
of every tensor as read — as :class:`Facts` in its :class:`FactsStore`.

An update of the same checkpoint whose files still have exactly those identities skips the
up-front pass: it copies once, comparing every tensor's hash, as it is read, with the
facts.  So bytes rewritten after the dry run still fail the load; a rewrite that changes
no identity can only be caught while copying, after the first write, and the worker is
then torn — never committed.  A rewrite that changes a size or a time is noticed before the
first write: the facts no longer apply and the update verifies up front, as it does
without a dry run.

Whether the facts still apply is asked twice, cheapest first.  :meth:`Facts.unchanged`
opens and reads nothing: the update's ``model_path`` is the dry run's, it and every shard
resolve (under the update's allowed roots) to the very paths the dry run read, and every
file — shards, the directory itself, its index and manifest — still has the identity the
dry run saw before reading it.  Then the facts stand for the headers, index and manifest
too, and the pause window holds no validation but those ``stat`` calls and the engine's
metadata check.  Otherwise the checkpoint is opened and checked in full, and
:meth:`FactsStore.recall` compares what it found with the facts (an unrelated file added
beside the shards, or a manifest rewritten with the same content, still lets the update
copy once).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Final

import attrs

from weightsync.core.errors import WeightSyncError
from weightsync.transports.disk.format import FileIdentity, ShardHeader
from weightsync.transports.disk.manifest import Index, Manifest
from weightsync.transports.disk.paths import member, resolve_path, resolved_roots

if TYPE_CHECKING:
    from collections.abc import Sequence

    from weightsync.transports.disk.checks import DiskCheckpoint

KEEP: Final = 4
"""How many checkpoints' facts a worker keeps (the most recently verified)."""


def _gone() -> WeightSyncError:
    return WeightSyncError("no longer resolves", code="missing_shard")


@attrs.frozen
class Facts:
    """One checkpoint as a full read found it: its files (headers with file identities),
    manifest and index, and every tensor's xxh3-64."""

    root: Path
    shards: tuple[ShardHeader, ...]
    manifest: Manifest | None
    index: Index | None
    hashes: Mapping[str, str]
    model_path: str = ""
    identities: Mapping[str, FileIdentity | None] = attrs.field(factory=dict)

    @classmethod
    def from_verified(cls, ckpt: DiskCheckpoint, hashes: Mapping[str, str]) -> Facts:
        """The facts of ``ckpt``, whose every tensor was just read and hashed to ``hashes``."""
        return cls(
            ckpt.root, ckpt.shards, ckpt.manifest, ckpt.index, dict(hashes), ckpt.model_path, ckpt.identities
        )

    def checkpoint(self) -> DiskCheckpoint:
        """The checkpoint as the dry run opened and checked it."""
        from weightsync.transports.disk.checks import DiskCheckpoint

        return DiskCheckpoint(
            self.root, self.shards, self.manifest, self.index, self.model_path, self.identities
        )

    def unchanged(self, model_path: str, allowed_roots: Sequence[str | Path] | None) -> bool:
        """Whether ``model_path`` still names, under ``allowed_roots``, exactly the files these
        facts were taken from: the dry run's path, resolving to the same directory (or
        file) and shard paths, every file with the identity it had when the dry run read it.
        Opens nothing (a FIFO cannot block it); any doubt is ``False``."""
        if not self.model_path or model_path != self.model_path:
            return False
        try:
            path = resolve_path(model_path, allowed_roots)
            if not self.identities:  # a single file
                (shard,) = self.shards
                return path == shard.path and FileIdentity.at(path) == shard.identity
            if path != self.root:
                return False
            roots = resolved_roots(allowed_roots)
            for name, identity in self.identities.items():
                if identity is not None and name != ".":
                    member(path, name, roots, _gone())  # still inside the roots
                if FileIdentity.at(path / name) != identity:
                    return False
            return all(
                member(path, shard.name, roots, _gone()) == shard.path
                and FileIdentity.at(shard.path) == shard.identity
                for shard in self.shards
            )
        except (WeightSyncError, OSError, ValueError):
            return False

    def describe(self, ckpt: DiskCheckpoint) -> bool:
        """Whether ``ckpt`` (freshly opened) is the checkpoint these facts describe: the same
        files, with the same identities, headers, manifest and index."""
        return (
            self.root == ckpt.root
            and self.shards == ckpt.shards
            and self.manifest == ckpt.manifest
            and self.index == ckpt.index
        )


class FactsStore:
    """The facts of the last :data:`KEEP` checkpoints this worker verified, by directory."""

    def __init__(self, keep: int = KEEP) -> None:
        self._keep = keep
        self._facts: OrderedDict[Path, Facts] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, facts: Facts) -> None:
        with self._lock:
            self._facts.pop(facts.root, None)
            self._facts[facts.root] = facts
            while len(self._facts) > self._keep:
                self._facts.popitem(last=False)

    def clear(self) -> None:
        """Forget every checkpoint (the next update of each verifies up front)."""
        with self._lock:
            self._facts.clear()

    def recall_unchanged(self, model_path: str, allowed_roots: Sequence[str | Path] | None) -> Facts | None:
        """The facts of the checkpoint at ``model_path`` when nothing of it changed since they
        were taken (see :meth:`Facts.unchanged`: paths resolved and files ``stat``-ed, nothing
        read), else ``None`` (the facts are kept: a full check may still find them true)."""
        try:
            path = resolve_path(model_path, allowed_roots)
        except WeightSyncError:
            return None
        with self._lock:
            facts = self._facts.get(path) or self._facts.get(path.parent)
        if facts is None or not facts.unchanged(model_path, allowed_roots):
            return None
        return facts

    def recall(self, ckpt: DiskCheckpoint) -> Mapping[str, str] | None:
        """Every tensor's hash as the last full read of ``ckpt`` found it, when the facts
        still describe ``ckpt`` (see :meth:`Facts.describe`); else ``None`` (and facts that
        no longer apply are dropped)."""
        with self._lock:
            facts = self._facts.get(ckpt.root)
            if facts is None:
                return None
            if not facts.describe(ckpt):
                del self._facts[ckpt.root]
                return None
            return facts.hashes
