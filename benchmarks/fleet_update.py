"""One fleet transaction against the same plain updates fanned out concurrently, same run,
for a disk checkpoint and for a trainer's push.

``--workers`` ``weightsync serve`` reference workers (``--model-config qwen2.5-0.5b``: ~1 GB
bf16 by default) on loopback.  Baseline (disk): every worker's plain update — pause, load
with a cache reset, resume — sent to all workers at once, no transaction.  Then one
``FleetCoordinator`` transaction (dry run, pause + load, verify digests, declare and read
back, resume) over the same workers.  Every disk update, plain or not, loads a checkpoint
directory no worker has read before (hard links to one of two written checkpoints), as a
trainer writes one per step: a worker keeps what it verified of the checkpoints it read
(``transports/disk/facts.py``), so a plain update of a checkpoint an earlier dry run read
copies once, which is the apply phase of a transaction and not a plain update.  ``--reuse-checkpoints`` alternates two checkpoints
instead (how this script measured before; the plain fan-out is then mostly such copies, and
each round prints how many of its loads were ``prepared``).  Push: the same pair over one
``Broadcaster`` group (pause all, one packed push, resume all; against ``push_transaction``).
Runs alternate so both sides see the same machine.  ``digest_overhead`` is the time to hash
every tensor once (xxh3-64: what a worker adds to a load, and what the trainer adds to a push
transaction) over the median plain update: an upper bound, since workers hash inside the load.
Each transaction's phases are timed too (the median of each, seconds): they vary less than
the totals on a loaded machine.

Prints ``RESULT[disk] ...`` and ``RESULT[push] ...``; the last line is
``RESULT ratio_vs_plain_fanout=<x> digest_overhead=<y>``, the worse of the two
(goal: x <= 1.25, y <= 0.1).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: runs from any cwd
from tests.helpers import WorkerProcess, perturbed

from weightsync.engines.reference import ReferenceEngine
from weightsync.fleet import FleetCoordinator
from weightsync.fleet.events import Event
from weightsync.fleet.push import push_transaction
from weightsync.trainer import AsyncWorkerClient, Broadcaster, save_checkpoint, weights_digest
from weightsync.worker_app import reference_config as _reference_config


async def fanout(urls: list[str], step: Callable[[AsyncWorkerClient], Awaitable[Any]]) -> None:
    clients = [AsyncWorkerClient(u) for u in urls]
    try:
        await asyncio.gather(*(step(c) for c in clients))
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))


async def plain_disk(urls: list[str], path: str, version: str) -> int:
    """The plain fan-out; returns how many of its loads copied once on facts an earlier read
    of the same checkpoint left (``prepared``)."""
    prepared = 0

    async def one(c: AsyncWorkerClient) -> None:
        nonlocal prepared
        await c.pause_generation()
        reply = await c.update_weights_from_disk(path, weight_version=version, reset_prefix_cache=True)
        prepared += bool(reply["stats"].get("prepared"))
        await c.resume_generation()

    await fanout(urls, one)
    return prepared


class Checkpoints:
    """The checkpoints the disk rounds load.  Two are written (two sets of weights); each
    update then gets a directory of its own holding hard links to one of them, alternating,
    which no worker has read before (a worker keeps what it verified by directory and file
    identity), so it verifies it in full as it would a checkpoint a trainer just wrote.  With
    ``reuse`` the two directories themselves alternate."""

    def __init__(self, root: Path, weights: dict[str, Any], reuse: bool) -> None:
        self.root, self.reuse = root, reuse
        self.base = [save_checkpoint(perturbed(weights, seed=i + 1), root / f"step-{i}") for i in range(2)]

    def path(self, n: int) -> str:
        if self.reuse or n == 0:
            return str(self.base[n % 2])
        where = self.root / f"fresh-{n}"
        if not where.exists():
            where.mkdir()
            for f in self.base[n % 2].iterdir():
                os.link(f, where / f.name)
        return str(where)

    def drop(self, n: int) -> None:
        if not self.reuse and n > 0:  # step-0 stays: it is the rollback source
            shutil.rmtree(self.root / f"fresh-{n}", ignore_errors=True)


class PhaseTimes:
    """Each transaction's phases, from the coordinator's events (``N/N answered`` lines)."""

    def __init__(self) -> None:
        self.current: dict[str, float] = {}
        self.runs: list[dict[str, float]] = []

    def __call__(self, event: Event) -> None:
        if event.worker is None and event.duration_s is not None and event.phase != "result":
            self.current[event.phase] = self.current.get(event.phase, 0.0) + event.duration_s

    def close(self) -> dict[str, float]:
        done, self.current = self.current, {}
        self.runs.append(done)
        return done

    def medians(self) -> str:
        phases = [p for p in ("preparing", "applying", "verifying", "committing", "resuming")
                  if any(p in r for r in self.runs)]  # fmt: skip
        return " ".join(f"{p}={statistics.median(r.get(p, 0.0) for r in self.runs):.3f}" for p in phases)


async def plain_push(urls: list[str], b: Broadcaster, weights: dict[str, Any], version: str) -> None:
    await fanout(urls, lambda c: c.pause_generation())
    await b.apush(weights, version=version, reset_prefix_cache=True)
    await fanout(urls, lambda c: c.resume_generation())


async def timed(work: Awaitable[Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = await work
    return time.perf_counter() - t0, out


async def bench(
    urls: list[str], ckpts: Checkpoints, pushes: list[dict[str, Any]], repeats: int
) -> dict[str, Any]:
    phases = {"disk": PhaseTimes(), "push": PhaseTimes()}
    coordinator = FleetCoordinator(urls, initial_source=ckpts.path(0), on_event=phases["disk"])
    out: dict[str, Any] = {"disk": ([], []), "push": ([], []), "phases": phases}
    for r in range(repeats):
        plain_n, txn_n = (2 * r + 2, 2 * r + 1) if not ckpts.reuse else (r + 1, r)
        path, txn_path = ckpts.path(plain_n), ckpts.path(txn_n)
        s, prepared = await timed(plain_disk(urls, path, f"plain-{r}"))
        ckpts.drop(plain_n)
        out["disk"][0].append(s)
        s, result = await timed(coordinator.update(txn_path, f"disk-{r}"))
        out["disk"][1].append(s)
        took = " ".join(f"{k} {v:.3f}" for k, v in phases["disk"].close().items())
        print(
            f"disk {r}: plain fan-out {out['disk'][0][-1]:.3f} s ({prepared}/{len(urls)} prepared), "
            f"transaction {s:.3f} s ({result.phase}: {took})"
        )
        if not result.ok:
            raise SystemExit(f"the disk transaction did not commit: {result.message}")
        if r:
            ckpts.drop(2 * r - 1)  # the transaction before: no longer a rollback source
    coordinator.on_event = phases["push"]
    b = Broadcaster(urls, timeout_s=120)
    await b.aconnect()
    try:
        for r in range(repeats):
            s, _ = await timed(plain_push(urls, b, pushes[r % 2], f"plain-push-{r}"))
            out["push"][0].append(s)
            s, result = await timed(push_transaction(coordinator, b, pushes[(r + 1) % 2], f"push-{r}"))
            out["push"][1].append(s)
            took = " ".join(f"{k} {v:.3f}" for k, v in phases["push"].close().items())
            print(
                f"push {r}: plain fan-out {out['push'][0][-1]:.3f} s, transaction {s:.3f} s "
                f"({result.phase}: {took})"
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
    parser.add_argument(
        "--reuse-checkpoints", action="store_true",
        help="alternate two checkpoints (the plain fan-out then reuses what earlier dry runs verified)",
    )  # fmt: skip
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
        ckpts = Checkpoints(Path(tmp), weights, args.reuse_checkpoints)
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
        print(f"phases[{kind}] (median s): {out['phases'][kind].medians()}")
    for kind in ("disk", "push"):
        plain, txn = (statistics.median(x) for x in out[kind])
        ratio, overhead = txn / plain, hash_s / plain
        print(f"RESULT[{kind}] ratio_vs_plain_fanout={ratio:.3f} digest_overhead={overhead:.3f}")
        worst = (max(worst[0], ratio), max(worst[1], overhead))
    print(f"RESULT ratio_vs_plain_fanout={worst[0]:.3f} digest_overhead={worst[1]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
