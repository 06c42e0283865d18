"""Delta push against a full push, on the same weights and the same worker (a ``weightsync serve``
process on a gloo group with this trainer): the default reference model (~95 MB float32), an
RL step changing 0.1 %, 1 % and 5 % of every tensor's elements.  Each push is verified before
it commits (the full push by the per-tensor xxh3 of its packed stream, the delta by the base
digest and the linear digest of the changed elements) and each leaves the worker on the target's
digest, checked after every push.

Last lines: the cost of verification against applying (from the worker's own figures: the
linear check runs inside ``apply_s``; beside it the same check and a full rehash of the changed
tensors timed here on the same elements), then
``RESULT ratio_vs_full_at_0.1=<a> ratio_vs_full_at_1=<b> ratio_vs_full_at_5=<c>
wire_bytes_ratio_at_1=<w>`` (delta over full, time and bytes on the wire; lower is better).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: runs from any cwd
from tests.helpers import WorkerProcess

from weightsync.engines.reference import ReferenceEngine
from weightsync.trainer import Broadcaster, WorkerClient, weights_digest
from weightsync.trainer.delta import Fingerprint, compute_delta
from weightsync.transports.delta import linear
from weightsync.transports.hashing import tensor_hash
from weightsync.worker_app import reference_config as _reference_config

TIMEOUT_S = 300.0
FRACTIONS = (0.001, 0.01, 0.05)


def step(weights: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in weights.items():
        flat = t.clone().reshape(-1)
        idx = torch.randperm(flat.numel(), generator=gen)[: max(1, int(flat.numel() * fraction))]
        flat[idx] += 1e-3
        out[name] = flat.reshape(t.shape)
    return out


def check_costs(base: dict[str, torch.Tensor], manifest, payload) -> tuple[float, float, float]:  # type: ignore[no-untyped-def]
    """Seconds, here, of the write (gather old + scatter new), of the linear check of the same
    elements, and of a full xxh3 rehash of the changed tensors."""
    targets = {n: t.clone() for n, t in base.items()}
    write = check = rehash = 0.0
    for t in manifest.changed:
        flat, idx, values = targets[t.name].reshape(-1), payload[t.indices], payload[t.values]
        t0 = time.perf_counter()
        old = flat[idx]
        flat[idx] = values
        back = flat[idx]
        t1 = time.perf_counter()
        positions, old_words = linear.element_words(idx, old)
        _, new_words = linear.element_words(idx, back)
        linear.change(positions, old_words, new_words)
        t2 = time.perf_counter()
        tensor_hash(targets[t.name])
        t3 = time.perf_counter()
        write, check, rehash = write + t1 - t0, check + t2 - t1, rehash + t3 - t2
    return write, check, rehash


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-config", default="default", choices=["tiny", "default", "qwen2.5-0.5b"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    base = ReferenceEngine(_reference_config(args.model_config)).model.weights()
    base = {n: t.clone() for n, t in base.items()}
    full_bytes = sum(t.numel() * t.element_size() for t in base.values())
    print(f"{len(base)} tensors, {full_bytes / 1e6:.1f} MB")
    ratios = {f: math.nan for f in FRACTIONS}
    wire = math.nan
    failed = False
    try:
        worker = WorkerProcess(model_config=args.model_config).wait_ready(timeout=300)
        try:
            client = WorkerClient(worker.url)
            client.pause_generation()
            with Broadcaster([worker.url], timeout_s=TIMEOUT_S) as b:
                b.push(base, version="base")  # warm up: buffers allocated, pages faulted in
                base_print = Fingerprint.of(base)
                fulls, deltas = [], {f: [] for f in FRACTIONS}
                for r in range(args.repeats):
                    for k, fraction in enumerate(FRACTIONS):
                        target = step(base, fraction, seed=100 * r + k)
                        b.push(base, version="base")
                        t0 = time.perf_counter()
                        b.push(target, version="full")
                        fulls.append(time.perf_counter() - t0)
                        assert client.get_weight_version()["digest"] == weights_digest(target)
                        b.push(base, version="base")
                        manifest, payload = compute_delta(base, target, base_version="base",
                                                          target_version="delta", base_print=base_print)  # fmt: skip
                        t0 = time.perf_counter()
                        reply = b.push_delta(manifest, payload, version="delta")[worker.url]
                        deltas[fraction].append(time.perf_counter() - t0)
                        state = client.get_weight_version()
                        assert state["digest"] == weights_digest(target) and state["verified"] is True
                        figures = reply["stats"]["delta"]
                        if fraction == 0.01:
                            wire = figures["wire_bytes"] / full_bytes
                        if r == 0:
                            w, c, h = check_costs(base, manifest, payload)
                            print(f"{fraction * 100:g} %: {figures['elements_changed']} elements, "
                                  f"{figures['wire_bytes'] / 1e6:.2f} MB on the wire; worker: receive "
                                  f"{figures['receive_s']:.3f} s, apply+verify {figures['apply_s']:.3f} s; here: "
                                  f"write {w:.3f} s, linear check {c:.3f} s ({c / w:.2f}x the write), "
                                  f"full rehash of the changed tensors {h:.3f} s")  # fmt: skip
                full = statistics.median(fulls)
                print(f"full packed push: {full:.3f} s (median of {len(fulls)})")
                for fraction, times in deltas.items():
                    ratios[fraction] = statistics.median(times) / full
                    print(f"delta push at {fraction * 100:g} %: {statistics.median(times):.3f} s")
            client.close()
        finally:
            worker.stop()
    except Exception:
        failed = True
        traceback.print_exc()
    a, b_, c = (ratios[f] for f in FRACTIONS)
    print(f"RESULT ratio_vs_full_at_0.1={a:.3f} ratio_vs_full_at_1={b_:.3f} ratio_vs_full_at_5={c:.3f} "
          f"wire_bytes_ratio_at_1={wire:.4f}", flush=True)  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # a collective left waiting on a failed peer would hold a normal exit
