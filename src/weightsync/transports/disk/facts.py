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
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Final

import attrs

from .format import ShardHeader
from .manifest import Index, Manifest

if TYPE_CHECKING:
    from .checks import DiskCheckpoint

KEEP: Final = 4
"""How many checkpoints' facts a worker keeps (the most recently verified)."""


@attrs.frozen
class Facts:
    """One checkpoint as a full read found it: its files (headers with file identities),
    manifest and index, and every tensor's xxh3-64."""

    root: Path
    shards: tuple[ShardHeader, ...]
    manifest: Manifest | None
    index: Index | None
    hashes: Mapping[str, str]

    @classmethod
    def from_verified(cls, ckpt: DiskCheckpoint, hashes: Mapping[str, str]) -> Facts:
        """The facts of ``ckpt``, whose every tensor was just read and hashed to ``hashes``."""
        return cls(ckpt.root, ckpt.shards, ckpt.manifest, ckpt.index, dict(hashes))

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
