"""A local Ray cluster for the Ray tests, started once per test process, and a trainer
actor that forms a gloo weight-update group.

Starting Ray costs seconds, so :func:`local_cluster` starts it on first use and leaves it
running for the next module (Ray shuts it down when the process exits); each module kills
the actors it made.  The actors see this checkout (``src`` and the repository root, for
``tests.*``) through ``PYTHONPATH``.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any

import ray
import torch
import torch.distributed as dist

from tests.helpers import TINY, perturbed

ROOT = Path(__file__).resolve().parent.parent

SMALL: dict[str, Any] = {"num_cpus": 0.25}
"""Ray resources of a test actor: a two-core machine runs a fleet of them and a trainer."""


def local_cluster() -> dict[str, Any]:
    """The local cluster's ``address_info``, starting it (two CPUs, no dashboard) if this
    process has none."""
    os.environ.setdefault("RAY_DISABLE_USAGE_STATS", "1")
    if not ray.is_initialized():
        path = os.pathsep.join(p for p in (str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH")) if p)
        ray.init(
            num_cpus=2, include_dashboard=False, namespace="weightsync-tests", log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": path, "RAY_DISABLE_USAGE_STATS": "1"}},
        )  # fmt: skip
    return dict(ray.get_runtime_context().worker.node.address_info)


def new_weights(seed: int) -> dict[str, torch.Tensor]:
    """The weights a trainer step with ``seed`` produces for the tiny reference model."""
    from weightsync.engines.reference import ReferenceEngine

    return perturbed(dict(ReferenceEngine(TINY).model.weights()), seed=seed)


def update_info(weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    """vLLM's ``update_info`` for a per-tensor stream of ``weights`` (with their hashes)."""
    from weightsync.transports.hashing import tensor_hash

    return {
        "names": list(weights),
        "dtype_names": [str(t.dtype).removeprefix("torch.") for t in weights.values()],
        "shapes": [list(t.shape) for t in weights.values()],
        "hashes": [tensor_hash(t) for t in weights.values()],
    }


@ray.remote(num_cpus=0.25)
class GlooTrainer:
    """Rank 0 of a gloo group with the workers: joined with weightsync's group helper
    (:meth:`host_weightsync`), or as vLLM's and SGLang's trainers form theirs, a plain
    ``init_process_group`` (:meth:`host_plain`).  :meth:`broadcast` sends tensors one
    broadcast each, in order."""

    def __init__(self) -> None:
        self.group: Any = None

    def host_weightsync(self, port: int, world_size: int) -> None:
        from weightsync.transports.distributed.group import create_group

        store = dist.TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=60),
                              wait_for_workers=False)  # fmt: skip
        self.group = create_group(
            "vllm", master_address="127.0.0.1", master_port=port, rank=0, world_size=world_size,
            backend="gloo", timeout_s=60, store=store,
        )  # fmt: skip

    def host_plain(self, port: int, world_size: int) -> None:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=world_size,
            timeout=datetime.timedelta(seconds=60),
        )  # fmt: skip

    def broadcast(self, seed: int) -> int:
        weights = new_weights(seed)
        for t in weights.values():
            if self.group is not None:
                self.group.wait(self.group.broadcast(t.contiguous()))
            else:
                dist.broadcast(t.contiguous(), src=0)
        return len(weights)


@ray.remote(num_cpus=0.25, max_restarts=0)
class FleetDriver:
    """A Ray driver of one :class:`~weightsync.ray.RayFleet` transaction, as an actor a test
    can kill mid-transaction: it stalls once the transaction reaches phase ``stall_at``."""

    def update(self, names: list[str], namespace: str, journal: str, initial: str, source: str,
               version: Any, stall_at: str) -> None:  # fmt: skip
        import time

        from weightsync.ray import RayFleet

        def stall(event: Any) -> None:
            if event.phase == stall_at:
                time.sleep(600)  # until the test kills this driver

        fleet = RayFleet(names, namespace=namespace, journal=journal, initial_source=initial, on_event=stall)
        fleet.update_sync(source, version=version)


@ray.remote(num_cpus=0.25, max_restarts=0)
class PushTrainer:
    """A trainer as a Ray actor: rank 0 of a gloo group with the worker actors (its address
    and a free port found here and passed to them as always), and the driver of the fleet
    transactions that push its weights to them (``RayFleet.push``)."""

    def __init__(self, names: list[str], namespace: str, journal: str, initial: str) -> None:
        from weightsync.ray import RayFleet

        self.fleet = RayFleet(names, namespace=namespace, journal=journal, initial_source=initial)
        self.broadcaster = self.fleet.broadcaster(timeout_s=60)
        self.connected = False

    async def push(self, seed: int, version: Any) -> Any:
        """Push ``new_weights(seed)`` as one transaction; its ``TransactionResult``."""
        if not self.connected:
            await self.broadcaster.aconnect()
            self.connected = True
        return await self.fleet.push(self.broadcaster, new_weights(seed), version)

    async def close(self) -> None:
        if self.connected:
            await self.broadcaster.aclose()
            self.connected = False
