"""The router's cost and what a rolling update leaves of the fleet's throughput, same run.

Three ``weightsync serve`` reference workers (``--model-config tiny``) and one ``weightsync
router`` on loopback.

* Latency: completions sent one at a time, alternately straight to a worker and through the
  router (which picks among all three); ``ratio_vs_direct`` is the router's median over the
  direct median.  Goal: at most 1.15.
* Throughput: ``--clients`` concurrent callers through the router, with no update (steady),
  then during a rolling update with ``max_unavailable=k`` (the window from the update's
  start to its end).  ``throughput_during_rolling_update`` is completions per second during
  the update over steady completions per second.  Goal: at least 0.9 × (N − k) / N.  On a
  machine with fewer cores than workers the CPU, not the number of serving workers, bounds
  throughput, and the update's own load and hashing compete with generation.

Last line: ``RESULT ratio_vs_direct=<x> throughput_during_rolling_update=<y>``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: runs from any cwd
from tests.helpers import TINY, RouterProcess, WorkerProcess, perturbed

from weightsync.engines.reference import ReferenceEngine
from weightsync.trainer.checkpoint import save_checkpoint

BODY: dict[str, Any] = {"prompt": "the quick brown fox", "max_tokens": 8, "temperature": 0}


def latency(direct: str, router: str, n: int) -> tuple[float, float]:
    """Median seconds per completion, straight to ``direct`` and through ``router``, interleaved."""
    times: dict[str, list[float]] = {direct: [], router: []}
    with httpx.Client(timeout=60) as http:
        for url in (direct, router):  # warm the connections
            http.post(f"{url}/v1/completions", json=BODY).raise_for_status()
        for _ in range(n):
            for url in (direct, router):
                t0 = time.perf_counter()
                http.post(f"{url}/v1/completions", json=BODY).raise_for_status()
                times[url].append(time.perf_counter() - t0)
    return statistics.median(times[direct]), statistics.median(times[router])


async def throughput(
    router: str, clients: int, seconds: float | None, update: dict[str, Any] | None
) -> tuple[float, int]:
    """Completions per second through ``router`` for ``seconds`` (or while ``update`` runs),
    and how many failed."""
    done = 0
    failed = 0
    stop = asyncio.Event()

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal done, failed
        while not stop.is_set():
            r = await http.post("/v1/completions", json=BODY)
            if r.status_code == 200:
                done += 1
            else:
                failed += 1
                await asyncio.sleep(0.01)

    async with httpx.AsyncClient(base_url=router, timeout=120) as http:
        tasks = [asyncio.create_task(client(http)) for _ in range(clients)]
        await asyncio.sleep(0.5)  # every client in flight before the window opens
        start_done, t0 = done, time.perf_counter()
        if update is None:
            assert seconds is not None
            await asyncio.sleep(seconds)
        else:
            async with httpx.AsyncClient(base_url=router, timeout=600) as admin:
                r = await admin.post("/fleet/update_weights_from_disk", json=update)
                if r.status_code != 200:
                    raise SystemExit(f"the rolling update failed: {r.text}")
        elapsed = time.perf_counter() - t0
        count = done - start_done
        stop.set()
        await asyncio.gather(*tasks)
    return count / elapsed, failed


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--max-unavailable", type=int, default=1)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--requests", type=int, default=60, help="latency samples per path")
    parser.add_argument("--steady-s", type=float, default=8.0)
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="router-bench-"))
    weights = dict(ReferenceEngine(TINY).model.weights())
    old = save_checkpoint(weights, tmp / "step-0")
    new = save_checkpoint(perturbed(weights), tmp / "step-1")
    workers = [WorkerProcess("--initial-version", '"v0"') for _ in range(args.workers)]
    router: RouterProcess | None = None
    try:
        for w in workers:
            w.wait_ready()
        router = RouterProcess(
            [w.url for w in workers], "--journal", str(tmp / "fleet.db"), "--initial-source", str(old)
        ).wait_ready()
        direct_s, routed_s = latency(workers[0].url, router.url, args.requests)
        print(f"p50 direct {direct_s * 1e3:.2f} ms, through the router {routed_s * 1e3:.2f} ms")
        steady, steady_failed = asyncio.run(throughput(router.url, args.clients, args.steady_s, None))
        update = {"model_path": str(new), "weight_version": "v1", "max_unavailable": args.max_unavailable}
        rolling, rolling_failed = asyncio.run(throughput(router.url, args.clients, None, update))
        print(f"steady {steady:.1f}/s ({steady_failed} failed), during the rolling update "
              f"{rolling:.1f}/s ({rolling_failed} failed)")  # fmt: skip
        n, k = args.workers, args.max_unavailable
        print(f"goal: ratio <= 1.15, throughput ratio >= {0.9 * (n - k) / n:.2f}")
        print(
            f"RESULT ratio_vs_direct={routed_s / direct_s:.3f} throughput_during_rolling_update={rolling / steady:.3f}"
        )
    finally:
        if router is not None:
            router.stop()
        for w in workers:
            w.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
