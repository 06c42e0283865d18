"""HTTP overhead of the admin surface: median latency of ``get_weight_version`` against a
bare route on the same app and server, in the same run.  Also completion throughput while
idle and while an ``allow_unpaused`` update streams in.

Last line: ``RESULT ratio_vs_bare=<x> p50_us=<y>`` (ours / bare; lower is better).
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
from fastapi.responses import JSONResponse

from weightsync.core import Controller
from weightsync.engines.reference import ReferenceEngine
from weightsync.serve import ServerThread, create_app
from weightsync.trainer import WorkerClient, save_checkpoint
from weightsync.trainer.client import sync_transport

ROUNDS = 2000


def p50_us(http: httpx.Client, method: str, path: str, rounds: int = ROUNDS) -> float:
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        body = b"{}" if method == "POST" else None
        r = http.request(method, path, content=body, headers={"content-type": "application/json"})
        samples.append(time.perf_counter_ns() - t0)
        assert r.status_code == 200
    return statistics.median(samples) / 1000


def throughput(client: WorkerClient, seconds: float, during: threading.Thread | None = None) -> float:
    """Completion tokens per second from 4 concurrent clients."""
    tokens = 0
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def worker() -> None:
        nonlocal tokens
        c = WorkerClient(client.base_url)
        while time.monotonic() < stop:
            n = len(c.complete("throughput", max_tokens=32)["choices"][0]["token_ids"])
            with lock:
                tokens += n
        c.close()

    threads = [threading.Thread(target=worker) for _ in range(4)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    if during is not None:
        during.start()
    for t in threads:
        t.join()
    if during is not None:
        during.join()
    return tokens / (time.monotonic() - t0)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        engine = ReferenceEngine(allowed_weight_dirs=[tmp])
        app = create_app(Controller(engine))

        @app.post("/bare")
        async def bare() -> JSONResponse:
            return JSONResponse({"status": "ok"})

        with (
            ServerThread(app) as server,
            httpx.Client(base_url=server.url, transport=sync_transport()) as http,
        ):
            p50_us(http, "POST", "/bare", 200)  # warm up
            bare_us = p50_us(http, "POST", "/bare")
            ours_us = p50_us(http, "POST", "/engine/get_weight_version")
            print(f"bare route p50:          {bare_us:8.1f} us")
            print(f"get_weight_version p50:  {ours_us:8.1f} us")

            client = WorkerClient(server.url)
            idle = throughput(client, 4.0)
            ckpt = save_checkpoint(
                {n: t.clone() for n, t in engine.model.weights().items()}, Path(tmp) / "c", version="bench"
            )
            updates = 0

            def keep_updating() -> None:
                nonlocal updates
                deadline = time.monotonic() + 3.5
                while time.monotonic() < deadline:
                    client.update_weights_from_disk(str(ckpt), allow_unpaused=True)
                    updates += 1

            busy = throughput(client, 4.0, threading.Thread(target=keep_updating))
            print(f"completion throughput idle:                {idle:8.1f} tokens/s")
            print(
                f"completion throughput during {updates:3d} updates: {busy:8.1f} tokens/s ({busy / idle:.2f}x)"
            )
            client.close()
    print(f"RESULT ratio_vs_bare={ours_us / bare_us:.2f} p50_us={ours_us:.1f}")


if __name__ == "__main__":
    main()
