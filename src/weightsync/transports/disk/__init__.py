"""Disk transport: validated, streaming safetensors loading (the writer is the trainer's
:func:`weightsync.trainer.save_checkpoint`).  Names load on first use."""

from __future__ import annotations

from typing import TYPE_CHECKING

from weightsync._lazy import lazy_dir, lazy_package

if TYPE_CHECKING:
    from weightsync.transports.disk.checks import DiskCheckpoint as DiskCheckpoint
    from weightsync.transports.disk.format import ShardHeader as ShardHeader
    from weightsync.transports.disk.manifest import INDEX_NAME as INDEX_NAME
    from weightsync.transports.disk.manifest import MANIFEST_NAME as MANIFEST_NAME
    from weightsync.transports.disk.paths import resolve_path as resolve_path

__all__, __getattr__ = lazy_package(
    __name__,
    {
        "INDEX_NAME": ".manifest",
        "MANIFEST_NAME": ".manifest",
        "DiskCheckpoint": ".checks",
        "ShardHeader": ".format",
        "resolve_path": ".paths",
    },
)
__dir__ = lazy_dir(globals(), __all__)
