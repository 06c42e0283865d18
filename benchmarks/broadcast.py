"""Distributed push of a Qwen2.5-0.5B-shaped set (290 tensors, ~1 GB bf16) from a trainer
(this process) into one reference-engine worker (a ``weightsync serve`` process), against:

(a) one flat broadcast of the same number of bytes between this process and a receiver
    process on a gloo (or NCCL) group: the wire's limit;
(b) the per-tensor RPC pattern of OpenRLHF and vLLM's RLHF example: for every tensor one
    HTTP call plus one broadcast, into the same worker, on a group of its own that the
    worker joined with ``receiver="process"`` (the only way a gloo worker takes a bare
    per-tensor stream).

Last line: ``RESULT ratio_vs_flat=<x> ratio_vs_per_tensor_rpc=<y>`` (baseline seconds / ours;
higher is better; ``nan`` for a figure a failure left unmeasured), printed even when a step
fails, and the script then exits at once (non-zero on a failure) rather than waiting out a
collective left without its peer.  ``--sweep`` also times pushes at several bucket sizes;
``--model-config tiny`` runs the whole script in seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from weightsync.engines.reference import ReferenceEngine
from weightsync.trainer import AsyncWorkerClient, Broadcaster, WorkerClient
from weightsync.transports.distributed import create_group
from weightsync.worker_app import reference_config as _reference_config

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: runs from any cwd
from tests.helpers import WorkerProcess

TIMEOUT_S = 300.0

RECEIVER = """
import sys, torch
from weightsync.transports.distributed import create_group
port, size, repeats, backend = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if backend == "nccl":
    torch.cuda.set_device(0)
g = create_group("flat", master_address="127.0.0.1", master_port=port, rank=1, world_size=2,
                 backend=backend, timeout_s=120)
buf = torch.empty(size, dtype=torch.uint8, device=g.device)
for _ in range(repeats):
    g.wait(g.broadcast(buf))
g.close()
"""


def flat_broadcast(total: int, repeats: int, backend: str) -> list[float]:
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=120), wait_for_workers=False)
    proc = subprocess.Popen(
        [sys.executable, "-c", RECEIVER, str(store.port), str(total), str(repeats + 1), backend]
    )
    group = create_group(
        "flat", master_address="127.0.0.1", master_port=store.port, rank=0, world_size=2,
        backend=backend, timeout_s=120, store=store,
    )  # fmt: skip
    buf = torch.ones(total, dtype=torch.uint8, device=group.device)
    group.wait(group.broadcast(buf))  # warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        group.wait(group.broadcast(buf))
        if backend == "nccl":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    proc.wait()
    group.close()
    return times


def timed_pushes(
    b: Broadcaster, weights: dict[str, torch.Tensor], repeats: int, version: str = "bench"
) -> list[float]:
    """Seconds of each of ``repeats`` pushes of ``weights`` (with ``version``), after one
    warm-up push (the group's buffers allocated, the worker's pages faulted in)."""
    b.push(weights)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        b.push(weights, version=version)
        times.append(time.perf_counter() - t0)
    return times


def per_tensor_rpc(url: str, weights: dict[str, torch.Tensor], repeats: int, timeout_s: float) -> list[float]:
    """One HTTP update call + one broadcast per tensor (no packing), as many RL frameworks do.

    A bare per-tensor stream is received on gloo only by a group the worker joined with
    ``receiver="process"`` (a helper process owns it), so this pattern gets a group of its
    own.  A refused call fails the run at once: the broadcast it pairs with would otherwise
    wait out the group's timeout for a receiver that never comes."""

    async def run() -> list[float]:
        import datetime

        import torch.distributed as dist

        async with AsyncWorkerClient(url, timeout=timeout_s + 30) as client:
            store = dist.TCPStore(
                "127.0.0.1", 0, None, True, datetime.timedelta(seconds=timeout_s), wait_for_workers=False
            )
            mine = asyncio.to_thread(
                create_group, "per-tensor", master_address="127.0.0.1", master_port=store.port, rank=0,
                world_size=2, backend="gloo", timeout_s=timeout_s, store=store,
            )  # fmt: skip
            join = client.init_weights_update_group(
                "127.0.0.1", store.port, 1, 2, "per-tensor", backend="gloo", timeout_s=timeout_s,
                receiver="process",
            )  # fmt: skip
            group, _ = await asyncio.gather(mine, join)
            try:
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    for name, t in weights.items():
                        post = asyncio.ensure_future(
                            client.update_weights_from_distributed(
                                [name], [str(t.dtype).removeprefix("torch.")], [list(t.shape)], "per-tensor",
                                reset_prefix_cache=False,
                            )
                        )  # fmt: skip
                        sent = asyncio.ensure_future(
                            asyncio.to_thread(lambda t=t: group.wait(group.broadcast(t)))
                        )
                        await asyncio.wait([post, sent], return_when=asyncio.FIRST_COMPLETED)
                        if post.done() and post.exception() is not None:
                            raise post.exception()  # type: ignore[misc]
                        await sent
                        await post
                    times.append(time.perf_counter() - t0)
                return times
            finally:
                with contextlib.suppress(Exception):
                    await client.destroy_weights_update_group("per-tensor")
                group.close()

    return asyncio.run(run())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--model-config", default="qwen2.5-0.5b", choices=["tiny", "default", "qwen2.5-0.5b"])
    parser.add_argument("--skip-per-tensor", action="store_true", help="leave out the slow baseline (b)")
    args = parser.parse_args()
    device = "cuda" if args.backend == "nccl" else "cpu"
    weights = {
        n: t.to(device)
        for n, t in ReferenceEngine(_reference_config(args.model_config)).model.weights().items()
    }
    weights = {n: t + 1 for n, t in weights.items()}
    total = sum(t.numel() * t.element_size() for t in weights.values())
    print(f"{len(weights)} tensors, {total / 1e9:.2f} GB, backend {args.backend}")

    flat = ours = per = math.nan
    failed = False
    try:
        flat = statistics.median(flat_broadcast(total, args.repeats, args.backend))
        print(f"(a) one flat broadcast:        {flat:.3f} s ({total / flat / 1e9:.2f} GB/s)")

        worker = WorkerProcess(model_config=args.model_config).wait_ready(timeout=300)
        try:
            client = WorkerClient(worker.url)
            client.pause_generation()
            with Broadcaster([worker.url], backend=args.backend, timeout_s=TIMEOUT_S) as b:
                ours_times = timed_pushes(b, weights, args.repeats)
                ours = statistics.median(ours_times)
                print(f"weightsync push:               {ours:.3f} s ({total / ours / 1e9:.2f} GB/s), "
                      f"bucket {b.bucket_bytes >> 20} MiB  runs {' '.join(f'{t:.3f}' for t in ours_times)}")  # fmt: skip
                if args.sweep:
                    for mib in (16, 64, 128, 256, 512):
                        b.bucket_bytes = mib << 20
                        t0 = time.perf_counter()
                        b.push(weights)
                        print(f"  sweep: bucket {mib:4d} MiB -> {time.perf_counter() - t0:.3f} s")
            if not args.skip_per_tensor and args.backend == "gloo":
                per = statistics.median(per_tensor_rpc(worker.url, weights, args.repeats, TIMEOUT_S))
                print(f"(b) per-tensor HTTP+broadcast: {per:.3f} s")
            assert client.engine_rpc("weight_hashes")["result"]
            client.close()
        finally:
            worker.stop()
    except Exception:
        failed = True
        traceback.print_exc()
    print(f"RESULT ratio_vs_flat={flat / ours:.2f} ratio_vs_per_tensor_rpc={per / ours:.2f}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # A collective left waiting on a failed peer would hold a normal exit until its timeout.
    os._exit(code)
