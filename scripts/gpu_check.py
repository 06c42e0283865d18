"""``make gpu-check``: the NCCL paths end to end, on a machine with CUDA.

On CPU it says why it cannot run and exits 2.  With CUDA it starts one ``weightsync serve
--engine vllm`` worker on a tiny random Llama made on the spot (no download) and drives it
with the peers' own trainer code, each step printed as ``ok``/``FAILED``/``cannot run``
(nothing is skipped silently):

1. a flat NCCL broadcast of the same bytes between two processes (the baseline);
2. vLLM's stock trainer, unchanged: ``nccl_common.trainer_init`` (``StatelessProcessGroup`` +
   ``PyNcclCommunicator``) and ``packed_nccl_broadcast_producer`` behind
   ``HTTPVLLMWeightSyncClient`` (the flow TRL 1.16's ``VLLMClient`` runs);
3. SGLang's ``init_custom_process_group`` on nccl with a per-tensor broadcast;
4. weightsync's own packed stream (``Broadcaster``, nccl).

NCCL refuses two ranks on one device, so the trainer and the worker need a GPU each: with one
GPU, steps 1–4 say so and the script exits 2 (CUDA IPC on one GPU is the vLLM tier's
``/engine/update_weights_from_tensor`` test).  Last line, when it ran:
``RESULT seconds_per_gb_flat=<a> seconds_per_gb_vllm=<b> seconds_per_gb_sglang=<c>
seconds_per_gb_weightsync=<d> ratio_weightsync_vs_flat=<e>``.  Bounded: every step has a
deadline and the whole run stops at 8 minutes.
"""

from __future__ import annotations

import datetime
import math
import os
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))  # the flat baseline
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: tests.peers, tests.vllm

DEADLINE_S = 8 * 60 - 30
STEP_S = 120


def why_not() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device: the NCCL paths need GPUs (on CPU, `make test` runs every path over gloo)"
    if torch.cuda.device_count() < 2:
        return (
            "one GPU: NCCL refuses two ranks on one device, and a trainer and a worker are two ranks; "
            "run on a machine with two GPUs (CUDA IPC on one GPU is tested by the vLLM tier)"
        )
    return None


def main() -> int:
    reason = why_not()
    if reason is not None:
        print(f"gpu-check cannot run here: {reason}")
        return 2
    import requests
    import torch
    import torch.distributed as dist
    from broadcast import flat_broadcast, timed_pushes
    from tests.helpers import free_port
    from tests.peers.sglang_calls import init_custom_process_group
    from tests.vllm.servers import vllm_worker
    from tests.vllm.tiny_llama import make_tiny_llama

    from weightsync.trainer import Broadcaster

    started = time.monotonic()
    torch.cuda.set_device(0)  # the trainer: GPU 0, CUDA initialized before the children's view is set
    torch.cuda.current_stream().synchronize()
    os.environ["CUDA_VISIBLE_DEVICES"] = "1"  # every child (the worker, the flat receiver): GPU 1
    results: dict[str, float] = {}
    failed = False
    root = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    model = make_tiny_llama(root / "model", dtype="bfloat16")
    worker = vllm_worker(model, root, log=root / "worker.log")
    try:
        url = worker.url
        info = requests.post(f"{url}/engine/weight_info", json={}, timeout=60).json()
        weights = {
            n: torch.randn(s, dtype=getattr(torch, d), device="cuda") * 0.02
            for n, d, s in zip(info["names"], info["dtypes"], info["shapes"], strict=True)
        }
        total = sum(t.numel() * t.element_size() for t in weights.values())

        def step(name: str, run: Any) -> None:
            nonlocal failed
            if time.monotonic() - started > DEADLINE_S:
                print(f"{name}: cannot run (the 8-minute budget is spent)")
                failed = True
                return
            try:
                seconds = run()
                results[name] = seconds / (total / 1e9)
                print(f"{name}: ok, {seconds:.3f} s ({results[name]:.3f} s/GB)")
            except Exception:
                failed = True
                print(f"{name}: FAILED")
                traceback.print_exc()

        step("flat", lambda: min(flat_broadcast(total, 3, "nccl")))

        def vllm_stock() -> float:
            from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient
            from vllm.distributed.weight_transfer.nccl_common import trainer_init
            from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

            client = HTTPVLLMWeightSyncClient(url, timeout=STEP_S)
            init = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1,
                    "world_size": 2, "packed": True}  # fmt: skip
            requests.post(f"{url}/pause?mode=wait", timeout=60)
            with ThreadPoolExecutor(1) as pool:
                joined = pool.submit(client.init_weight_transfer_engine, init)
                comm = trainer_init(init)
                joined.result(timeout=STEP_S)
                client.start_weight_update()
                meta = {"names": list(weights), "dtype_names": [str(t.dtype)[6:] for t in weights.values()],
                        "shapes": [list(t.shape) for t in weights.values()]}  # fmt: skip
                t0 = time.perf_counter()
                sent = pool.submit(client.update_weights, meta)
                packed_nccl_broadcast_producer(
                    iterator=iter(weights.items()), group=comm, src=0, post_iter_func=lambda item: item[1]
                )
                sent.result(timeout=STEP_S)
                took = time.perf_counter() - t0
            client.finish_weight_update("gpu-check-vllm")
            client.shutdown_weight_transfer_engine()
            requests.post(f"{url}/resume", timeout=60)
            return took

        step("vllm", vllm_stock)

        def sglang_nccl() -> float:
            port = free_port()
            body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                    "group_name": "gpu-check", "backend": "nccl"}  # fmt: skip
            with ThreadPoolExecutor(1) as pool:
                joined = pool.submit(
                    requests.post, f"{url}/init_weights_update_group", json=body, timeout=STEP_S
                )
                group = init_custom_process_group(
                    "nccl", f"tcp://127.0.0.1:{port}", 2, 0, "gpu-check", datetime.timedelta(seconds=STEP_S)
                )
                joined.result().raise_for_status()
                requests.post(f"{url}/pause_generation", json={"mode": "retract"}, timeout=60)
                update = {"names": list(weights), "dtypes": [str(t.dtype)[6:] for t in weights.values()],
                          "shapes": [list(t.shape) for t in weights.values()], "group_name": "gpu-check",
                          "weight_version": "gpu-check-sglang"}  # fmt: skip
                t0 = time.perf_counter()
                sent = pool.submit(requests.post, f"{url}/update_weights_from_distributed", json=update,
                                   timeout=STEP_S)  # fmt: skip
                for t in weights.values():
                    dist.broadcast(t, 0, group=group)
                sent.result().raise_for_status()
                took = time.perf_counter() - t0
            requests.post(f"{url}/continue_generation", json={}, timeout=60)
            requests.post(f"{url}/destroy_weights_update_group", json={"group_name": "gpu-check"}, timeout=60)
            dist.destroy_process_group(group)
            return took

        step("sglang", sglang_nccl)

        def weightsync_packed() -> float:
            requests.post(f"{url}/engine/pause_generation", json={"mode": "wait"}, timeout=60)
            with Broadcaster([url], backend="nccl", timeout_s=STEP_S) as b:
                (took,) = timed_pushes(b, weights, 1, version="gpu-check-weightsync")
            requests.post(f"{url}/engine/resume_generation", json={}, timeout=60)
            return took

        step("weightsync", weightsync_packed)
    finally:
        worker.stop()
    get = results.get
    print(
        f"RESULT seconds_per_gb_flat={get('flat', math.nan):.3f} seconds_per_gb_vllm={get('vllm', math.nan):.3f} "
        f"seconds_per_gb_sglang={get('sglang', math.nan):.3f} "
        f"seconds_per_gb_weightsync={get('weightsync', math.nan):.3f} "
        f"ratio_weightsync_vs_flat={get('flat', math.nan) / get('weightsync', math.nan):.2f}",
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
