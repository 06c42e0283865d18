"""Tensor transport: a colocated trainer shares tensors through shared memory."""

from __future__ import annotations

from .shm import SharedTensors, load_shared, share_tensors

__all__ = ["SharedTensors", "load_shared", "share_tensors"]
