"""How a transaction's weights reach the workers: a small seam the driver calls.

A :class:`Channel` dry-runs the update on one worker (validate, write nothing, say the
digest it would hold), applies it to a batch, and reloads a checkpoint for a rollback or a
worker brought back by ``recover``.  :class:`DiskChannel` loads a checkpoint path on each
worker; ``weightsync.fleet.push.PushChannel`` sends one packed broadcast from the trainer.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from weightsync.core.errors import WeightSyncError
from weightsync.trainer.client import AsyncWorkerClient

Reply = dict[str, Any]
Each = Callable[..., Awaitable[tuple[dict[str, Any], dict[str, WeightSyncError]]]]


@runtime_checkable
class Channel(Protocol):
    kind: str

    def source(self, url: str) -> str | None:
        """The path ``url`` loads (``None`` when the weights come another way)."""

    def expected_digest(self) -> str | None:
        """The digest every worker must end on, computed here (``None``: unknown)."""

    async def dry_run(self, client: AsyncWorkerClient, url: str) -> Reply:
        """Validate the update on one worker, writing nothing; the reply has ``digest``."""

    async def apply(
        self, clients: Mapping[str, AsyncWorkerClient], each: Each, deadline: float
    ) -> tuple[dict[str, Reply], dict[str, WeightSyncError]]:
        """Load on every (paused) worker of ``clients``; replies and errors by URL."""

    async def reload(self, client: AsyncWorkerClient, path: str | None) -> Reply:
        """Load the checkpoint at ``path`` (a rollback, or a worker brought back)."""


class DiskChannel:
    """Each worker loads a checkpoint path (as the worker sees it)."""

    kind = "disk"

    def __init__(self, paths: Mapping[str, str]) -> None:
        self.paths = dict(paths)

    def source(self, url: str) -> str | None:
        return self.paths.get(url)

    def expected_digest(self) -> str | None:
        digests = {checkpoint_digest(p) for p in set(self.paths.values())}
        return digests.pop() if len(digests) == 1 else None

    async def dry_run(self, client: AsyncWorkerClient, url: str) -> Reply:
        reply: Reply = await client.update_weights_from_disk(self.paths[url], dry_run=True)
        return reply

    async def apply(
        self, clients: Mapping[str, AsyncWorkerClient], each: Each, deadline: float
    ) -> tuple[dict[str, Reply], dict[str, WeightSyncError]]:
        async def one(url: str) -> Reply:
            reply: Reply = await clients[url].update_weights_from_disk(
                self.paths[url], reset_prefix_cache=True
            )
            return reply

        return await each("applying", list(clients), one, deadline)

    async def reload(self, client: AsyncWorkerClient, path: str | None) -> Reply:
        if path is None:
            raise ValueError("a disk reload needs a path")
        reply: Reply = await client.update_weights_from_disk(path, reset_prefix_cache=True)
        return reply


def checkpoint_digest(path: str) -> str | None:
    """The digest a worker holds after loading the checkpoint at ``path``, computed here.

    Read from the manifest's per-tensor hashes when the writer recorded them (no weight
    byte is read), else hashed from the shards with bounded reads.  ``None`` ("unknown") on
    any failure — the path is not readable here, the checkpoint is refused, the disk
    transport is not installed: the workers' dry runs then say which digest to expect.
    """
    try:
        return _checkpoint_digest(path)
    except Exception:  # unknown is always safe: the dry runs still decide, before any write
        return None


def _checkpoint_digest(path: str) -> str | None:
    from weightsync.core.held import weights_digest
    from weightsync.trainer.checkpoint import checkpoint_hashes

    return weights_digest(checkpoint_hashes(str(Path(path).absolute())))
