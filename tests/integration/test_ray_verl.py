"""verl's checkpoint-engine backend ``weightsync`` (weightsync.ray.verl) on a local Ray
cluster: trainer ranks as Ray actors build the engine from the registry as verl's trainer
worker does, the test drives verl's update sequence, and real weightsync worker actors
receive each step as one fleet transaction.

With verl importable (``verl_api().real``) the registry, base class and the plugin module
are verl's own; without it they are ``tests/verl_standin.py``'s reproduction of verl
0.9.1's ``verl/checkpoint_engine/base.py``.  The update sequence follows verl 0.9.1's
``CheckpointEngineManager.build_process_group`` and ``update_weights`` (steps 4–6), written
out here: verl's manager needs its own worker groups and rollout servers.
"""

from __future__ import annotations

import asyncio
import importlib
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed (make test installs it)")

from tests.integration.test_ray_fleet import (  # noqa: E402
    NAMES,
    NAMESPACE,
    Workers,
    module_workers,
    on_one_version,
    workers,
)
from tests.ray_cluster import SMALL, new_weights  # noqa: E402
from tests.verl_standin import verl_api  # noqa: E402
from weightsync.core.errors import IllegalState, InvalidRequest  # noqa: E402
from weightsync.ray.verl import NAME, register  # noqa: E402
from weightsync.trainer import weights_digest  # noqa: E402

__all__ = ["module_workers", "workers"]  # the fleet tests' fixtures, used here

BUCKET = 1 << 20


def registered() -> Any:
    """verl's registry (or the stand-in's) with the backend in it, as a verl worker process
    has it: with real verl by importing the plugin module (``custom_backend_module``)."""
    api = verl_api()
    if api.real:
        importlib.import_module("weightsync.ray.verl_plugin")
    else:
        register(registry=api.registry, base=api.base)
    return api.registry


@ray.remote(num_cpus=SMALL["num_cpus"], max_restarts=0)
class TrainerRank:
    """A verl trainer rank as far as the checkpoint engine goes (verl 0.9.1,
    ``verl/workers/engine_workers.py``): the engine from ``CheckpointEngineRegistry.new(backend,
    is_master=rank == 0, bucket_size=…, **engine_kwargs)``, ``execute_checkpoint_engine``, and
    ``update_weights``, which hands ``send_weights`` a generator of the step's tensors."""

    def __init__(self, rank: int, engine_kwargs: dict[str, Any]) -> None:
        self.engine = registered().new(NAME, is_master=rank == 0, bucket_size=BUCKET, **engine_kwargs)
        self.walked = 0

    def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.engine, method)(*args, **kwargs)

    async def update_weights(
        self, global_steps: int, seed: int, reshape: str | None = None
    ) -> dict[str, Any]:
        def per_tensor_param() -> Any:
            for name, tensor in new_weights(seed).items():
                self.walked += 1
                yield name, (tensor.reshape(-1) if name == reshape else tensor)

        return await self.engine.send_weights(per_tensor_param(), global_steps=global_steps)

    def verl_kind(self) -> tuple[bool, bool]:
        """Whether this rank's verl is the real one, and its engine an instance of its base."""
        api = verl_api()
        return api.real, isinstance(self.engine, api.base)

    def walked_count(self) -> int:
        return self.walked

    def last_result(self) -> Any:
        return self.engine.last_result


def verl_update(
    trainers: list[Any], rollout: Any, global_steps: int, seed: int, reshape: str | None = None
) -> Any:
    """verl's ``CheckpointEngineManager``: prepare every engine, build the topology with the
    backend's class, init the process group with each one's share of the topology, update
    (the trainer ranks send, the rollout engine receives into its server adapter), finalize.
    Returns the trainer ranks' results."""
    metadata = [
        *ray.get([t.execute_checkpoint_engine.remote("prepare") for t in trainers]),
        rollout.prepare(),
    ]
    backend_cls = registered().get(NAME)  # the manager's self.backend_cls
    actor_kwargs, rollout_kwargs = backend_cls.build_topology(len(trainers), 1, metadata)
    assert all(len(v) == len(trainers) for v in actor_kwargs.values())
    ray.get([
        t.execute_checkpoint_engine.remote("init_process_group", **{k: v[i] for k, v in actor_kwargs.items()})
        for i, t in enumerate(trainers)
    ])  # fmt: skip
    rollout.init_process_group(**{k: v[0] for k, v in rollout_kwargs.items()})
    sent = [t.update_weights.remote(global_steps, seed, reshape) for t in trainers]

    async def server_adapter() -> list[Any]:  # what verl's rollout worker hands its server adapter
        return [pair async for pair in rollout.receive_weights(global_steps=global_steps)]

    assert asyncio.run(server_adapter()) == []  # the weightsync workers got the weights, not verl's rollout
    results = ray.get(sent, timeout=300)
    ray.get([t.execute_checkpoint_engine.remote("finalize") for t in trainers])
    rollout.finalize()
    return results


def start(workers: Workers, **engine_kwargs: Any) -> tuple[list[Any], Any]:
    """Two trainer ranks and verl's rollout-side engine, with ``engine_kwargs["weightsync"]``."""
    engine_kwargs = {
        "workers": NAMES, "namespace": NAMESPACE, "journal": str(workers.root / "fleet.db"),
        "group_backend": "gloo", "timeout_s": 60.0,
        "fleet": {"initial_source": workers.old, "cleanup_s": 30.0}, **engine_kwargs,
    }  # fmt: skip
    trainers = [TrainerRank.remote(rank, engine_kwargs) for rank in range(2)]  # type: ignore[attr-defined]
    rollout = registered().new(NAME, bucket_size=BUCKET, **engine_kwargs)  # as verl's CheckpointEngineWorker
    return trainers, rollout


def test_a_verl_step_through_the_weightsync_backend_commits_on_every_worker_or_on_none(
    workers: Workers,
) -> None:
    """Step 1 reaches both worker actors as one push transaction: every serving actor holds
    the trainer's tensors under ``step-1``, one epoch, and rank 1 walked its tensors but sent
    none.  Step 2's tensors do not fit the model (one is flattened): the transaction
    is refused in prepare's dry run before any worker changes, ``send_weights`` raises ``transaction_not_committed``,
    and every actor still serves step 1."""
    trainers, rollout = start(workers)
    fleet = workers.fleet()
    try:
        assert ray.get(trainers[0].verl_kind.remote()) == (verl_api().real, True)
        assert isinstance(rollout, verl_api().base)
        first, second = verl_update(trainers, rollout, global_steps=1, seed=11)
        assert second == {} and first["weightsync/workers_committed"] == len(NAMES)
        status = {s.url: s.reply for s in fleet.status()}
        held = {(r["version"], r["epoch"], r["digest"]) for r in status.values()}
        assert held == {("step-1", first["weightsync/epoch"], weights_digest(new_weights(11)))}, status
        assert all(not r["paused"] for r in status.values())
        walked = ray.get([t.walked_count.remote() for t in trainers])
        assert walked == [len(new_weights(11))] * 2

        flat = next(n for n, t in new_weights(12).items() if t.dim() > 1)
        with pytest.raises(IllegalState) as failed:
            verl_update(trainers, rollout, global_steps=2, seed=12, reshape=flat)
        assert failed.value.code == "transaction_not_committed"
        result = ray.get(trainers[0].last_result.remote())
        assert result.phase == "aborted", result.to_json()  # refused in the dry run: nothing changed
        assert [(w.outcome, w.code) for w in result.workers] == [("refused", "shape_mismatch")] * len(NAMES)
        assert on_one_version(fleet, result)[0] == "step-1"
    finally:
        for trainer in trainers:
            ray.kill(trainer)


def test_a_verl_step_with_the_disk_transfer_loads_one_checkpoint_on_every_worker(workers: Workers) -> None:
    """``transfer="disk"``: rank 0 writes the step's checkpoint (shards of at most the
    bucket size) under ``checkpoint_dir`` and every worker actor loads it in one transaction.

    A disk transaction under the rollback policy needs a way back (docs/fleet.md): after the
    previous test's push (no checkpoint of its weights exists), the backend is given one as
    its initial source, as a verl run that switches from push to disk transfers must."""
    held = {(s.reply or {}).get("digest") for s in workers.fleet().status()}
    way_back = workers.checkpoint(11) if held == {weights_digest(new_weights(11))} else workers.old
    trainers, rollout = start(
        workers,
        transfer="disk",
        checkpoint_dir=str(workers.root / "verl"),
        fleet={"initial_source": way_back, "cleanup_s": 30.0},
    )
    fleet = workers.fleet()
    try:
        first, _ = verl_update(trainers, rollout, global_steps=3, seed=13)
        result = ray.get(trainers[0].last_result.remote())
        assert result.ok and result.epoch == first["weightsync/epoch"]
        assert on_one_version(fleet, result) == ("step-3", result.epoch, weights_digest(new_weights(13)))
        assert (workers.root / "verl" / "step-3").is_dir()
    finally:
        for trainer in trainers:
            ray.kill(trainer)


@pytest.mark.skipif(verl_api().real, reason="verl is installed here: the error for its absence cannot arise")
def test_register_and_the_plugin_module_without_verl_raise_missing_extra() -> None:
    for attempt in (register, lambda: importlib.import_module("weightsync.ray.verl_plugin")):
        with pytest.raises(InvalidRequest) as missing:
            attempt()
        assert missing.value.code == "missing_extra" and "verl" in str(missing.value)
