"""One ``RayFleet`` disk transaction against the same plain updates called on the same worker
actors concurrently, same run.

``--workers`` ``WorkerActor``s (reference engine, ``--model-config qwen2.5-0.5b``: ~1 GB bf16) on a
local Ray cluster.  Baseline: every actor's plain update — ``pause_generation``,
``update_weights_from_disk`` with a cache reset, ``resume_generation`` as actor calls — on
all actors at once, no transaction (what a Ray framework's ``ray.get([...])`` fan-out does).
Then one ``RayFleet`` transaction (dry run, pause + load, verify digests, declare and read
back, resume) over the same actors.  Each update loads a checkpoint directory no actor has
read before, as in ``fleet_update.py`` (whose :class:`Checkpoints` this reuses).  Runs
alternate so both sides see the same machine.

Prints one line per round and, last, ``RESULT ratio_vs_plain_ray_fanout=<x>`` (median
transaction over median plain fan-out; goal: x <= 1.25, as the HTTP fleet's).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: runs from any cwd
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fleet_update import Checkpoints, timed

from weightsync.engines.reference import ReferenceEngine
from weightsync.worker_app import reference_config as _reference_config


async def plain(actors: list[Any], path: str, version: str) -> None:
    """Pause, load and resume every actor, all at once: no transaction."""

    async def one(actor: Any) -> None:
        await actor.pause_generation.remote()
        await actor.update_weights_from_disk.remote(model_path=path, weight_version=version,
                                                    reset_prefix_cache=True)  # fmt: skip
        await actor.resume_generation.remote()

    await asyncio.gather(*(one(a) for a in actors))


async def bench(actors: list[Any], ckpts: Checkpoints, repeats: int) -> tuple[list[float], list[float]]:
    from weightsync.ray import RayFleet

    fleet = RayFleet(actors, initial_source=ckpts.path(0))
    plains: list[float] = []
    txns: list[float] = []
    for r in range(repeats):
        plain_n, txn_n = 2 * r + 2, 2 * r + 1
        s, _ = await timed(plain(actors, ckpts.path(plain_n), f"plain-{r}"))
        ckpts.drop(plain_n)
        plains.append(s)
        s, result = await timed(fleet.update(ckpts.path(txn_n), f"disk-{r}"))
        txns.append(s)
        print(
            f"disk {r}: plain ray fan-out {plains[-1]:.3f} s, RayFleet transaction {s:.3f} s ({result.phase})"
        )
        if not result.ok:
            raise SystemExit(f"the transaction did not commit: {result.message}")
        if r:
            ckpts.drop(2 * r - 1)  # the transaction before: no longer a rollback source
    return plains, txns


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--model-config", default="qwen2.5-0.5b", choices=["tiny", "default", "qwen2.5-0.5b"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-cpus", type=float, default=2, help="CPUs of the local Ray cluster")
    args = parser.parse_args()

    os.environ.setdefault("RAY_DISABLE_USAGE_STATS", "1")
    import ray

    from weightsync.ray import WorkerActor

    weights = dict(ReferenceEngine(_reference_config(args.model_config)).model.weights())
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            ckpts = Checkpoints(Path(tmp), weights, reuse=False)
            del weights
            share = args.num_cpus / (args.workers + 1)
            actors = [
                WorkerActor.options(num_cpus=share).remote(
                    model_config=args.model_config, replica_index=i, allowed_weight_dirs=[tmp]
                )
                for i in range(args.workers)
            ]
            ray.get([a.ready.remote() for a in actors], timeout=600)
            plains, txns = asyncio.run(bench(actors, ckpts, args.repeats))
    finally:
        ray.shutdown()
    ratio = statistics.median(txns) / statistics.median(plains)
    print(f"RESULT ratio_vs_plain_ray_fanout={ratio:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
