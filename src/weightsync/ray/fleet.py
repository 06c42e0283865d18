"""Fleet transactions over worker actors: :class:`RayFleet`.

>>> fleet = RayFleet(["worker-0", "worker-1"], namespace="rl", journal="/shared/fleet.db",
...                  initial_source="/shared/ckpt/step-0")
>>> result = fleet.update_sync("/shared/ckpt/step-3", version="step-3")
>>> result.ok, result.epoch, [w.outcome for w in result.workers]

A :class:`~weightsync.fleet.FleetCoordinator` runs the transactions — the same decider,
journal, epochs, digests, results and progress lines — with its worker clients' transport
replaced by :class:`~weightsync.ray.transport.ActorTransport`: each call is a method call on
the actor, bounded by the phase's deadline, and an actor that died or did not answer is the
same outcome as an HTTP worker that is unreachable or did not answer.

Transactions run from a checkpoint (:meth:`RayFleet.update`), from a trainer's push
(:meth:`RayFleet.push`, with a :meth:`RayFleet.broadcaster` in the process that holds the
weights), or over any channel (:meth:`RayFleet.run`); :meth:`RayFleet.admit` brings an
actor Ray restarted (or any actor behind the fleet) onto the committed version.

The journal is a SQLite file (as for HTTP fleets), on a path every node that may run the
driver sees (a shared filesystem): a driver that dies mid-transaction leaves the journal
behind, and a new driver, on any node, recovers from it.  Only one driver writes it at a
time (the journal's lease), so SQLite's locking on the shared file is never contended in
the normal course.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeVar

import attrs
import ray
from ray.actor import ActorHandle

from weightsync.core.errors import IllegalState, InvalidRequest
from weightsync.fleet import FleetCoordinator, Journal
from weightsync.fleet.channel import Channel
from weightsync.fleet.result import RAY_STEPS, Advice, TransactionResult, WorkerStatus
from weightsync.fleet.urls import worker_url
from weightsync.ray.transport import ActorRef, ActorTransport

if TYPE_CHECKING:
    import torch

    from weightsync.fleet.admission import Admission
    from weightsync.trainer import Broadcaster

T = TypeVar("T")

__all__ = ["RayFleet", "Worker"]

LEASE_POLL_S: Final = 0.5
"""How often :meth:`RayFleet.recover` asks again for a journal another driver holds."""

Worker = ActorHandle | str | ActorRef
"""A worker actor: its handle, its name (in the fleet's ``namespace``), or an :class:`ActorRef`."""


def _ref(worker: Any, namespace: str | None) -> ActorRef:
    if isinstance(worker, ActorRef):
        return worker
    if isinstance(worker, ActorHandle):
        return ActorRef(handle=worker)
    if isinstance(worker, str):
        return ActorRef(name=worker, namespace=namespace)
    raise InvalidRequest(
        f"a worker is an actor handle or an actor's name, not {type(worker).__name__}", code="bad_worker"
    )


class RayFleet:
    """:class:`~weightsync.fleet.FleetCoordinator`'s transactions over worker actors (see the
    module docstring).

    ``workers``: actor handles, names (looked up in ``namespace``, again after an actor
    died, so one restarted under its name is reached) or :class:`ActorRef` values (one may
    give the URL that stands for the worker: its HTTP app's, when a router fronts it).  Name
    the workers to recover from another driver: a named worker's URL in the journal is its
    name, a handle's its actor id.  :attr:`transport` is the httpx transport that calls the
    actors (a :class:`~weightsync.trainer.ShardedPusher`'s ``transport``).  Every other keyword is :class:`~weightsync.fleet.FleetCoordinator`'s (``journal``,
    ``initial_source``, ``on_event``, ``lease_s`` …) but ``api_key`` and ``transport``.
    Raises ``InvalidRequest`` as the coordinator does, and ``bad_worker`` for a worker that
    is neither a handle nor a usable name.
    """

    def __init__(
        self,
        workers: Sequence[Worker],
        *,
        namespace: str | None = None,
        journal: Journal | str | Path | None = None,
        **options: Any,
    ) -> None:
        if isinstance(workers, str):
            raise InvalidRequest("workers is a list of actors or names, not one string", code="invalid_value")
        for taken in ("api_key", "transport"):
            if taken in options:
                raise InvalidRequest(f"a RayFleet calls actors: no {taken}", code="invalid_value")
        refs = [_ref(w, namespace) for w in workers]
        self.refs = {r.url: r for r in refs}
        self.transport = ActorTransport(self.refs)
        self.coordinator = FleetCoordinator(
            [r.url for r in refs], journal=journal, transport=self.transport, **options
        )

    @property
    def workers(self) -> list[str]:
        """The workers' URLs, in order (the names results and the journal use)."""
        return self.coordinator.workers

    @property
    def journal(self) -> Journal:
        return self.coordinator.journal

    async def update(self, source: str | dict[str, str], version: Any, **options: Any) -> TransactionResult:
        """One transaction from a checkpoint (a path every worker sees, or one per worker
        URL): :meth:`FleetCoordinator.update <weightsync.fleet.FleetCoordinator.update>`."""
        return _ray(await self.coordinator.update(source, version, **options))

    def update_sync(self, source: str | dict[str, str], version: Any, **options: Any) -> TransactionResult:
        """:meth:`update` from blocking code."""
        return asyncio.run(self.update(source, version, **options))

    async def run(self, channel: Channel, version: Any, **options: Any) -> TransactionResult:
        """One transaction over ``channel``: :meth:`FleetCoordinator.run
        <weightsync.fleet.FleetCoordinator.run>`."""
        return _ray(await self.coordinator.run(channel, version, **options))

    def broadcaster(self, **options: Any) -> Broadcaster:
        """A :class:`~weightsync.trainer.Broadcaster` over this fleet's worker actors, for
        :meth:`push`: its admin calls go to the actors (this fleet's transport), the group
        forms over torch.distributed as always.  Make it in the process that holds the
        weights (the trainer's rank-0 actor), and connect it there.

        ``options`` are the broadcaster's (``backend``, ``master_port`` …) but ``transport``;
        ``master_address`` defaults to this node's address (``ray.util.get_node_ip_address``),
        which the worker actors on every node reach.  Raises ``InvalidRequest`` for a
        ``transport``."""
        from weightsync.trainer import Broadcaster

        if "transport" in options:
            raise InvalidRequest(
                "a RayFleet's broadcaster calls its actors: no transport", code="invalid_value"
            )
        options.setdefault("master_address", ray.util.get_node_ip_address())
        return Broadcaster(self.workers, transport=self.transport, **options)

    async def push(
        self,
        broadcaster: Broadcaster,
        tensors: Mapping[str, torch.Tensor],
        version: Any,
        *,
        restore: Mapping[str, torch.Tensor] | None = None,
        **options: Any,
    ) -> TransactionResult:
        """One transaction whose weights ``tensors`` come from ``broadcaster`` (connected,
        over exactly this fleet's workers: :meth:`broadcaster` makes one): prepare dry-runs
        the stream's metadata on every actor, apply is one packed push to the group, verify
        compares every actor's digest with the digest of ``tensors``, commit is as for disk.
        A rollback reloads each actor's last committed checkpoint (or ``initial_source``),
        else re-pushes ``restore``.  ``options`` are :meth:`run`'s.

        Returns the :class:`TransactionResult`; raises as :meth:`run` does, and
        ``InvalidRequest`` (``workers_mismatch``) for a broadcaster over other workers."""
        from weightsync.fleet.push import PushChannel

        if sorted(worker_url(u) for u in broadcaster.urls) != sorted(self.workers):
            raise InvalidRequest(
                f"the broadcaster reaches {broadcaster.urls}, not this fleet's workers {self.workers}",
                code="workers_mismatch",
            )
        return _ray(
            await self.coordinator.run(PushChannel(broadcaster, tensors, restore), version, **options)
        )

    async def recover(self, cleanup_s: float | None = None, wait_s: float = 0.0) -> list[TransactionResult]:
        """Finish or roll back the journal's unfinished transactions: :meth:`FleetCoordinator.recover
        <weightsync.fleet.FleetCoordinator.recover>`.

        A driver that died elsewhere holds the journal's lease until it runs out (``lease_s``,
        30 s by default; a holder on this host that died is taken over at once): ``wait_s``
        waits up to that long for it.  Raises ``IllegalState`` (``journal_locked``, its
        message says for how long the lease runs) when it is still held after ``wait_s``.
        """
        return [_ray(r) for r in await _leased(lambda: self.coordinator.recover(cleanup_s), wait_s)]

    def recover_sync(self, cleanup_s: float | None = None, wait_s: float = 0.0) -> list[TransactionResult]:
        return asyncio.run(self.recover(cleanup_s, wait_s))

    async def admit(
        self, pause_mode: str = "keep", deadline_s: float = 600.0, wait_s: float = 0.0
    ) -> Admission:
        """Bring every worker actor onto the fleet's committed version, prove it, and record
        it as a member: ``weightsync fleet add`` (:func:`~weightsync.fleet.admission.admit`).

        A worker actor Ray restarted (``max_restarts``) comes back paused on the weights it
        was started with; this pauses each actor that does not hold the newest commit, takes
        it there (the journal's deltas, or a full checkpoint whose digest the journal knows),
        checks the digest, declares the committed version at the committed epoch, reads it
        back, and only then resumes it.  An actor that holds the commit is resumed.  ``wait_s``
        waits for the journal's lease as :meth:`recover` does.

        Each actor's served weights are re-hashed first (what it reports is a claim); one no
        route reaches is refused before it is paused.  Returns the
        :class:`~weightsync.fleet.admission.Admission` (an actor that could not be brought
        there stays paused, or as it was when refused untouched, its error in it).  Raises ``IllegalState``
        (``unfinished_transaction``: :meth:`recover` first; ``nothing_committed``;
        ``journal_locked``) before any actor is touched.
        """
        from weightsync.fleet.admission import admit

        done = await _leased(lambda: admit(self.coordinator, pause_mode, deadline_s), wait_s)
        return attrs.evolve(done, advice=RAY_ADMIT_ADVICE)

    def admit_sync(
        self, pause_mode: str = "keep", deadline_s: float = 600.0, wait_s: float = 0.0
    ) -> Admission:
        """:meth:`admit` from blocking code."""
        return asyncio.run(self.admit(pause_mode, deadline_s, wait_s))

    async def astatus(self, deadline_s: float = 10.0) -> list[WorkerStatus]:
        """Every worker's state (or its error), in worker order."""
        return await self.coordinator.astatus(deadline_s)

    def status(self, deadline_s: float = 10.0) -> list[WorkerStatus]:
        return asyncio.run(self.astatus(deadline_s))

    async def pause(self, mode: str = "keep", deadline_s: float = 60.0) -> list[WorkerStatus]:
        """Pause every worker (no transaction); each one's state after, or its error."""
        return await self.coordinator.pause(mode, deadline_s)

    async def resume(self, deadline_s: float = 60.0) -> list[WorkerStatus]:
        """Resume every worker (a torn one refuses)."""
        return await self.coordinator.resume(deadline_s)


RAY_ADMIT_ADVICE: Final = Advice(
    stuck=(
        "{workers} could not be brought onto the commit: check them (`RayFleet.status()`), give the "
        "fleet a checkpoint of the commit (a `RayFleet.update(path, version)` naming them), then call "
        "`RayFleet.admit()` again"
    ),
    done="nothing: the actors serve the committed version and are members of the fleet",
)


def _ray(result: TransactionResult) -> TransactionResult:
    """``result`` advising a RayFleet's methods: no command line reaches an actor."""
    return attrs.evolve(result, steps=RAY_STEPS)


async def _leased(work: Callable[[], Awaitable[T]], wait_s: float) -> T:
    """``work()``, tried again while another driver holds the journal's lease, for up to
    ``wait_s`` seconds; raises ``IllegalState`` (``journal_locked``) once that has passed."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return await work()
        except IllegalState as exc:
            if exc.code != "journal_locked" or time.monotonic() >= deadline:
                raise
        await asyncio.sleep(min(LEASE_POLL_S, max(0.0, deadline - time.monotonic())))
