"""Moved to :mod:`weightsync.trainer.client` (the trainer wing); this old path keeps imports working."""

from __future__ import annotations

from weightsync._lazy import moved_to

__getattr__ = moved_to("weightsync.trainer.client")
