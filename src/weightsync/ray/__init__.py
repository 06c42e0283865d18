"""weightsync on Ray: a worker as an actor (:data:`WorkerActor`) and fleet transactions
over actor handles (:class:`RayFleet`).  Needs the ``ray`` extra (``pip install
'.[http,torch,ray]'`` from a clone); names load on first use.  See ``docs/ray.md``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from weightsync._lazy import lazy_dir, lazy_exports

if TYPE_CHECKING:
    from weightsync.ray.fleet import RayFleet
    from weightsync.ray.transport import ActorRef
    from weightsync.ray.worker import DEFAULT_OPTIONS, Worker, WorkerActor

_WHERE = {
    "ActorRef": ".transport", "DEFAULT_OPTIONS": ".worker", "RayFleet": ".fleet", "Worker": ".worker",
    "WorkerActor": ".worker",
}  # fmt: skip
__all__ = ["DEFAULT_OPTIONS", "ActorRef", "RayFleet", "Worker", "WorkerActor"]
__getattr__ = lazy_exports(__name__, _WHERE)
__dir__ = lazy_dir(globals(), __all__)
