"""Disk transport: validated, streaming safetensors loading (the writer is the trainer's
:func:`weightsync.trainer.save_checkpoint`).  Names load on first use."""

from __future__ import annotations

from typing import TYPE_CHECKING

from weightsync._lazy import lazy_exports

if TYPE_CHECKING:
    from weightsync.transports.disk.checks import DiskCheckpoint
    from weightsync.transports.disk.format import ShardHeader
    from weightsync.transports.disk.manifest import INDEX_NAME, MANIFEST_NAME
    from weightsync.transports.disk.paths import resolve_path

_WHERE = {
    "ShardHeader": ".format", "INDEX_NAME": ".manifest", "MANIFEST_NAME": ".manifest",
    "DiskCheckpoint": ".checks", "resolve_path": ".paths",
}  # fmt: skip
__all__ = ["INDEX_NAME", "MANIFEST_NAME", "DiskCheckpoint", "ShardHeader", "resolve_path"]
__getattr__ = lazy_exports(__name__, _WHERE)
