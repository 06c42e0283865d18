"""How long a dry run of a checkpoint stalls a real vLLM's generation, same run.

A dry run (``update_weights_from_disk`` with ``dry_run: true``) reads and hashes every byte
of the checkpoint while the worker serves.  The baseline runs it as one ``collective_rpc``
(``weightsync_check``): vLLM's engine core waits for the worker's answer, so no request
steps until the whole checkpoint is hashed.  weightsync's adapter starts the same check in a
thread of the worker (``weightsync_check_start``) and polls for its result, so the engine
keeps stepping in between (the two compete for the cores instead).

Each round streams one long greedy request, runs a dry run while it generates (what the
check verified is forgotten first, so each one reads the checkpoint), and records the
longest gap between two tokens during the check; a round without a check gives the usual
gap.  Last line: ``RESULT stall_blocking_s=<x> stall_threaded_s=<y> ratio=<y/x>
check_blocking_s=<a> check_threaded_s=<b>`` (medians over rounds; the stall is the longest
gap minus the usual one; lower is better).  The machine is noisy; only the ratio counts.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from weightsync.engines.vllm.worker import WeightSyncExtension


class StallExtension(WeightSyncExtension):
    def bench_forget(self) -> None:
        """Forget what dry runs verified, so that the next one reads the checkpoint."""
        if self._ws_facts is not None:
            self._ws_facts.clear()


async def gaps_while(llm: object, check: object | None) -> tuple[float, float]:
    """The longest gap between two tokens of a streaming request while ``check`` (a
    coroutine factory) runs, and how long it ran (no check: the whole request)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True, detokenize=False)
    times: list[float] = []
    started = asyncio.Event()

    async def stream() -> None:
        rid = f"stall-{time.monotonic_ns()}"
        async for _ in llm.generate({"prompt_token_ids": [1, 2, 3, 4]}, params, request_id=rid):  # type: ignore[attr-defined]
            times.append(time.perf_counter())
            if len(times) == 20:
                started.set()

    task = asyncio.ensure_future(stream())
    await started.wait()
    if check is None:
        await task
        t0, t1 = times[20], times[-1]
    else:
        t0 = time.perf_counter()
        await check()  # type: ignore[operator]
        t1 = time.perf_counter()
        await task
    window = [b - a for a, b in itertools.pairwise(times) if b >= t0 and a <= t1]
    return max(window), t1 - t0


async def main() -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm_update import make_llama

    from weightsync.core import DiskSource
    from weightsync.engines.vllm import VllmEngine

    rounds = int(os.environ.get("REPEATS", "3"))
    with tempfile.TemporaryDirectory() as tmp:
        a, b = make_llama(Path(tmp) / "a", 1), make_llama(Path(tmp) / "b", 2)
        size = sum(f.stat().st_size for f in b.glob("*.safetensors"))
        print(f"checkpoint: {size / 1e6:.0f} MB")
        args = AsyncEngineArgs(
            model=str(a), worker_extension_cls="vllm_dry_run_stall.StallExtension", skip_tokenizer_init=True,
            enforce_eager=True, gpu_memory_utilization=0.2, dtype="float32", max_model_len=512,
        )  # fmt: skip
        llm = AsyncLLM.from_engine_args(args)
        engine = VllmEngine(llm, owns=True)
        wire = DiskSource(str(b)).to_wire()

        async def blocking() -> None:
            await llm.collective_rpc("bench_forget")
            (out,) = await llm.collective_rpc("weightsync_check", args=(wire, None))
            assert "error" not in out, out

        async def threaded() -> None:
            await llm.collective_rpc("bench_forget")
            await engine.check_source(DiskSource(str(b)))

        usual, stall_b, stall_t, secs_b, secs_t = [], [], [], [], []
        await gaps_while(llm, None)  # warm up
        for _ in range(rounds):
            usual.append((await gaps_while(llm, None))[0])
            gap, secs = await gaps_while(llm, blocking)
            stall_b.append(gap)
            secs_b.append(secs)
            gap, secs = await gaps_while(llm, threaded)
            stall_t.append(gap)
            secs_t.append(secs)
        base = statistics.median(usual)
        sb, st = statistics.median(stall_b) - base, statistics.median(stall_t) - base
        print(f"usual longest gap between tokens: {base * 1e3:.1f} ms")
        print(
            f"blocking check:  longest gap {statistics.median(stall_b) * 1e3:.1f} ms, check {statistics.median(secs_b):.3f} s"
        )
        print(
            f"threaded check:  longest gap {statistics.median(stall_t) * 1e3:.1f} ms, check {statistics.median(secs_t):.3f} s"
        )
        await engine.close()
    print(
        f"RESULT stall_blocking_s={sb:.3f} stall_threaded_s={st:.3f} ratio={st / sb if sb > 0 else float('nan'):.2f} "
        f"check_blocking_s={statistics.median(secs_b):.3f} check_threaded_s={statistics.median(secs_t):.3f}"
    )


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    asyncio.run(main())
