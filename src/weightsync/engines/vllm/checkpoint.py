"""The checkpoint a vLLM engine serves, read by the adapter and by the worker extension alike
(a small module of its own: importing the extension starts its watchdog)."""

from __future__ import annotations

from pathlib import Path

from weightsync.core.snapshot import TensorSpec
from weightsync.transports.disk.checks import DiskCheckpoint


def served_specs(model: str) -> dict[str, TensorSpec]:
    """Names, shapes and dtypes of the checkpoint at ``model`` (a local directory, HF format)."""
    ckpt = DiskCheckpoint.open(str(Path(model).resolve()))
    return {e.spec.name: e.spec for e in ckpt.entries}


def served_hashes(model: str) -> dict[str, str]:
    """xxh3-64 of every tensor of the checkpoint at ``model``, as weightsync hashes a tensor
    everywhere (so their ``weights_digest`` is the trainer's digest of that checkpoint),
    hashed from the files in one bounded read."""
    return DiskCheckpoint.open(str(Path(model).resolve())).verify_checksums()
