"""One fleet transaction against the same plain updates fanned out concurrently, same run,
for a disk checkpoint and for a trainer's push.

``--workers`` ``weightsync serve`` reference workers (``--model-config qwen2.5-0.5b``: ~1 GB
bf16 by default) on loopback.  Baseline (disk): every worker's plain update — pause, load
with a cache reset, resume — sent to all workers at once, no transaction.  Then one
``FleetCoordinator`` transaction (dry run, pause + load, verify digests, declare and read
back, resume) over the same workers.  Push: the same pair over one ``Broadcaster`` group
(pause all, one packed push, resume all; against ``push_transaction``).  Runs alternate so
both sides see the same machine.  ``digest_overhead`` is the time to hash every tensor once
(xxh3-64: what a worker adds to a load, and what the trainer adds to a push transaction)
over the median plain update: an upper bound, since workers hash inside the load.

Prints ``RESULT[disk] ...`` and ``RESULT[push] ...``; the last line is
``RESULT ratio_vs_plain_fanout=<x> digest_overhead=<y>``, the worse of the two
(goal: x <= 1.25, y <= 0.1).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: runs from any cwd
from tests.helpers import WorkerProcess, perturbed

from weightsync.cli import _reference_config
from weightsync.engines.reference import ReferenceEngine
from weightsync.fleet import FleetCoordinator
from weightsync.fleet.push import push_transaction
from weightsync.trainer import AsyncWorkerClient, Broadcaster, save_checkpoint, weights_digest


async def fanout(urls: list[str], step: Callable[[AsyncWorkerClient], Awaitable[Any]]) -> None:
    clients = [AsyncWorkerClient(u) for u in urls]
    try:
        await asyncio.gather(*(step(c) for c in clients))
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))


async def plain_disk(urls: list[str], path: str, version: str) -> None:
    async def one(c: AsyncWorkerClient) -> None:
        await c.pause_generation()
        await c.update_weights_from_disk(path, weight_version=version, reset_prefix_cache=True)
        await c.resume_generation()

    await fanout(urls, one)


async def plain_push(urls: list[str], b: Broadcaster, weights: dict[str, Any], version: str) -> None:
    await fanout(urls, lambda c: c.pause_generation())
    await b.apush(weights, version=version, reset_prefix_cache=True)
    await fanout(urls, lambda c: c.resume_generation())


async def timed(work: Awaitable[Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = await work
    return time.perf_counter() - t0, out


async def bench(
    urls: list[str], ckpts: list[str], pushes: list[dict[str, Any]], repeats: int
) -> dict[str, Any]:
    coordinator = FleetCoordinator(urls, initial_source=ckpts[0])
    out: dict[str, Any] = {"disk": ([], []), "push": ([], [])}
    for r in range(repeats):
        path = ckpts[(r + 1) % 2]
        s, _ = await timed(plain_disk(urls, path, f"plain-{r}"))
        out["disk"][0].append(s)
        s, result = await timed(coordinator.update(ckpts[r % 2], f"disk-{r}"))
        out["disk"][1].append(s)
        print(f"disk {r}: plain fan-out {out['disk'][0][-1]:.3f} s, transaction {s:.3f} s ({result.phase})")
        if not result.ok:
            raise SystemExit(f"the disk transaction did not commit: {result.message}")
    b = Broadcaster(urls, timeout_s=120)
    await b.aconnect()
    try:
        for r in range(repeats):
            s, _ = await timed(plain_push(urls, b, pushes[r % 2], f"plain-push-{r}"))
            out["push"][0].append(s)
            s, result = await timed(push_transaction(coordinator, b, pushes[(r + 1) % 2], f"push-{r}"))
            out["push"][1].append(s)
            print(
                f"push {r}: plain fan-out {out['push'][0][-1]:.3f} s, transaction {s:.3f} s ({result.phase})"
            )
            if not result.ok:
                raise SystemExit(f"the push transaction did not commit: {result.message}")
    finally:
        await b.aclose()
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--model-config", default="qwen2.5-0.5b", choices=["tiny", "default", "qwen2.5-0.5b"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    weights = dict(ReferenceEngine(_reference_config(args.model_config)).model.weights())
    t0 = time.perf_counter()
    weights_digest(weights)
    hash_s = time.perf_counter() - t0
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    print(
        f"model: {len(weights)} tensors, {nbytes / 2**20:.0f} MiB; hashing all of it: {hash_s * 1e3:.1f} ms"
    )
    pushes = [perturbed(weights, seed=i + 11) for i in range(2)]
    with tempfile.TemporaryDirectory() as tmp:
        ckpts = [
            str(save_checkpoint(perturbed(weights, seed=i + 1), Path(tmp) / f"step-{i}")) for i in range(2)
        ]
        del weights
        workers = [WorkerProcess(model_config=args.model_config) for _ in range(args.workers)]
        try:
            for w in workers:
                w.wait_ready(300)
            out = asyncio.run(bench([w.url for w in workers], ckpts, pushes, args.repeats))
        finally:
            for w in workers:
                w.stop()
    worst = (0.0, 0.0)
    for kind in ("disk", "push"):
        plain, txn = (statistics.median(x) for x in out[kind])
        ratio, overhead = txn / plain, hash_s / plain
        print(f"RESULT[{kind}] ratio_vs_plain_fanout={ratio:.3f} digest_overhead={overhead:.3f}")
        worst = (max(worst[0], ratio), max(worst[1], overhead))
    print(f"RESULT ratio_vs_plain_fanout={worst[0]:.3f} digest_overhead={worst[1]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
