"""The LoRA adapters a reference engine serves: what :class:`weightsync.lora.engine.AdapterEngine`
asks of it (:meth:`ReferenceAdapters.prepare_adapter`, :meth:`ReferenceAdapters.install_adapter`,
:meth:`ReferenceAdapters.evict_adapter`), and what a request names by ``model``
(:meth:`ReferenceAdapters.resolve`).

A load is two steps with nothing served in between: :meth:`ReferenceAdapters.prepare_adapter`
reads and verifies the adapter (:func:`~weightsync.transports.adapters.reader.read_adapter`) and
casts its raw matrices to the model's dtype, into memory of its own;
:meth:`ReferenceAdapters.install_adapter` then serves it under its name in one assignment.  A failed prepare changed nothing; the base
weights are never touched by either.

Replacing or unloading a name never frees a version that requests hold: each request holds
the :class:`~.lora_batch.StagedAdapter` it started with until it ends, and the version is
dropped when the last one does (:meth:`ReferenceAdapters.draining` lists those still held).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from weightsync.core.errors import NotFound, NotSupported
from weightsync.core.snapshot import Version
from weightsync.engines.reference.lora_batch import PreparedAdapter, StagedAdapter
from weightsync.transports.adapters.checks import ModuleShapes
from weightsync.transports.adapters.reader import read_adapter


def adapter_not_found(name: str) -> NotFound:
    return NotFound(f"no LoRA adapter {name[:200]!r} is loaded", code="adapter_not_found", field="model")


class ReferenceAdapters:
    """See the module docstring.  ``modules``: the model's linear modules an adapter may target
    (``None``: this engine serves no adapters, as with tensor parallelism); ``dtype``: the
    model's; ``allowed_roots``: where adapters may be read from (``None``: anywhere)."""

    def __init__(
        self, modules: ModuleShapes | None, dtype: torch.dtype, allowed_roots: Sequence[str | Path] | None
    ) -> None:
        self.modules = modules
        self.dtype = dtype
        self.allowed_roots = allowed_roots
        self.served: dict[str, StagedAdapter] = {}
        self._retired: list[StagedAdapter] = []

    async def prepare_adapter(self, path: str) -> PreparedAdapter:
        """The verified adapter at ``path``, staged in the model's dtype and served nowhere (read
        off the event loop).  Raises ``NotSupported`` on an engine without adapters and the 4xx
        refusals of :func:`~weightsync.transports.adapters.reader.read_adapter`."""
        return await asyncio.to_thread(self._prepare, path)

    def _prepare(self, path: str) -> PreparedAdapter:
        if self.modules is None:
            raise NotSupported(
                "a tensor-parallel reference worker serves no LoRA adapters (yet)", code="not_supported"
            )
        adapter = read_adapter(path, self.modules, self.allowed_roots)
        matrices = {
            module: (a.to(self.dtype).contiguous(), b.to(self.dtype).contiguous())
            for module, (a, b) in adapter.matrices.items()
        }
        c = adapter.config
        return PreparedAdapter(
            path=path,
            digest=adapter.digest,
            scale=c.scale,
            matrices=matrices,
            rank=c.r,
            lora_alpha=c.lora_alpha,
            target_modules=c.target_modules,
            manifest_version=adapter.manifest_version,
            has_version=adapter.has_version,
            nbytes=adapter.nbytes,
        )

    async def install_adapter(
        self, name: str, prepared: PreparedAdapter, version: Version, current: bool
    ) -> None:
        """Serve ``prepared`` under ``name`` as ``version`` (``current``: declared for these
        bytes); the version it replaces stays for the requests that hold it."""
        staged = StagedAdapter(name, prepared, version, current)
        self._retire(self.served.get(name))
        self.served[name] = staged

    async def evict_adapter(self, name: str) -> None:
        """Stop serving ``name`` (requests that hold it finish with it).  ``NotFound``
        (``adapter_not_found``) when it is not served."""
        staged = self.served.pop(name, None)
        if staged is None:
            raise adapter_not_found(name)
        self._retire(staged)

    def resolve(self, name: str) -> StagedAdapter:
        """The adapter served as ``name`` now; ``NotFound`` (``adapter_not_found``) for none."""
        staged = self.served.get(name)
        if staged is None:
            raise adapter_not_found(name)
        return staged

    def draining(self) -> list[StagedAdapter]:
        """Versions no longer served that requests still hold (each goes when they end)."""
        self._retired = [s for s in self._retired if s.users > 0]
        return list(self._retired)

    def _retire(self, staged: StagedAdapter | None) -> None:
        if staged is not None and staged.users > 0:
            self._retired.append(staged)
        self.draining()

    def listing(self) -> list[dict[str, Any]]:
        """Every served adapter and every draining version: name, version, digest, holders."""
        rows = [(s, "resident") for s in self.served.values()] + [(s, "draining") for s in self.draining()]
        return [
            {**s.stamp.to_reply(), "state": state, "requests": s.users, "rank": s.prepared.rank}
            for s, state in rows
        ]
