"""Drain on refuse: how long a trainer's broadcast takes when the worker refuses the update,
against the same broadcast accepted, in one run.

A trainer written against OpenRLHF and SGLang (its group formed with SGLang's
``init_custom_process_group``, ``tests/peers/sglang_calls.py``, call for call) posts
``/engine/update_weights_from_distributed`` for a Qwen2.5-0.5B-shaped set (290 tensors,
~1 GB bf16) and broadcasts every tensor at once, without waiting for the reply, into one
reference-engine worker (a ``weightsync serve`` process) that joined the group with
``receiver: "process"``:

(r) refused: the worker is serving and the update does not allow that (``409 not_paused``); it
    still joins every broadcast the request declared, discarding the bytes, then answers;
(a) accepted: the same request and broadcasts while the worker is paused; the bytes are
    copied into the model and hashed.

Each figure is the time from the post until the trainer's last broadcast returns (what a
trainer waits for before its next step), the rounds interleaved, (r) and (a) taking turns at
going first; pausing and resuming between them is not timed.  ``--stream flat`` sends SGLang's
``flattened_bucket`` instead (one broadcast of everything).  Last line:
``RESULT ratio_refused_vs_accepted=<median (r) / median (a)> min=<x> max=<y>`` (the smallest
and largest per-round ratio; lower is better, the goal is at most 1.2; ``nan`` for a figure a
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
from typing import Any

import requests
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: tests.peers
from tests.helpers import WorkerProcess, free_port
from tests.peers.sglang_calls import init_custom_process_group

from weightsync.engines.reference import ReferenceEngine
from weightsync.worker_app import reference_config as _reference_config

GROUP = "drain-bench"
TIMEOUT = datetime.timedelta(seconds=300)


def post(url: str, route: str, body: dict[str, Any]) -> requests.Response:
    return requests.post(f"{url}/engine/{route}", json=body, timeout=600)


def one_update(url: str, group: Any, body: dict[str, Any], sent: list[torch.Tensor], code: int) -> float:
    """The update posted and every tensor of ``sent`` broadcast at once; seconds from the post
    until the last broadcast returned.  Raises unless the reply's status is ``code``."""
    with ThreadPoolExecutor(1) as pool:
        t0 = time.perf_counter()
        reply = pool.submit(post, url, "update_weights_from_distributed", body)
        for t in sent:
            dist.broadcast(t, 0, group=group)
        took = time.perf_counter() - t0
        r = reply.result()
    if r.status_code != code:
        raise RuntimeError(f"expected {code}, got {r.status_code}: {r.text[:300]}")
    return took


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--stream", default="per-tensor", choices=["per-tensor", "flat"])
    parser.add_argument("--model-config", default="qwen2.5-0.5b", choices=["tiny", "default", "qwen2.5-0.5b"])
    args = parser.parse_args()
    weights = ReferenceEngine(_reference_config(args.model_config)).model.weights()
    weights = {n: (t + 1).contiguous() for n, t in weights.items()}
    total = sum(t.numel() * t.element_size() for t in weights.values())
    flat = args.stream == "flat"
    sent = (
        [torch.cat([t.flatten().view(torch.uint8) for t in weights.values()])]
        if flat
        else list(weights.values())
    )
    print(f"{len(weights)} tensors, {total / 1e9:.2f} GB, {args.stream} stream, gloo, {args.rounds} rounds")
    body = {
        "names": list(weights),
        "dtypes": [str(t.dtype).removeprefix("torch.") for t in weights.values()],
        "shapes": [list(t.shape) for t in weights.values()],
        "group_name": GROUP,
        "reset_prefix_cache": False,
        **({"packing": {"flat": True}} if flat else {}),
    }

    refused: list[float] = []
    accepted: list[float] = []
    failed = False
    try:
        worker = WorkerProcess(model_config=args.model_config).wait_ready(timeout=300)
        try:
            port = free_port()
            with ThreadPoolExecutor(1) as pool:
                forming = pool.submit(
                    init_custom_process_group, "gloo", f"tcp://127.0.0.1:{port}", 2, 0, GROUP, TIMEOUT
                )
                post(
                    worker.url,
                    "init_weights_update_group",
                    {
                        "master_address": "127.0.0.1",
                        "master_port": port,
                        "rank_offset": 1,
                        "world_size": 2,
                        "group_name": GROUP,
                        "backend": "gloo",
                        "receiver": "process",
                        "timeout_s": 300,
                    },
                ).raise_for_status()
                group = forming.result()
            try:

                def refuse() -> float:  # the worker serves: 409 not_paused, the broadcasts drained
                    return one_update(worker.url, group, body, sent, 409)

                def accept() -> float:
                    post(worker.url, "pause_generation", {}).raise_for_status()
                    took = one_update(worker.url, group, body, sent, 200)
                    post(worker.url, "resume_generation", {}).raise_for_status()
                    return took

                refuse(), accept()  # warm up: the helper's segment, the worker's copies
                for n in range(args.rounds):
                    first, second = (refuse, accept) if n % 2 == 0 else (accept, refuse)
                    a, b = first(), second()
                    r, k = (a, b) if first is refuse else (b, a)
                    refused.append(r)
                    accepted.append(k)
                    print(f"round {n}: refused {r:.3f} s, accepted {k:.3f} s, ratio {r / k:.2f}", flush=True)
            finally:
                post(worker.url, "destroy_weights_update_group", {"group_name": GROUP})
                dist.destroy_process_group(group)
        finally:
            worker.stop()
    except Exception:
        failed = True
        traceback.print_exc()
    r = statistics.median(refused) if refused else math.nan
    k = statistics.median(accepted) if accepted else math.nan
    ratios = [x / y for x, y in zip(refused, accepted, strict=True)] or [math.nan]
    if refused:
        print(f"(r) refused, drained: {r:.3f} s ({total / r / 1e9:.2f} GB/s)")
        print(f"(a) accepted:         {k:.3f} s ({total / k / 1e9:.2f} GB/s)")
    print(
        f"RESULT ratio_refused_vs_accepted={r / k:.2f} min={min(ratios):.2f} max={max(ratios):.2f}",
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
