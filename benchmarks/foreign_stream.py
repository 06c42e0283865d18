"""The same weights pushed into one reference-engine worker (a ``weightsync serve`` process) by a
trainer written against SGLang, and by weightsync's own trainer, against one flat broadcast of
the same bytes, in one run:

(a) one flat broadcast between this process and a receiver process (the wire's limit; the
    same measurement as ``benchmarks/broadcast.py``);
(x) SGLang's ``flattened_bucket``: the trainer forms its group with SGLang's
    ``init_custom_process_group`` (``tests/peers/sglang_calls.py``, call for call), posts
    ``/update_weights_from_distributed`` with ``load_format: "flattened_bucket"`` and broadcasts
    the tensors flattened and concatenated (``FlattenedTensorBucket``) in one collective; the
    bucket is built before the request is posted, as SGLang's trainers build it, and its
    building (the trainer's own copy, the same against any receiver) is printed, not timed;
(y) SGLang's bare per-tensor stream on the same group: the same request without
    ``load_format``, one broadcast per tensor (``init_process_hf`` in SGLang's test);
(z) weightsync's packed, checksummed stream (``Broadcaster.push``).

The SGLang dialect receives a bare stream in a helper process (a size lie cannot abort the
worker), which costs one copy out of shared memory; the helper receives the next broadcast
while the worker copies one out, so (y) overlaps its copies with the wire, while (x), one
broadcast, copies and hashes after it.  Last line:
``RESULT ratio_bucket_vs_flat=<x> ratio_per_tensor_vs_flat=<y> ratio_weightsync_vs_flat=<z>``
(flat seconds / ours: higher is better, 1.0 is the wire's speed; ``nan`` for a figure a
failure left unmeasured), printed even when a step fails.  ``--model-config tiny`` runs in
seconds.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: the flat baseline
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: tests.peers
from broadcast import flat_broadcast, timed_pushes
from tests.helpers import WorkerProcess, free_port
from tests.peers.sglang_calls import init_custom_process_group

from weightsync.engines.reference import ReferenceEngine
from weightsync.trainer import Broadcaster, WorkerClient
from weightsync.worker_app import reference_config as _reference_config

GROUP = "sglang-bench"
TIMEOUT = datetime.timedelta(seconds=300)


def sglang_push(
    url: str, group: object, weights: dict[str, torch.Tensor], bucket: torch.Tensor | None
) -> float:
    """One SGLang-style update: the request posted while rank 0 broadcasts ``bucket`` (the
    tensors flattened, built before the request as SGLang's trainers build their
    ``FlattenedTensorBucket``) or, without one, each tensor; seconds from the post to the
    reply."""
    flattened = bucket is not None
    body = {
        "names": list(weights),
        "dtypes": [str(t.dtype).removeprefix("torch.") for t in weights.values()],
        "shapes": [list(t.shape) for t in weights.values()],
        "group_name": GROUP,
        "flush_cache": False,
        **({"load_format": "flattened_bucket"} if flattened else {}),
    }
    t0 = time.perf_counter()
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(requests.post, f"{url}/update_weights_from_distributed", json=body, timeout=600)
        if bucket is not None:
            dist.broadcast(bucket, 0, group=group)
        else:
            for t in weights.values():
                dist.broadcast(t, 0, group=group)
        reply = sent.result()
    took = time.perf_counter() - t0
    if reply.status_code != 200:
        raise RuntimeError(f"update refused: {reply.status_code} {reply.text[:300]}")
    return took


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model-config", default="qwen2.5-0.5b", choices=["tiny", "default", "qwen2.5-0.5b"])
    args = parser.parse_args()
    weights = ReferenceEngine(_reference_config(args.model_config)).model.weights()
    weights = {n: (t + 1).contiguous() for n, t in weights.items()}
    total = sum(t.numel() * t.element_size() for t in weights.values())
    print(f"{len(weights)} tensors, {total / 1e9:.2f} GB, gloo")

    flat = bucket = per = ours = math.nan
    failed = False
    try:
        flat = statistics.median(flat_broadcast(total, args.repeats, "gloo"))
        print(f"(a) one flat broadcast:       {flat:.3f} s ({total / flat / 1e9:.2f} GB/s)")
        worker = WorkerProcess(model_config=args.model_config).wait_ready(timeout=300)
        try:
            client = WorkerClient(worker.url)
            client.pause_generation()
            port = free_port()
            with ThreadPoolExecutor(1) as pool:
                forming = pool.submit(
                    init_custom_process_group, "gloo", f"tcp://127.0.0.1:{port}", 2, 0, GROUP, TIMEOUT
                )
                r = requests.post(f"{worker.url}/init_weights_update_group", json={
                    "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                    "group_name": GROUP, "backend": "gloo",
                }, timeout=300)  # fmt: skip
                r.raise_for_status()
                group = forming.result()
            try:
                t0 = time.perf_counter()
                flat_bucket = torch.cat([t.flatten().view(torch.uint8) for t in weights.values()])
                print(f"    the trainer's bucket built in {time.perf_counter() - t0:.3f} s (not timed below)")
                for flattened in (True, False):
                    sent = flat_bucket if flattened else None
                    sglang_push(worker.url, group, weights, sent)  # warm up
                    runs = [sglang_push(worker.url, group, weights, sent) for _ in range(args.repeats)]
                    took = statistics.median(runs)
                    if flattened:
                        bucket = took
                    else:
                        per = took
                    label = (
                        "(x) SGLang flattened_bucket:  " if flattened else "(y) SGLang per tensor:        "
                    )
                    print(f"{label}{took:.3f} s ({total / took / 1e9:.2f} GB/s)")
            finally:
                requests.post(
                    f"{worker.url}/destroy_weights_update_group", json={"group_name": GROUP}, timeout=60
                )
                dist.destroy_process_group(group)
            with Broadcaster([worker.url], backend="gloo", timeout_s=300) as b:
                ours = statistics.median(timed_pushes(b, weights, args.repeats))
                print(f"(z) weightsync packed stream:  {ours:.3f} s ({total / ours / 1e9:.2f} GB/s)")
            client.close()
        finally:
            worker.stop()
    except Exception:
        failed = True
        traceback.print_exc()
    print(
        f"RESULT ratio_bucket_vs_flat={flat / bucket:.2f} ratio_per_tensor_vs_flat={flat / per:.2f} "
        f"ratio_weightsync_vs_flat={flat / ours:.2f}",
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
