"""A full validated disk update into the reference engine against two baselines, same run.

Checkpoint: Qwen2.5-0.5B-shaped (290 tensors, bf16, ~1 GB, in shards of about half of it, written by our writer
with its manifest, so checksums are verified too).  Baselines:
(a) a raw sequential read of the same files from page cache (``readinto`` a buffer);
(b) ``safetensors.torch.load_file`` of every shard, then ``copy_`` into the engine.
For reference it also prints a memory-mapped copy into the engine (what a load that may
die of SIGBUS could do; not a baseline of a RESULT).

Two updates are timed: a cold one (paused, no dry run: the checksum pass, then the copy)
and the pause window of a prepared one (a dry run while running, then the time from pause
to resume: one copy, hashed as it is read).

Last line: ``RESULT ratio_vs_raw_read=<x> ratio_vs_naive=<y> ratio_pause_vs_naive=<w>
peak_extra_mb=<z> fused_hash_s=<h> fused_hash_pct=<p>`` where each ratio is baseline
seconds / ours (higher is better; ``ratio_pause_vs_naive`` for the pause window, the others
for the cold update), peak_extra_mb is the most anonymous memory a cold update added
(sampled in an untimed run of its own; the largest shard is printed for comparison), and
fused_hash_s / fused_hash_pct the time spent hashing every tensor as it is copied and its
share of the cold update.
"""

from __future__ import annotations

import argparse
import asyncio
import mmap
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from weightsync.core import Controller, Declared, DiskSource, PauseRequest, UpdateRequest
from weightsync.engines.reference import ModelConfig, ReferenceEngine
from weightsync.trainer import save_checkpoint
from weightsync.transports.disk import ShardHeader

sys.path.insert(0, ".")
from tests.helpers import PeakAnonMemory


def raw_read(files: list[Path], buf: bytearray) -> float:
    """Read every file into ``buf`` (allocated and touched once, outside the timing, as the
    engine's weights are: a fresh buffer would time first-touch page faults too)."""
    view = memoryview(buf)
    t0 = time.perf_counter()
    for f in files:
        with f.open("rb", buffering=0) as fh:
            n = fh.readinto(view)
            assert n == f.stat().st_size
    return time.perf_counter() - t0


def naive(files: list[Path], weights: dict[str, torch.Tensor]) -> float:
    t0 = time.perf_counter()
    for f in files:
        for name, t in load_file(str(f)).items():
            weights[name].copy_(t)
    return time.perf_counter() - t0


def mapped(files: list[Path], weights: dict[str, torch.Tensor]) -> float:
    t0 = time.perf_counter()
    for f in files:
        with f.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as m:
            view = memoryview(m)
            for entry in ShardHeader.read(f).tensors.values():
                weights[entry.spec.name].view(-1).view(torch.uint8).numpy()[:] = view[entry.start : entry.end]
            view.release()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    engine = ReferenceEngine(ModelConfig.qwen2_5_0_5b())
    weights = engine.model.weights()
    total = sum(t.numel() * t.element_size() for t in weights.values())
    print(f"engine: {len(weights)} tensors, {total / 1e9:.2f} GB ({next(iter(weights.values())).dtype})")
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        ckpt = save_checkpoint(weights, Path(tmp) / "ckpt", version="bench", shard_bytes=total // 2 + 1)
        files = sorted(ckpt.glob("*.safetensors"))
        largest = max(f.stat().st_size for f in files)
        print(f"checkpoint: {len(files)} shards, largest {largest / 1e6:.0f} MB")
        buf = bytearray(largest)
        raw_read(files, buf)  # into page cache (and every page of buf touched)

        facts = engine.load_context.facts
        assert facts is not None
        request = UpdateRequest(DiskSource(str(ckpt)), Declared("bench"))

        async def ours() -> tuple[float, float]:
            facts.clear()  # cold: nothing verified before
            c = Controller(engine)
            await c.pause(PauseRequest())
            t0 = time.perf_counter()
            out = await c.update(request)
            seconds = time.perf_counter() - t0
            assert out.stats.tensors == len(weights) and not out.stats.extra["prepared"]
            hashing = float(out.stats.extra.get("hash_seconds", 0.0))
            print(f"  ours: {seconds:.3f} s total, engine load {out.stats.seconds:.3f} s "
                  f"(validation + checksums {out.stats.extra['validate_seconds']:.3f} s, "
                  f"hashing fused with the copy {hashing:.3f} s)")  # fmt: skip
            return seconds, hashing

        async def peak_memory() -> int:
            """The most anonymous memory a cold update adds, in an untimed run of its own
            (the sampler shares the GIL, so the timed runs go without it, like the naive)."""
            facts.clear()
            c = Controller(engine)
            await c.pause(PauseRequest())
            with PeakAnonMemory(interval=0.005) as peak:
                await c.update(request)
            return peak.extra

        async def pause_window() -> float:
            c = Controller(engine)  # running
            dry = time.perf_counter()
            await c.dry_run(request)  # verified while serving
            dry = time.perf_counter() - dry
            t0 = time.perf_counter()
            await c.pause(PauseRequest())
            out = await c.update(request)
            await c.resume()
            seconds = time.perf_counter() - t0
            assert out.stats.tensors == len(weights) and out.stats.extra["prepared"]
            print(f"  prepared: dry run {dry:.3f} s while running, then pause -> resume {seconds:.3f} s")
            return seconds

        raws, naives, ourses, extras, hashings, pauses, mappeds = [], [], [], [], [], [], []
        for _ in range(args.repeats):
            raws.append(raw_read(files, buf))
            naives.append(naive(files, weights))
            mappeds.append(mapped(files, weights))
            s, hashing = asyncio.run(ours())
            ourses.append(s)
            hashings.append(hashing)
            pauses.append(asyncio.run(pause_window()))
        extras.append(asyncio.run(peak_memory()))
        raw_s, naive_s, ours_s, pause_s = (statistics.median(x) for x in (raws, naives, ourses, pauses))
        print(f"raw sequential read:       {raw_s:.3f} s ({total / raw_s / 1e9:.2f} GB/s)")
        print(f"load_file + copy (naive):  {naive_s:.3f} s")
        print(f"mapped copy (reference):   {statistics.median(mappeds):.3f} s")
        print(
            f"weightsync validated load: {ours_s:.3f} s ({total / ours_s / 1e9:.2f} GB/s, checksums included)"
        )
        print(
            f"pause window after a dry run: {pause_s:.3f} s ({total / pause_s / 1e9:.2f} GB/s, one hashed copy)"
        )
        peak_mb = max(extras) / 1e6
        print(f"peak extra anonymous memory: {peak_mb:.1f} MB (largest shard {largest / 1e6:.0f} MB)")
        hash_s = statistics.median(hashings)
    print(
        f"RESULT ratio_vs_raw_read={raw_s / ours_s:.2f} ratio_vs_naive={naive_s / ours_s:.2f}"
        f" ratio_pause_vs_naive={naive_s / pause_s:.2f} peak_extra_mb={peak_mb:.1f}"
        f" fused_hash_s={hash_s:.3f} fused_hash_pct={100 * hash_s / ours_s:.1f}"
    )


if __name__ == "__main__":
    main()
