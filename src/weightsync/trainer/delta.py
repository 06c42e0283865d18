"""Deltas on the trainer's side: compute one between two sets of weights, write it as a delta
checkpoint, and keep the base a fleet last committed.

    from weightsync.trainer import DeltaTrainer

    deltas = DeltaTrainer(model.state_dict(), version="step-0")   # what the fleet committed
    ...train...
    path = deltas.write(model.state_dict(), "/ckpts/delta-1", version="step-1")
    fleet.update_weights_from_delta(path)          # every worker on step-0 takes it
    deltas.committed()                             # step-1 is now the base of the next one

A delta is computed against the *committed* base only: :meth:`DeltaTrainer.write` refuses to
build on a version it wrote but nobody committed (:meth:`DeltaTrainer.committed`), so a
worker is never asked to apply a delta to a base it may not hold.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import attrs
import torch

from weightsync.core.held import weights_digest
from weightsync.trainer.checkpoint import _fsync, checkpoint_tensors, save_checkpoint
from weightsync.transports.delta import linear
from weightsync.transports.delta.apply import bits
from weightsync.transports.delta.manifest import (
    ENCODINGS,
    DeltaManifest,
    Point,
    TensorDelta,
    bad_delta,
)
from weightsync.transports.disk.manifest import DELTA_NAME
from weightsync.transports.hashing import tensor_hash
from weightsync.transports.sink import dtype_name

INDEX_DTYPE: Final = torch.int64
MAX_MANIFEST: Final = 256 << 20


@attrs.frozen
class Fingerprint:
    """What a delta needs of one end per tensor: its xxh3-64 and its linear digest."""

    hashes: Mapping[str, str]
    linears: Mapping[str, tuple[int, ...]]

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor]) -> Fingerprint:
        """A full pass over ``tensors`` (xxh3 and the linear digest of each)."""
        return cls(
            {n: tensor_hash(t) for n, t in tensors.items()},
            {n: tuple(linear.tensor_digest(t)) for n, t in tensors.items()},
        )


def compute_delta(
    base: Mapping[str, torch.Tensor],
    target: Mapping[str, torch.Tensor],
    *,
    base_version: Any = None,
    target_version: Any = None,
    encoding: str = "sparse",
    base_print: Fingerprint | None = None,
    target_print: Fingerprint | None = None,
) -> tuple[DeltaManifest, dict[str, torch.Tensor]]:
    """The manifest and payload of the delta from ``base`` to ``target`` (same names, shapes
    and dtypes; compared by raw bits, so a NaN that stays NaN is unchanged).  Fingerprints
    already computed (the base's, kept from the last commit) may be passed to skip a pass."""
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")
    if set(base) != set(target):
        raise ValueError("base and target name different tensors")
    base_print = base_print or Fingerprint.of(base)
    target_print = target_print or Fingerprint.of(target)
    entries: dict[str, TensorDelta] = {}
    payload: dict[str, torch.Tensor] = {}
    for k, name in enumerate(sorted(base)):
        a = base[name].detach().contiguous().cpu()
        b = target[name].detach().contiguous().cpu()
        if a.dtype != b.dtype or a.shape != b.shape:
            raise ValueError(f"{name}: base is {a.dtype}{list(a.shape)}, target {b.dtype}{list(b.shape)}")
        changed = torch.nonzero(bits(a).reshape(-1) != bits(b).reshape(-1)).reshape(-1).to(INDEX_DTYPE)
        keys: dict[str, str] = {}
        if changed.numel():
            new = b.reshape(-1)[changed]
            values = (
                new
                if encoding == "sparse"
                else torch.bitwise_xor(bits(a.reshape(-1)[changed]), bits(new)).view(new.dtype)
            )
            keys = {"indices": f"{k:06d}.indices", "values": f"{k:06d}.values"}
            payload[keys["indices"]] = changed
            payload[keys["values"]] = values.contiguous()
        entries[name] = TensorDelta(
            name,
            dtype_name(a.dtype),
            tuple(a.shape),
            int(changed.numel()),
            base_print.hashes[name],
            target_print.hashes[name],
            base_print.linears[name],
            target_print.linears[name],
            **keys,
        )
    manifest = DeltaManifest(
        encoding,
        Point(base_version, weights_digest(base_print.hashes)),
        Point(target_version, weights_digest(target_print.hashes)),
        entries,
    )
    return manifest, payload


def save_delta(
    manifest: DeltaManifest, payload: Mapping[str, torch.Tensor], directory: str | os.PathLike[str]
) -> Path:
    """Write a delta checkpoint to ``directory`` atomically (the payload as a checkpoint, then
    ``weightsync-delta.json`` beside it, then one rename); return its path.  Raises
    ``FileExistsError`` when ``directory`` exists."""
    final = Path(directory).absolute()
    if final.exists():
        raise FileExistsError(f"{final} exists")
    tmp = final.parent / f".{final.name}.delta-{uuid.uuid4().hex[:8]}"
    try:
        if payload:
            save_checkpoint(payload, tmp, version=manifest.target.version)
        else:  # nothing changed: a payload of one empty tensor keeps the layout uniform
            save_checkpoint(
                {"empty": torch.zeros(0, dtype=INDEX_DTYPE)}, tmp, version=manifest.target.version
            )
        (tmp / DELTA_NAME).write_text(json.dumps(manifest.to_json(), indent=1))
        _fsync(tmp / DELTA_NAME)
        _fsync(tmp)
        os.replace(tmp, final)
        _fsync(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def delta_between_checkpoints(
    base: str | Path, target: str | Path, out: str | Path, *, encoding: str = "sparse"
) -> Path:
    """``weightsync delta --base DIR --target DIR --out DIR``: the delta between two
    checkpoints (read through the disk channel's checks), labelled with their manifests'
    versions."""
    a, a_version = checkpoint_tensors(base)
    b, b_version = checkpoint_tensors(target)
    manifest, payload = compute_delta(
        a, b, base_version=a_version, target_version=b_version, encoding=encoding
    )
    return save_delta(manifest, payload, out)


def read_delta(directory: str | os.PathLike[str]) -> DeltaManifest:
    """The manifest of the delta checkpoint at ``directory`` (its ``weightsync-delta.json``,
    read here and checked: base and target digests agree with the per-tensor hashes).

    Raises ``InvalidRequest`` (``bad_delta``) when it cannot be read or is not a delta."""
    from weightsync.core.validation import strict_loads

    try:
        with open(Path(directory) / DELTA_NAME, "rb") as f:
            raw = f.read(MAX_MANIFEST + 1)
        if len(raw) > MAX_MANIFEST:
            raise ValueError(f"{DELTA_NAME} is larger than {MAX_MANIFEST} bytes")
        data = strict_loads(raw.decode("utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise bad_delta(f"{str(directory)[:200]}: {str(exc)[:200]}") from None
    return DeltaManifest.from_json(data)


class DeltaTrainer:
    """Deltas against the version a fleet last committed (see the module)."""

    def __init__(self, base: Mapping[str, torch.Tensor], *, version: Any, encoding: str = "sparse") -> None:
        self.encoding = encoding
        self._base = {n: t.detach().clone().cpu() for n, t in base.items()}
        self._base_version = version
        self._base_print = Fingerprint.of(self._base)
        self._pending: tuple[dict[str, torch.Tensor], Any, Fingerprint] | None = None

    @property
    def base_version(self) -> Any:
        return self._base_version

    @property
    def base_digest(self) -> str:
        return weights_digest(self._base_print.hashes)

    def compute(
        self, target: Mapping[str, torch.Tensor], *, version: Any
    ) -> tuple[DeltaManifest, dict[str, torch.Tensor]]:
        """The delta from the committed base to ``target``; it becomes the pending one.
        Raises ``RuntimeError`` while another delta is pending (write, then commit or abandon)."""
        if self._pending is not None:
            raise RuntimeError("the last delta was never committed: call committed() or abandoned() first")
        snapshot = {n: t.detach().clone().cpu() for n, t in target.items()}
        target_print = Fingerprint.of(snapshot)
        manifest, payload = compute_delta(
            self._base,
            snapshot,
            base_version=self._base_version,
            target_version=version,
            encoding=self.encoding,
            base_print=self._base_print,
            target_print=target_print,
        )
        self._pending = (snapshot, version, target_print)
        return manifest, payload

    def write(
        self, target: Mapping[str, torch.Tensor], directory: str | os.PathLike[str], *, version: Any
    ) -> Path:
        """:meth:`compute`, written as a delta checkpoint to ``directory``."""
        manifest, payload = self.compute(target, version=version)
        try:
            return save_delta(manifest, payload, directory)
        except BaseException:
            self._pending = None
            raise

    def committed(self) -> None:
        """The fleet committed the pending delta's target: it is the base from now on."""
        if self._pending is None:
            raise RuntimeError("no delta is pending")
        self._base, self._base_version, self._base_print = self._pending
        self._pending = None

    def abandoned(self) -> None:
        """The pending delta was not committed (rolled back): the base stays."""
        self._pending = None
