"""The delta channel: a delta checkpoint read, checked against the worker's base, applied.

:meth:`DeltaReader.validate` does everything that can refuse before a byte is written: it
reads ``weightsync-delta.json`` (:class:`~.manifest.DeltaManifest`), checks the base against
what the worker holds (``409 base_mismatch``: its digest, its declared version, every name,
shape and dtype), checks the payload checkpoint like any checkpoint (every file's checksum,
every tensor's hash) and the payload against the manifest (:func:`~.apply.prepare`).
:meth:`DeltaReader.stream` applies it (:func:`~.apply.apply`) into the engine's own tensors
and hands each changed tensor back with the target's hash: the worker's digest becomes the
target's the moment the load commits.
"""

from __future__ import annotations

import math
import stat
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import torch

from weightsync.core.dtypes import itemsize
from weightsync.core.errors import IllegalState, NotSupported
from weightsync.core.snapshot import TensorSpec
from weightsync.core.sources import DeltaSource, HeldBase
from weightsync.transports.delta.apply import Patch, apply, prepare
from weightsync.transports.delta.manifest import DeltaManifest, bad_delta
from weightsync.transports.disk.checks import DiskCheckpoint
from weightsync.transports.disk.format import read_json_file
from weightsync.transports.disk.manifest import DELTA_NAME
from weightsync.transports.disk.paths import member, resolve_path, resolved_roots
from weightsync.transports.sink import PullTarget, Target, pull

MAX_DELTA_JSON: Final = 256 << 20
PAYLOAD_SLACK: Final = 1 << 20


def base_mismatch(why: str, **details: Any) -> IllegalState:
    return IllegalState(f"this worker does not hold the delta's base: {why}", code="base_mismatch", **details)


def check_base(manifest: DeltaManifest, specs: Mapping[str, TensorSpec], held: HeldBase | None) -> None:
    """Refuse (``409 base_mismatch``) unless the worker holds exactly the delta's base."""
    if held is None or held.digest is None:
        raise base_mismatch("the digest of the weights it holds is unknown", base_digest=manifest.base.digest)
    if held.digest == manifest.target.digest != manifest.base.digest:  # a relabelling delta moves no digest
        raise base_mismatch(
            f"it already holds the delta's target, version {manifest.target.version!r} (digest "
            f"{held.digest}): there is nothing to apply",
            held_digest=held.digest,
            base_digest=manifest.base.digest,
            target_digest=manifest.target.digest,
        )
    if held.digest != manifest.base.digest:
        raise base_mismatch(
            f"it holds digest {held.digest}, the delta applies to {manifest.base.digest}",
            held_digest=held.digest,
            base_digest=manifest.base.digest,
        )
    if held.declared and held.version != manifest.base.version:
        raise base_mismatch(
            f"it serves version {held.version!r}, the delta applies to {manifest.base.version!r}",
            base_digest=manifest.base.digest,
        )
    if set(specs) != set(manifest.tensors):
        raise base_mismatch("the delta names other tensors than the worker serves")
    for name, entry in manifest.tensors.items():
        spec = specs[name]
        if spec.dtype != entry.dtype or tuple(spec.shape) != entry.shape:
            raise base_mismatch(
                f"tensor {name!r} is {spec.dtype}{list(spec.shape)} here, "
                f"{entry.dtype}{list(entry.shape)} in the delta"
            )


def read_manifest(directory: Path, roots: Sequence[Path] | None) -> DeltaManifest:
    where = member(directory, DELTA_NAME, roots, bad_delta(f"{DELTA_NAME} is missing"))
    return DeltaManifest.from_json(read_json_file(where, MAX_DELTA_JSON, bad_delta))


class DeltaReader:
    """The reader of a :class:`~weightsync.core.sources.DeltaSource` (see the module)."""

    kind = "delta"

    def __init__(self, source: DeltaSource, allowed_roots: Sequence[str | Path] | None) -> None:
        self.source = source
        self._allowed = allowed_roots
        self.manifest: DeltaManifest | None = None
        self._patches: list[Patch] = []
        self._payload_bytes = 0
        self._counts = (0, 0)
        self._checks: dict[str, int] = {}

    def validate(self, specs: Mapping[str, TensorSpec]) -> dict[str, str] | None:
        path = resolve_path(self.source.delta_path, self._allowed, field="delta_path")
        if not stat.S_ISDIR(path.stat().st_mode):
            raise bad_delta(f"{self.source.delta_path!r} is not a delta checkpoint directory")
        manifest = self.manifest = read_manifest(path, resolved_roots(self._allowed))
        check_base(manifest, specs, self.source.held)
        # A delta that changes nothing needs no payload (its writer leaves a placeholder one).
        payload = self._payload(path, specs, manifest) if manifest.changed else {}
        self._patches = prepare(manifest.changed, payload, manifest.encoding)
        self._counts = (len(self._patches), sum(p.entry.changed for p in self._patches))
        return {t.name: t.target_hash for t in manifest.changed}

    def _payload(
        self, path: Path, specs: Mapping[str, TensorSpec], manifest: DeltaManifest
    ) -> dict[str, torch.Tensor]:
        ckpt = DiskCheckpoint.open(str(path), self._allowed)
        if ckpt.manifest is None or ckpt.manifest.tensors is None:
            raise bad_delta("the payload has no weightsync-manifest.json with per-tensor hashes")
        keys = {k for t in manifest.changed for k in (t.indices, t.values)}
        found = {e.spec.name for e in ckpt.entries}
        if found != keys:
            raise bad_delta("the payload's tensors are not the ones the delta names")
        size = sum(e.end - e.start for e in ckpt.entries)
        served = sum(itemsize(s.dtype) * math.prod(s.shape) for s in specs.values())
        if size > 2 * served + PAYLOAD_SLACK:  # a delta cannot need more than indices + values
            raise bad_delta(f"the payload ({size} bytes) is larger than any delta of these weights")
        ckpt.verify_checksums()  # every payload byte as the writer hashed it: no truncation, no rewrite
        target = PullTarget()
        payload = dict(pull(ckpt.copy_into(target, expected=ckpt.tensor_hashes), target))
        self._payload_bytes = size
        return payload

    def stream(self, target: Target) -> Iterator[None]:
        assert self.manifest is not None
        cpu = torch.device("cpu")
        specs = {p.name: TensorSpec(p.name, p.entry.dtype, p.entry.shape) for p in self._patches}
        served = {}
        for p in self._patches:
            buffer = target.buffer(specs[p.name], cpu)
            if buffer is None:
                raise NotSupported(
                    f"{p.name}: this engine cannot take a delta in place", code="not_supported"
                )
            served[p.name] = buffer
        self._checks = apply(self._patches, served, self.manifest.encoding)
        for p in self._patches:
            target.accept(specs[p.name], served[p.name], p.entry.target_hash)
        yield None

    def extra(self) -> dict[str, Any]:
        m = self.manifest
        if m is None:
            return {}
        return {
            "delta": {
                "encoding": m.encoding,
                "tensors_changed": self._counts[0],
                "elements_changed": self._counts[1],
                "payload_bytes": self._payload_bytes,
                "base_digest": m.base.digest,
                "target_digest": m.target.digest,
                "checks": self._checks,
            }
        }

    def close(self) -> None:
        self._patches = []
