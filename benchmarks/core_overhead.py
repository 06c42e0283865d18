"""Median cost of one controller command against a bare asyncio.Lock round trip.

Last line: ``RESULT us_per_command=<x> ratio_vs_lock=<y>`` where the ratio is the
controller's median over the lock's (how many lock round trips one command costs).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable

from weightsync.core import Controller, Declared, DiskSource, PauseRequest, UpdateRequest
from weightsync.testing import ScriptableEngine

ROUNDS = 3000


async def median_us(op: Callable[[], Awaitable[object]], rounds: int = ROUNDS) -> float:
    for _ in range(200):
        await op()
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        await op()
        samples.append(time.perf_counter_ns() - t0)
    return statistics.median(samples) / 1000


async def main() -> None:
    lock = asyncio.Lock()

    async def bare() -> None:
        async with lock:
            pass

    c = Controller(ScriptableEngine())
    v = Declared("v")
    noop_update = UpdateRequest(DiskSource("ok:same"), None, allow_unpaused=True, reset_prefix_cache=False)

    async def pause_resume() -> None:
        await c.pause(PauseRequest())
        await c.resume()

    lock_us = await median_us(bare)
    results = {
        "declare": await median_us(lambda: c.declare(v)),
        "pause+resume (per command)": await median_us(pause_resume) / 2,
        "no-op update": await median_us(lambda: c.update(noop_update)),
    }
    print(f"bare asyncio.Lock round trip: {lock_us:8.2f} us")
    for name, us in results.items():
        print(f"{name:28s}: {us:8.2f} us  ({us / lock_us:6.1f}x lock)")
    overall = statistics.median(results.values())
    print(f"RESULT us_per_command={overall:.2f} ratio_vs_lock={overall / lock_us:.1f}")


if __name__ == "__main__":
    asyncio.run(main())
