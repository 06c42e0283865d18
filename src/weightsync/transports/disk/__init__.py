"""Disk transport: validated, streaming safetensors loading and an atomic writer."""

from __future__ import annotations

from .format import ShardHeader
from .reader import INDEX_NAME, MANIFEST_NAME, DiskCheckpoint, load_checkpoint, resolve_path
from .writer import save_checkpoint

__all__ = [
    "INDEX_NAME", "MANIFEST_NAME", "DiskCheckpoint", "ShardHeader", "load_checkpoint",
    "resolve_path", "save_checkpoint",
]  # fmt: skip
