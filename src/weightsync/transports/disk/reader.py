"""The disk channel's reader: validated, streaming loading of safetensors checkpoints
(single file or sharded).

Everything that can be checked is checked before the first weight is written:

1. the path, and every file opened under it, resolves inside an allowed root (symlinks
   cannot escape) and is a regular file, opened without blocking (a FIFO cannot wedge us):
   :mod:`.paths`, :mod:`.format`;
2. the shard list (from ``model.safetensors.index.json`` or the directory) is complete,
   and every header parses and matches its file's length: :mod:`.manifest`, :mod:`.checks`;
3. if our writer's manifest is present, every file's size and xxh3-128 checksum match,
   and so does every tensor's xxh3-64 when the manifest lists them (one read of each file);
4. names, shapes and dtypes match the engine's weights, and the checkpoint covers them all
   (unless ``allow_partial``; dtypes are cast only with ``allow_dtype_cast``).

Any failure there, whatever its exception type, is a refusal of the error family with a
4xx code: nothing was written.  Then :mod:`.copy_loop` copies, hashing as it reads.

A dry run (``dry_run=True``) always reads every byte, and leaves what it verified in the
worker's :class:`~.facts.FactsStore`; an update that finds the files unchanged since then
skips step 3 and copies once, each tensor checked against the dry run's hash as it is read
(see :mod:`.facts`).  When not even a file's identity changed, it skips steps 1-2 as well:
the paths are resolved against the roots again and every file is ``stat``-ed, nothing is
re-read.  Without facts, an update verifies as above.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from weightsync.core.errors import IllegalState, InvalidRequest
from weightsync.core.snapshot import TensorSpec
from weightsync.core.sources import DiskSource
from weightsync.transports.disk.checks import DiskCheckpoint
from weightsync.transports.disk.copy_loop import ReadMeter
from weightsync.transports.disk.facts import Facts, FactsStore
from weightsync.transports.disk.manifest import DELTA_NAME
from weightsync.transports.disk.paths import present
from weightsync.transports.sink import Target, check_metadata

_NO_MANIFEST = object()


def check_label(source: DiskSource, manifest_version: Any) -> None:
    """Refuse an update that declares a version other than the one the checkpoint's manifest
    names (``409 version_mismatch``), unless ``source.relabel``: a label is a claim about the
    bytes, and the manifest is the trainer's own word for them."""
    if source.label is None or source.relabel or manifest_version in (_NO_MANIFEST, None):
        return  # nothing declared, a relabel, or a checkpoint whose writer named no version
    (given,) = source.label
    if json.dumps(given, sort_keys=True) != json.dumps(manifest_version, sort_keys=True):
        raise IllegalState(
            f"the update declares version {json.dumps(given)[:80]} but the checkpoint's manifest says "
            f"{json.dumps(manifest_version)[:80]}: declare the manifest's version, or pass relabel: true "
            "(fleet update --relabel) if the new label is meant",
            code="version_mismatch",
            field="weight_version",
        )


def check_not_delta(ckpt: DiskCheckpoint) -> None:
    """Refuse a delta checkpoint (``weightsync delta``'s directory: its tensors are a patch's
    indices and values, not weights) with ``400 is_a_delta``, naming the route that applies
    it, rather than the names a full load would not know (``unknown_tensor``)."""
    if ckpt.identities and present(ckpt.root, DELTA_NAME):
        raise InvalidRequest(
            f"model_path {ckpt.model_path!r} is a delta checkpoint ({DELTA_NAME}), not a full one: apply it "
            "to the base it names with update_weights_from_delta (delta_path), or in a fleet with "
            "`weightsync fleet update --from-delta`",
            code="is_a_delta",
        )


class DiskReader:
    """The disk channel: :meth:`validate` (paths, files, headers, index, manifest and every
    checksum, names, shapes and dtypes; nothing written), then :meth:`stream`."""

    kind = "disk"

    def __init__(
        self,
        source: DiskSource,
        allowed_roots: Sequence[Path] | None = None,
        facts: FactsStore | None = None,
        *,
        dry_run: bool = False,
    ) -> None:
        self.source = source
        self.allowed_roots = allowed_roots
        self.facts = facts
        self.dry_run = dry_run
        self.meter = ReadMeter()
        self._ckpt: DiskCheckpoint | None = None
        self._cast: list[str] = []
        self._expected: Mapping[str, str] | None = None
        self._prepared = False
        self._reopened = True
        self._validate_seconds = 0.0

    def validate(self, specs: Mapping[str, TensorSpec]) -> dict[str, str] | None:
        """Check the checkpoint against ``specs``.  Returns ``name -> xxh3-64`` of the tensors
        a load would write when nothing is cast and the manifest declares them — or, for a dry
        run, which reads every byte, when the checksum pass computed them (a checkpoint without
        weightsync's manifest) — else ``None``.

        The checksum pass runs for a dry run (whose facts are then remembered) and for a
        checkpoint with a manifest, unless the facts of an earlier full read still describe
        every file (then the copy checks each tensor against them instead).

        Raises 4xx errors of the family (see :meth:`DiskCheckpoint.open` and
        :meth:`DiskCheckpoint.verify_checksums`); an exception outside it can only come from
        the metadata check, and ``failures.refusal`` turns it into one."""
        t0 = time.perf_counter()
        store = self.facts if not self.dry_run else None
        unchanged = (
            store.recall_unchanged(self.source.model_path, self.allowed_roots) if store is not None else None
        )
        if unchanged is not None:  # nothing changed since the dry run opened and read it
            ckpt = unchanged.checkpoint()
        else:
            ckpt = DiskCheckpoint.open(self.source.model_path, self.allowed_roots)
        check_not_delta(ckpt)
        check_label(self.source, ckpt.version if ckpt.manifest is not None else _NO_MANIFEST)
        self._cast = check_metadata(
            (e.spec for e in ckpt.entries),
            specs,
            allow_partial=self.source.allow_partial,
            allow_dtype_cast=self.source.allow_dtype_cast,
        )
        if unchanged is not None:
            known: Mapping[str, str] | None = unchanged.hashes
        else:
            known = store.recall(ckpt) if store is not None else None
        self._prepared = known is not None
        self._reopened = unchanged is None
        if known is not None:
            self._expected = known
        elif self.dry_run or ckpt.manifest is not None:
            self._expected = ckpt.verify_checksums()
            if self.facts is not None:
                self.facts.remember(Facts.from_verified(ckpt, self._expected))
        self._ckpt = ckpt
        self._validate_seconds = time.perf_counter() - t0
        declared = ckpt.tensor_hashes
        if declared is None and self.dry_run:
            declared = self._expected  # no manifest (a Hugging Face directory): the bytes just read
        if declared is None or self._cast:  # a cast tensor's bytes are known only once cast
            return None
        return {e.spec.name: declared[e.spec.name] for e in ckpt.entries}

    def stream(self, target: Target) -> Iterator[None]:
        """Copy the validated checkpoint into ``target``, every tensor checked as it is read
        against what the checksum pass or the dry run found (see :meth:`DiskCheckpoint.copy_into`)."""
        assert self._ckpt is not None, "validate first"
        return self._ckpt.copy_into(target, self.meter, self._expected)

    def close(self) -> None:
        """Nothing stays open between validation and the stream (each shard is reopened and
        checked to be the validated file)."""

    @property
    def hashed_in_target(self) -> frozenset[str]:
        """The tensors the copy read into memory the target lent and hashed there, after the
        read (the hash is of that memory, not of a buffer the bytes passed through)."""
        return frozenset(self.meter.in_target)

    @property
    def files(self) -> int:
        return len(self._ckpt.shards) if self._ckpt is not None else 0

    def extra(self) -> dict[str, Any]:
        ckpt = self._ckpt
        assert ckpt is not None
        extra: dict[str, Any] = {
            "validate_seconds": round(self._validate_seconds, 6),
            "hash_seconds": round(self.meter.hash_seconds, 6),
            "verified": "tensors" if ckpt.tensor_hashes is not None else "files" if ckpt.manifest else "none",
            "prepared": self._prepared,
        }
        if self._prepared:  # how the facts were found to apply: by stat alone, or by re-reading
            extra["prepared_check"] = "headers" if self._reopened else "identities"
        if self._cast:
            extra["dtype_cast"] = len(self._cast)
        if ckpt.manifest is not None:
            extra["manifest_version"] = ckpt.version
        return extra
