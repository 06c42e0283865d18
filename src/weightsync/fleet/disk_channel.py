"""Weights from a checkpoint on disk: each worker loads a path (as the worker sees it).

:func:`checkpoint_digest` says, before any worker is touched, which digest the workers
will hold after loading it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from weightsync.fleet.calls import Call, load
from weightsync.fleet.channel import Fan, Loaded, Reply

__all__ = ["DiskChannel", "checkpoint_digest"]


class DiskChannel:
    """Each worker loads a checkpoint path (as the worker sees it)."""

    kind = "disk"
    restores_without_source = False

    def __init__(
        self, paths: Mapping[str, str], label: list[Any] | None = None, relabel: bool = False
    ) -> None:
        self.paths = dict(paths)
        self.label = label
        """``[version]`` the transaction declares: each worker's dry run holds it against the
        checkpoint's manifest (``409 version_mismatch`` unless ``relabel``), before any write."""
        self.relabel = relabel

    def source(self, url: str) -> str | None:
        return self.paths.get(url)

    def expected_digest(self) -> str | None:
        digests = {checkpoint_digest(p) for p in set(self.paths.values())}
        return digests.pop() if len(digests) == 1 else None

    def dry_run(self, url: str) -> Call:
        body: dict[str, Any] = {"model_path": self.paths[url], "dry_run": True}
        if self.label is not None:
            body["weight_version"] = self.label[0]
            if self.relabel:
                body["relabel"] = True
        return Call(url, "update_weights_from_disk", body)

    async def apply(self, urls: Sequence[str], fan: Fan, deadline: float) -> Loaded:
        return await fan(urls, lambda url: load(url, self.paths[url]))

    async def repush(self, url: str, deadline: float) -> Reply:
        raise ValueError("a disk channel restores from a checkpoint path, never by a re-push")


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
