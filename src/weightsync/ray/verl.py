"""verl's checkpoint engine, done by weightsync: the backend ``weightsync``.

verl moves weights from its trainer ranks to its rollout through a *checkpoint engine*
(``verl.checkpoint_engine``: ``CheckpointEngine``, ``CheckpointEngineRegistry``), chosen by
``actor_rollout_ref.rollout.checkpoint_engine.backend``.  :func:`register` adds this
backend under the name ``weightsync``; importing :mod:`weightsync.ray.verl_plugin` calls it
(verl's ``custom_backend_module``, and the ``verl.plugins`` entry point weightsync declares,
which ``import verl`` loads).  Then the one setting ``checkpoint_engine.backend=weightsync``,
with ``engine_kwargs.weightsync`` naming the fleet, switches a verl job to weightsync's
update::

    actor_rollout_ref.rollout.checkpoint_engine.backend=weightsync
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.weightsync.workers=[worker-0,worker-1]
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.weightsync.namespace=rl
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.weightsync.journal=/shared/fleet.db

What it does in verl's sequence (``CheckpointEngineManager.update_weights``): ``prepare``
and ``build_topology`` make the trainer's rank 0 the only sender; ``send_weights`` on rank
0 gathers the trainer's tensors and runs **one** :class:`~weightsync.ray.RayFleet`
transaction over the weightsync worker actors (``WorkerActor``) — a push over the fleet's
own group (``transfer="push"``), or a checkpoint written to a shared directory and loaded
by every worker (``transfer="disk"``) — so the version ``step-<global_steps>`` commits on
every worker or on none, verified by digest.  The other trainer ranks walk their generator
(producing each tensor is collective over the trainer's group) and send nothing; verl's
rollout-side engines receive nothing (the weights reach the weightsync workers through the
transaction).  A transaction that does not commit raises ``IllegalState``
(``transaction_not_committed``) from ``send_weights``, so verl's step fails rather than
going on beside workers on another version.

verl is imported only by :func:`register` and :func:`engine_class`: weightsync works, and
this module imports, without it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from weightsync.core.errors import IllegalState, InvalidRequest

if TYPE_CHECKING:
    import torch

    from weightsync.ray.fleet import RayFleet
    from weightsync.trainer import Broadcaster

__all__ = ["NAME", "WeightSyncEngine", "engine_class", "register"]

NAME: Final = "weightsync"
"""The backend's name in verl's registry: ``checkpoint_engine.backend=weightsync``."""

TRANSFERS: Final = ("push", "disk")

_CLASSES: dict[type, type] = {}


def _verl_base() -> tuple[Any, type]:
    """verl's ``CheckpointEngineRegistry`` and ``CheckpointEngine``; raises ``InvalidRequest``
    (``missing_extra``) when verl cannot be imported."""
    try:
        from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry
    except ImportError as exc:
        raise InvalidRequest(
            f"the verl backend needs verl (verl.checkpoint_engine), which cannot be imported here: {exc}",
            code="missing_extra",
        ) from exc
    return CheckpointEngineRegistry, CheckpointEngine


def engine_class(base: type | None = None) -> type:
    """The backend's class: :class:`WeightSyncEngine` as a subclass of verl's abstract
    ``CheckpointEngine`` (or of ``base``), made once per base.  Raises as :func:`register`."""
    if base is None:
        base = _verl_base()[1]
    if base not in _CLASSES:
        _CLASSES[base] = type(
            "WeightSyncCheckpointEngine",
            (WeightSyncEngine, base),
            {"__module__": __name__, "__doc__": WeightSyncEngine.__doc__},
        )
    return _CLASSES[base]


def register(name: str = NAME, *, registry: Any = None, base: type | None = None) -> type:
    """Register the backend in verl's ``CheckpointEngineRegistry`` under ``name``, as verl's
    own backends register (``@CheckpointEngineRegistry.register(name)``); return its class.
    ``registry`` and ``base`` default to verl's.  Registering again replaces the entry, as in
    verl.  Raises ``InvalidRequest`` (``missing_extra``) when verl cannot be imported, and
    (``invalid_value``) for an empty ``name``; nothing is registered then."""
    if not isinstance(name, str) or not name:
        raise InvalidRequest("the backend's name is a non-empty string", code="invalid_value", field="name")
    if registry is None or base is None:
        verl_registry, verl_base = _verl_base()
        registry = verl_registry if registry is None else registry
        base = verl_base if base is None else base
    cls = engine_class(base)
    registry.register(name)(cls)
    return cls


def _fail(message: str, field: str) -> InvalidRequest:
    return InvalidRequest(
        f"checkpoint_engine.engine_kwargs.weightsync: {message}", code="invalid_value", field=field
    )


class WeightSyncEngine:
    """verl's checkpoint-engine interface, done by a weightsync fleet transaction (see the
    module docstring).  verl builds it as ``CheckpointEngineRegistry.new("weightsync",
    bucket_size=…, is_master=…, **engine_kwargs["weightsync"])``.

    ``workers``: the weightsync worker actors' names (in ``namespace``), or handles.
    ``journal``: the fleet's journal, a path every node that may run the trainer's rank 0
    sees.  ``transfer``: ``"push"`` (the trainer's group with the workers, ``group_backend``
    ``"nccl"`` or ``"gloo"``, by default ``"nccl"`` where CUDA is available) or ``"disk"`` (a
    checkpoint of shards of at most ``bucket_size`` bytes under ``checkpoint_dir``, a
    directory every worker reads and allows).  ``version_format`` makes the version from
    ``global_steps``.  ``restore_last``: keep a host copy of the last committed push, so a
    failed push rolls the workers it wrote back (without it they stay paused until the next
    commit).  ``fleet``: more :class:`~weightsync.ray.RayFleet` keywords (``policy``,
    ``initial_source``, ``lease_s`` …).  Raises ``InvalidRequest`` (``invalid_value``) for a
    bad argument, on every rank, before anything is sent.
    """

    wire_format = "named_tensors"

    def __init__(
        self,
        bucket_size: int,
        is_master: bool = False,
        *,
        workers: Sequence[Any] = (),
        namespace: str | None = None,
        journal: str | None = None,
        transfer: str = "push",
        checkpoint_dir: str | None = None,
        group_backend: str | None = None,
        version_format: str = "step-{global_steps}",
        restore_last: bool = False,
        timeout_s: float = 600.0,
        fleet: Mapping[str, Any] | None = None,
    ) -> None:
        if type(bucket_size) is not int or bucket_size <= 0:
            raise _fail("bucket_size must be a positive integer", "bucket_size")
        if isinstance(workers, str) or not workers:
            raise _fail("workers must list the weightsync worker actors (names or handles)", "workers")
        if transfer not in TRANSFERS:
            raise _fail(f"transfer must be one of {list(TRANSFERS)}, got {transfer!r}", "transfer")
        if transfer == "disk" and not checkpoint_dir:
            raise _fail(
                'transfer "disk" needs checkpoint_dir, a directory every worker reads', "checkpoint_dir"
            )
        if group_backend not in (None, "nccl", "gloo"):
            raise _fail(f'group_backend must be "nccl" or "gloo", got {group_backend!r}', "group_backend")
        try:
            version_format.format(global_steps=0)
        except (AttributeError, KeyError, IndexError, ValueError) as exc:
            raise _fail(f"version_format must format with {{global_steps}}: {exc}", "version_format") from exc
        if fleet is not None and not isinstance(fleet, Mapping):
            raise _fail("fleet must be a mapping of RayFleet keywords", "fleet")
        self.bucket_size = bucket_size
        self.is_master = bool(is_master)
        self.workers = list(workers)
        self.namespace = namespace
        self.journal = journal
        self.transfer = transfer
        self.checkpoint_dir = checkpoint_dir
        self.group_backend = group_backend
        self.version_format = version_format
        self.restore_last = restore_last
        self.timeout_s = timeout_s
        self.fleet_options = dict(fleet or {})
        self.rank: int | None = None
        self.sends = 0
        self.last_result: Any = None
        self._fleet: RayFleet | None = None
        self._broadcaster: Broadcaster | None = None
        self._last: dict[str, torch.Tensor] | None = None

    # -------------------------------------------------------------- verl's topology calls

    def prepare(self) -> dict[str, Any]:
        """Before each update: nothing to allocate (the fleet's group carries the tensors);
        the metadata says whether this is the trainer's rank 0."""
        return {"is_master": self.is_master}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """The trainer's rank 0 sends (rank 0), every other trainer rank and every rollout
        engine sits out (rank -1): the weightsync group is formed by rank 0's broadcaster with
        the worker actors, not by verl.  Raises ``InvalidRequest`` (``no_master``) when the
        first metadata is not the trainer's rank 0's."""
        if not metadata or not isinstance(metadata[0], Mapping) or not metadata[0].get("is_master"):
            raise InvalidRequest(
                "the trainer's rank 0 must be the weightsync engine's master", code="no_master"
            )
        actor = {"rank": [0] + [-1] * (actor_wg_world_size - 1)}
        rollout = {"rank": [-1] * rollout_world_size}
        return actor, rollout

    def init_process_group(self, rank: int, **kwargs: Any) -> None:
        """Note this engine's rank from :meth:`build_topology`; the group with the workers
        forms on the first send (and again after a failed one)."""
        self.rank = rank

    def finalize(self) -> None:
        """After each update: nothing to free; the group with the workers stays for the next
        step (as verl's NCCL engine keeps its group unless told to rebuild it)."""

    # -------------------------------------------------------------- the update

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, Any]:
        """On the trainer's rank 0: one fleet transaction of ``weights`` (an iterable or async
        iterable of ``(name, tensor)``) under ``version_format.format(global_steps=…)`` (a
        count of sends when ``global_steps`` is None); return its figures for verl's metrics.
        On every other rank: walk ``weights`` and return ``{}``.  Raises ``IllegalState``
        (``transaction_not_committed``, with the result's ``phase`` and ``txn``) when the
        version did not commit."""
        self.sends += 1
        if not (self.is_master and self.rank in (None, 0)):
            async for _ in _pairs(weights):
                pass
            return {}
        tensors = {name: tensor async for name, tensor in _pairs(weights)}
        version = self.version_format.format(
            global_steps=self.sends if global_steps is None else global_steps
        )
        started = time.monotonic()
        if self.transfer == "disk":
            result = await self._disk(tensors, version)
        else:
            result = await self._push(tensors, version)
        self.last_result = result
        if not result.ok:
            raise IllegalState(
                f"weightsync: version {version!r} did not commit ({result.phase}"
                f"{': ' + result.message if result.message else ''}); the fleet is where the result says: "
                f"{result.fleet}",
                code="transaction_not_committed",
                phase=result.phase,
                txn=result.txn,
                version=version,
            )
        return {
            "weightsync/epoch": result.epoch,
            "weightsync/txn": result.txn,
            "weightsync/workers_committed": sum(w.outcome == "committed" for w in result.workers),
            "weightsync/seconds": time.monotonic() - started,
        }

    async def receive_weights(
        self, global_steps: int | None = None
    ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """On verl's rollout side: nothing arrives here (the weightsync workers received the
        weights in the transaction), so verl's server adapter is handed no tensors."""
        return
        yield  # an async generator, as verl's engines' receive_weights are

    # -------------------------------------------------------------- helpers

    def fleet(self) -> RayFleet:
        """The :class:`~weightsync.ray.RayFleet` over ``workers`` (made once, on rank 0)."""
        if self._fleet is None:
            from weightsync.ray.fleet import RayFleet

            self._fleet = RayFleet(
                self.workers, namespace=self.namespace, journal=self.journal, **self.fleet_options
            )
        return self._fleet

    async def _push(self, tensors: dict[str, torch.Tensor], version: str) -> Any:
        fleet = self.fleet()
        if self._broadcaster is None:
            import torch

            backend = self.group_backend or ("nccl" if torch.cuda.is_available() else "gloo")
            broadcaster = fleet.broadcaster(backend=backend, timeout_s=self.timeout_s)
            await broadcaster.aconnect()
            self._broadcaster = broadcaster
        result = await fleet.push(self._broadcaster, tensors, version, restore=self._last)
        if result.ok and self.restore_last:
            self._last = {n: t.detach().to("cpu", copy=True) for n, t in tensors.items()}
        if not result.ok:  # a member may be gone: the next send forms the group again
            await self.close()
        return result

    async def _disk(self, tensors: dict[str, torch.Tensor], version: str) -> Any:
        import asyncio

        from weightsync.trainer import save_checkpoint

        where = Path(str(self.checkpoint_dir)) / version
        path = await asyncio.to_thread(
            save_checkpoint,
            {n: t.detach().cpu() for n, t in tensors.items()},
            where,
            version=version,
            shard_bytes=self.bucket_size,
            overwrite=True,
        )
        return await self.fleet().update(str(path), version)

    async def close(self) -> None:
        """Leave the group with the workers (the next send forms it again)."""
        broadcaster, self._broadcaster = self._broadcaster, None
        if broadcaster is not None:  # a member that died cannot be told; the group is gone either way
            with contextlib.suppress(Exception):
                await broadcaster.aclose()


async def _pairs(
    weights: Iterable[tuple[str, Any]] | AsyncIterable[tuple[str, Any]],
) -> AsyncIterator[tuple[str, Any]]:
    """``weights`` as an async iterator of pairs (verl hands either kind)."""
    if isinstance(weights, AsyncIterable):
        async for pair in weights:
            yield pair
    else:
        for pair in weights:
            yield pair
