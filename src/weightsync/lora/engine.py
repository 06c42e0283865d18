"""What the adapter slots need of an engine: a small protocol, as the base's
:class:`~weightsync.core.engine.Engine` is.

An engine serves adapters through an object of its own, its ``adapters``
(:class:`ServesAdapters`), that is an :class:`AdapterEngine`: ``prepare_adapter`` reads and
verifies an adapter into memory of its own and serves nothing (a refusal there changed
nothing); ``install_adapter`` serves a prepared adapter under a name, all or nothing, the
version it replaces staying for the requests that hold it; ``evict_adapter`` stops serving a
name, its requests finishing with it.  None of them touches the base weights.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from weightsync.core.snapshot import Version


@runtime_checkable
class Prepared(Protocol):
    """A prepared adapter, as the slots read it."""

    path: str
    digest: str
    rank: int
    lora_alpha: float
    target_modules: tuple[str, ...]
    manifest_version: Any
    has_version: bool
    nbytes: int


@runtime_checkable
class AdapterEngine(Protocol):
    """See the module docstring.  Every method raises the :mod:`weightsync.core.errors` family."""

    async def prepare_adapter(self, path: str) -> Prepared: ...

    async def install_adapter(self, name: str, prepared: Any, version: Version, current: bool) -> None: ...

    async def evict_adapter(self, name: str) -> None: ...


@runtime_checkable
class ServesAdapters(Protocol):
    """An engine that serves LoRA adapters beside its base weights."""

    adapters: AdapterEngine
