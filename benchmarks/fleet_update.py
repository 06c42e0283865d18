"""One fleet transaction from disk against the slowest single-worker update, same run.

Four ``weightsync serve`` reference workers (``--model-config qwen2.5-0.5b``: ~1 GB bf16 by
default) on loopback.  Baseline: each worker's plain update (pause, load with a cache reset,
resume) timed one worker at a time; the slowest counts.  Then one ``FleetCoordinator``
transaction (dry run, pause + load concurrently, verify digests, commit) over all four.
``digest_overhead`` is the time to hash every tensor of the model once (xxh3-64, what a
worker adds to a load when it hashes as bytes pass) over the median plain update: an upper
bound, since the workers hash inside the load.

Last line: ``RESULT ratio_vs_slowest_worker=<x> digest_overhead=<y>`` (goal: x <= 1.3,
y <= 0.1).  Needs the worker side of the fleet contract (digest, dry_run); without it the
transaction aborts at prepare and the script says so.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: runs from any cwd
from tests.helpers import WorkerProcess, perturbed

from weightsync.cli import _reference_config
from weightsync.engines.reference import ReferenceEngine
from weightsync.fleet import FleetCoordinator
from weightsync.trainer import save_checkpoint
from weightsync.transports.hashing import tensor_hashes


def post(url: str, route: str, body: dict[str, object]) -> dict[str, object]:
    reply = httpx.post(f"{url}/engine/{route}", json=body, timeout=600)
    reply.raise_for_status()
    return dict(reply.json())


def plain_update(url: str, path: Path) -> float:
    t0 = time.perf_counter()
    post(url, "pause_generation", {"mode": "keep"})
    post(url, "update_weights_from_disk", {"model_path": str(path), "reset_prefix_cache": True})
    post(url, "resume_generation", {})
    return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--model-config", default="qwen2.5-0.5b", choices=["tiny", "default", "qwen2.5-0.5b"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    weights = dict(ReferenceEngine(_reference_config(args.model_config)).model.weights())
    t0 = time.perf_counter()
    tensor_hashes(weights.items())
    hash_s = time.perf_counter() - t0
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    print(
        f"model: {len(weights)} tensors, {nbytes / 2**20:.0f} MiB; hashing all of it: {hash_s * 1e3:.1f} ms"
    )

    with tempfile.TemporaryDirectory() as tmp:
        ckpts = [save_checkpoint(perturbed(weights, seed=i + 1), Path(tmp) / f"step-{i}") for i in range(2)]
        del weights
        workers = [WorkerProcess("--model-config", args.model_config, model_config=args.model_config)
                   for _ in range(args.workers)]  # fmt: skip
        try:
            for w in workers:
                w.wait_ready(300)
            urls = [w.url for w in workers]
            plain: list[float] = []
            for r in range(args.repeats):
                per_worker = [plain_update(u, ckpts[r % 2]) for u in urls]
                plain.append(max(per_worker))
                print(f"plain updates, one worker at a time: {[round(s, 3) for s in per_worker]} s")
            coordinator = FleetCoordinator(urls, initial_source=str(ckpts[0]))
            txn: list[float] = []
            for r in range(args.repeats):
                t0 = time.perf_counter()
                result = coordinator.update_sync(str(ckpts[(r + 1) % 2]), f"v{r}")
                txn.append(time.perf_counter() - t0)
                print(f"transaction {r}: {result.phase} in {txn[-1]:.3f} s")
                if not result.ok:
                    print(f"transaction did not commit: {result.message}")
                    return 1
        finally:
            for w in workers:
                w.stop()
    slowest = statistics.median(plain)
    ratio = statistics.median(txn) / slowest
    print(f"RESULT ratio_vs_slowest_worker={ratio:.3f} digest_overhead={hash_s / slowest:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
