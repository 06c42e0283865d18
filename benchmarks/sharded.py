"""A sharded, multi-source plan against today's rank-0 broadcast, same weights, same run.

M trainer ranks (this process is rank 0, the others are subprocesses) hold FSDP-style
dim-0 shards of a reference model's weights and push them into W one-process reference
workers (``weightsync serve``) with :class:`~weightsync.trainer.sharded.ShardedPusher`;
the baseline pushes the same full weights from rank 0 alone with
:class:`~weightsync.trainer.broadcast.Broadcaster` (packed, double-buffered broadcast) into
the same workers.  Both are timed from the trainer's call to every worker's reply.

The comparison is kept fair: the same weights (the broadcast sends them whole, the plan as
the ranks' shards), the same workers with both groups joined at once, the same processes
alive (the other trainer ranks wait, blocked, during a broadcast), one warm-up push each,
then ``--repeats`` pushes of each interleaved and each first in turn (the machine's load
drifts), medians compared.  Both verify every byte before they commit (the broadcast per
tensor, the plan per piece, against the senders' xxh3-64) and report the digest of the
full tensors; each reply's ``verified`` is checked.  Beside the times the script prints the
CPU time every process of the run used per push (a worker's with the helper processes that
receive a plan for it), a figure that other load on the machine does not move.

Last line: ``RESULT ratio_vs_broadcast=<sharded s / broadcast s> max_sender_share=<busiest
sender's bytes / all bytes sent> receiver_excess=<bytes received / bytes served, summed
over receivers>``.  On one CPU machine there is no network to win on (every "link" is the
same memory bus), so the goal here is a time ratio of at most 1.1; the speed-up is a GPU
figure: the script runs unchanged with ``--backend nccl`` (one GPU per process).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import textwrap
import time

sys.path.insert(0, ".")

RANK = """
import sys
import torch
sys.path.insert(0, ".")
from benchmarks.sharded import held_by, layout_of, weights_of
from weightsync.trainer.sharded import ShardedPusher
rank, ranks, port, config, backend, pushes = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
    sys.argv[4], sys.argv[5], int(sys.argv[6]))
if backend == "nccl":
    torch.cuda.set_device(rank % torch.cuda.device_count())
weights = weights_of(config, "cuda" if backend == "nccl" else "cpu")
layout = layout_of(weights, ranks)
p = ShardedPusher(rank, layout, master_port=port, backend=backend, timeout_s=300).connect()
mine = held_by(layout, rank, weights)
for _ in range(pushes):
    p.push(mine)
p.close()
"""


def weights_of(config: str, device: str) -> dict:
    from weightsync.engines.reference.model import CausalLM
    from weightsync.worker_app import reference_config as _reference_config

    return {n: (t + 1).to(device) for n, t in CausalLM(_reference_config(config), slots=1).weights().items()}


def layout_of(weights: dict, ranks: int):
    from weightsync.core.plan.layouts import TrainerLayout
    from weightsync.core.snapshot import TensorSpec
    from weightsync.transports.sink import dtype_name

    specs = [TensorSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in weights.items()]
    return TrainerLayout.fsdp(specs, ranks)


def held_by(layout, rank: int, weights: dict) -> dict:
    return {
        n: weights[n][tuple(slice(a, b) for a, b in boxes[0].bounds)].contiguous()
        for n, boxes in layout.held_by(rank).items()
    }


def cpu_seconds(pids: list[int]) -> float:
    """CPU time (user + system) the processes ``pids`` used so far, from ``/proc`` (0 elsewhere):
    what a push costs the machine whatever else runs on it."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def family(pid: int) -> list[int]:
    """``pid`` and every process below it (from ``/proc``; just ``pid`` elsewhere): a worker
    and the helper processes that receive a plan for it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        out.append(todo.pop())
        todo.extend(children.get(out[-1], []))
    return out


def main() -> None:
    from tests.helpers import WorkerProcess, free_port

    from weightsync.core.plan.value import max_sender_share, receiver_excess
    from weightsync.trainer.broadcast import Broadcaster
    from weightsync.trainer.client import WorkerClient
    from weightsync.trainer.sharded import ShardedPusher

    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--ranks", type=int, default=2, help="trainer ranks")
    parser.add_argument("--workers", type=int, default=2, help="one-process workers")
    parser.add_argument("--model-config", default="default", choices=["default", "tiny", "qwen2.5-0.5b"])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = "cuda" if args.backend == "nccl" else "cpu"
    weights = weights_of(args.model_config, device)
    total = sum(t.numel() * t.element_size() for t in weights.values())
    print(f"{len(weights)} tensors, {total / 1e6:.1f} MB; {args.ranks} trainer ranks -> {args.workers} workers, "
          f"backend {args.backend}")  # fmt: skip
    workers = [WorkerProcess(model_config=args.model_config) for _ in range(args.workers)]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for w in workers:
            w.wait_ready(timeout=300)
            WorkerClient(w.url).pause_generation()
        urls = [w.url for w in workers]
        layout = layout_of(weights, args.ranks)
        port = free_port()
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    textwrap.dedent(RANK),
                    str(r),
                    str(args.ranks),
                    str(port),
                    args.model_config,
                    args.backend,
                    str(args.repeats + 1),
                ]
            )
            for r in range(1, args.ranks)
        ]
        mine = held_by(layout, 0, weights)
        with (
            Broadcaster(urls, backend=args.backend, timeout_s=300) as b,
            ShardedPusher(
                0, layout, workers=urls, master_port=port, backend=args.backend, timeout_s=300
            ) as p,
        ):

            def broadcast(version: str) -> dict:
                return b.push(weights, version=version)

            def sharded(version: str) -> dict:
                return p.push(mine, version=version)

            def measured() -> list[list[int]]:
                """The processes of each figure: each trainer rank's, then each worker's with
                the helper processes that receive for it."""
                ranks = [[os.getpid()], *([q.pid] for q in procs)]
                return [*ranks, *(family(w.proc.pid) for w in workers)]

            runs: dict = {broadcast: [], sharded: []}
            cpu: dict = {broadcast: [], sharded: []}
            per: dict = {broadcast: [], sharded: []}  # CPU per process, trainer ranks then workers
            for f in runs:  # warm up both
                f("warm-up")
            # Interleaved, each first in turn, so that both see the same (noisy) machine.
            for i in range(args.repeats):
                for f in (broadcast, sharded) if i % 2 == 0 else (sharded, broadcast):
                    each0, t0 = [cpu_seconds(q) for q in measured()], time.perf_counter()
                    replies = f(f.__name__)
                    runs[f].append(time.perf_counter() - t0)
                    each = [cpu_seconds(q) - c for q, c in zip(measured(), each0, strict=True)]
                    cpu[f].append(sum(each))
                    per[f].append(each)
                    # Both sides verify every byte (xxh3-64 against the senders') before commit.
                    assert all(r["verified"] for r in replies.values()), replies
            plan = p.plan
        for proc in procs:
            proc.wait(120)
        bcast, shard = statistics.median(runs[broadcast]), statistics.median(runs[sharded])
        s = plan.summary()

        def by_process(f) -> str:  # medians per process: trainer rank 0.., then workers
            return " ".join(f"{statistics.median(col):.3f}" for col in zip(*per[f], strict=True))

        print(f"rank-0 broadcast:  {bcast:.3f} s  {[round(t, 3) for t in runs[broadcast]]}, "
              f"cpu {statistics.median(cpu[broadcast]):.3f} s [{by_process(broadcast)}]")  # fmt: skip
        print(f"sharded plan:      {shard:.3f} s  {[round(t, 3) for t in runs[sharded]]}, "
              f"cpu {statistics.median(cpu[sharded]):.3f} s [{by_process(sharded)}] ({s['transfers']} "
              f"messages in {s['rounds']} rounds; senders {[x['bytes'] for x in s['senders']]})")  # fmt: skip
        last = "sharded" if args.repeats % 2 else "broadcast"
        for w in workers:
            assert WorkerClient(w.url).get_weight_version()["version"] == last
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for w in workers:
            w.stop()
    print(
        f"RESULT ratio_vs_broadcast={shard / bcast:.2f} max_sender_share={max_sender_share(plan):.3f} "
        f"receiver_excess={receiver_excess(plan):.3f}"
    )


if __name__ == "__main__":
    main()
