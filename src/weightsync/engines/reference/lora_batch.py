"""LoRA in the reference engine's forward pass: a staged adapter, and a batch's rows grouped by
the adapter each uses.

A :class:`StagedAdapter` holds an adapter's raw matrices (cast to the model's dtype) and its
scale, apart: ``lora_alpha / r`` is never folded into A or B, so nothing can apply it twice.
:meth:`LoraBatch.apply` adds ``(x Aᵀ) Bᵀ · scale`` to a target module's output, for the rows of
the batch whose sequence uses that adapter; rows of other adapters, and of none, are
untouched.  Numerically this is the merged weight ``W + scale · B A`` applied to those rows.

Every request that uses a staged adapter holds it (:meth:`StagedAdapter.acquire`) until it
finishes, so the version a request started with is the version it ends with, even when its
name was loaded again or unloaded meanwhile (vLLM's and TRL's eviction lose it: trl#7017).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from weightsync.core.snapshot import UNDECLARED, Declared, Version
from weightsync.engines.stamps import AdapterStamp


@attrs.frozen(eq=False)
class PreparedAdapter:
    """A verified adapter, staged for a model (matrices in its dtype), not yet served: what a
    load has before it installs anything."""

    path: str
    digest: str
    scale: float
    matrices: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    rank: int
    lora_alpha: float
    target_modules: tuple[str, ...]
    manifest_version: Any
    has_version: bool
    nbytes: int


@attrs.define(eq=False)
class StagedAdapter:
    """A :class:`PreparedAdapter` served under ``name`` as ``version`` (``current``: whether that
    label was declared for these bytes), with how many requests hold it."""

    name: str
    prepared: PreparedAdapter
    version: Version = UNDECLARED
    current: bool = False
    users: int = 0
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False, repr=False)

    @property
    def digest(self) -> str:
        return self.prepared.digest

    @property
    def stamp(self) -> AdapterStamp:
        """How completions that used this adapter name it."""
        declared = isinstance(self.version, Declared)
        value = self.version.value if isinstance(self.version, Declared) else None
        return AdapterStamp(self.name, value, declared, self.current and declared, self.digest)

    def acquire(self) -> None:
        with self._lock:
            self.users += 1

    def release(self) -> None:
        with self._lock:
            self.users -= 1


class LoraBatch:
    """The rows of one forward pass grouped by the adapter their sequence uses (``None``: the
    base alone)."""

    def __init__(self, adapters: Sequence[StagedAdapter | None]) -> None:
        groups: dict[int, tuple[list[int], StagedAdapter]] = {}
        for row, adapter in enumerate(adapters):
            if adapter is not None:
                groups.setdefault(id(adapter), ([], adapter))[0].append(row)
        every = len(adapters)
        self.groups = [
            (None if len(rows) == every else torch.tensor(rows), adapter) for rows, adapter in groups.values()
        ]

    @classmethod
    def of(cls, adapters: Sequence[StagedAdapter | None]) -> LoraBatch | None:
        """The batch, or ``None`` when no row uses an adapter (the base's own forward)."""
        return cls(adapters) if any(a is not None for a in adapters) else None

    def apply(self, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (``module``'s output for input ``x``, rows first) with each adapter's
        ``scale · (x Aᵀ) Bᵀ`` added on its rows."""
        for rows, adapter in self.groups:
            pair = adapter.prepared.matrices.get(module)
            if pair is None:
                continue
            a, b = pair
            scale = adapter.prepared.scale
            if rows is None:
                y = y + (x @ a.T) @ b.T * scale
            else:
                y = y.index_add(0, rows, (x[rows] @ a.T) @ b.T * scale)
        return y
