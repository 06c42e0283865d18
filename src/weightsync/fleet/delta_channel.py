"""Weights from a delta checkpoint: each worker applies a delta to the exact base it names.

A transaction from a delta runs as one from disk: prepare is a dry run of
``update_weights_from_delta`` on every worker (the worker checks it holds the delta's base —
digest, declared version, names, shapes, dtypes — and the whole payload, and writes nothing;
its reply's digest is the target's), apply applies it, verify holds every worker to the
target's digest (read here, from the delta's manifest, before any worker is touched), commit
declares the target's version.

A worker whose apply failed either put its base back (the reply says ``details.undone``) or
is torn; either way the rollback takes every touched worker back to the base the way every
rollback does: the base's full checkpoint, the one the journal committed (or
``--initial-source``) — a worker still on the base is left alone.  The committed delta is
recorded in the journal (:class:`~weightsync.fleet.records.DeltaRecord`): a link of the
chain that catch-up (:mod:`weightsync.fleet.catchup`) follows.

>>> result = await delta_transaction(coordinator, "/ckpts/delta-7")
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from weightsync.core.errors import InvalidRequest
from weightsync.fleet.calls import Call
from weightsync.fleet.channel import Fan, Loaded, Reply
from weightsync.fleet.records import DeltaRecord
from weightsync.fleet.urls import check_absolute, worker_url

if TYPE_CHECKING:
    import os

    import torch

    from weightsync.fleet.result import TransactionResult
    from weightsync.trainer.delta import DeltaTrainer

__all__ = ["DeltaChannel", "apply_delta", "delta_record", "delta_transaction"]


def apply_delta(url: str, path: str) -> Call:
    """Apply the delta checkpoint at ``path`` (as ``url`` sees it), with a fresh prefix cache
    and no version: the label changes only at a commit."""
    return Call(url, "update_weights_from_delta", {"delta_path": path, "reset_prefix_cache": True})


class DeltaChannel:
    """Each worker applies the delta of ``record`` (its own path to it)."""

    kind = "delta"
    restores_without_source = False

    def __init__(self, record: DeltaRecord) -> None:
        self.record = record

    def source(self, url: str) -> str | None:
        return None  # a delta is no full checkpoint: a rollback never reloads it

    def expected_digest(self) -> str | None:
        return self.record.target_digest

    def dry_run(self, url: str) -> Call:
        path = self.record.paths[url]
        return Call(url, "update_weights_from_delta", {"delta_path": path, "dry_run": True})

    async def apply(self, urls: Sequence[str], fan: Fan, deadline: float) -> Loaded:
        return await fan(urls, lambda url: apply_delta(url, self.record.paths[url]))

    async def repush(self, url: str, deadline: float) -> Reply:
        raise ValueError("a delta channel restores from a checkpoint path, never by a re-push")


def delta_record(workers: Sequence[str], source: str | Mapping[str, str], version: Any = None) -> DeltaRecord:
    """The :class:`DeltaRecord` of the delta at ``source`` (one path, or one per worker;
    absolute, as the workers see it), its manifest read here (from the first worker's path).

    ``version``: the version to commit; it must be the delta's target version (a later delta
    names it as its base), ``None`` takes it.  Raises ``InvalidRequest``: ``bad_delta`` when
    the manifest cannot be read here or is not a delta, ``invalid_value`` for a relative path
    or another version, ``bad_source`` for a mapping that does not name exactly ``workers``.
    """
    from weightsync.core.snapshot import json_problem
    from weightsync.trainer.delta import read_delta

    if isinstance(source, str):
        paths = dict.fromkeys(workers, source)
    else:
        paths = {worker_url(u): p for u, p in source.items()}
        if set(paths) != set(workers):
            raise InvalidRequest(
                "a per-worker source must name exactly the fleet's workers", code="bad_source"
            )
    check_absolute(paths, "delta")
    manifest = read_delta(paths[workers[0]])
    if version is not None and _canonical(version) != _canonical(manifest.target.version):
        raise InvalidRequest(
            f"version {version!r} is not the delta's target version {manifest.target.version!r}: "
            "the next delta names the committed version as its base; leave --version out",
            code="invalid_value",
        )
    if json_problem(manifest.target.version) is not None:
        raise InvalidRequest("the delta's target version is not a storable JSON value", code="bad_delta")
    base, target = manifest.base, manifest.target
    return DeltaRecord(base.version, base.digest, target.version, target.digest, paths)


def _canonical(value: Any) -> str:
    import json

    return json.dumps(value, sort_keys=True, separators=(",", ":"))


async def delta_transaction(
    coordinator: Any,  # a FleetCoordinator (it imports this module)
    source: str | Mapping[str, str] | None,
    version: Any = None,
    *,
    trainer: DeltaTrainer | None = None,
    target: Mapping[str, torch.Tensor] | None = None,
    directory: str | os.PathLike[str] | None = None,
    **options: Any,
) -> TransactionResult:
    """Run one fleet transaction from the delta checkpoint at ``source`` (see
    :func:`delta_record`); ``options`` are :meth:`FleetCoordinator.run`'s.

    With a ``trainer`` (a :class:`~weightsync.trainer.delta.DeltaTrainer` whose base is the
    fleet's committed version), ``target`` and ``directory``, the delta is first written there
    by ``trainer.write`` (``source`` is then ``None`` or the path as the workers see it), and
    the trainer is told the outcome: ``committed()`` when the fleet committed it (every worker,
    or a fence's quorum), ``abandoned()`` otherwise.  Returns the :class:`TransactionResult`;
    raises as :func:`delta_record` and :meth:`FleetCoordinator.run` do.
    """
    if trainer is None:
        if source is None:
            raise InvalidRequest(
                "name the delta checkpoint (or pass a trainer to write one)", code="invalid_value"
            )
        record = delta_record(coordinator.workers, source, version)
        return await coordinator.run(DeltaChannel(record), record.target_version, **options)
    if target is None or directory is None:
        raise InvalidRequest("a trainer needs the target weights and a directory", code="invalid_value")
    written = str(trainer.write(target, directory, version=version))
    try:
        record = delta_record(coordinator.workers, source or written)
        result = await coordinator.run(DeltaChannel(record), record.target_version, **options)
    except BaseException:
        trainer.abandoned()
        raise
    if result.committed:
        trainer.committed()
    else:
        trainer.abandoned()
    return result
