"""``weightsync router-demo``: a small fleet behind the router doing a rolling update while
requests keep succeeding.

Three reference workers (``weightsync serve --model-config tiny``) start on free loopback
ports, a router runs in this process in front of them, and four clients send completions
all along.  Two rolling updates (``max_unavailable=1``) move the fleet to new checkpoints,
one worker at a time; the demo prints each worker's routing state as it changes and, at the
end, how many requests succeeded, which (version, epoch) pairs served them, and where every
worker ended.  Exit status 0 when no request failed and every worker serves the last epoch.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

CLIENTS = 4


def _free_socket() -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def _port() -> int:
    with _free_socket() as s:
        return int(s.getsockname()[1])


def start_workers(n: int) -> list[tuple[subprocess.Popen[bytes], str]]:
    """Start ``n`` ``weightsync serve --model-config tiny`` processes on free ports, labelled
    ``"step-0"`` (what the demos' first commit describes); each process and its URL."""
    out = []
    for _ in range(n):
        port = _port()
        cmd = [sys.executable, "-m", "weightsync.cli", "serve", "--model-config", "tiny", "--port", str(port),
               "--initial-version", '"step-0"']  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        out.append((proc, f"http://127.0.0.1:{port}"))
    return out


def _checkpoints(tmp: Path, steps: int) -> list[str]:
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "weightsync.cli",
                "checkpoint",
                "--model-config",
                "tiny",
                "--out",
                str(tmp / f"step-{i}"),
                "--seed",
                str(i),
                "--version",
                f"step-{i}",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        for i in range(1, steps + 1)
    ]
    paths = []
    for p in procs:
        out, _ = p.communicate(timeout=300)
        if p.returncode != 0:
            raise RuntimeError("weightsync checkpoint failed")
        paths.append(out.decode().strip())
    return paths


def stop_workers(workers: list[tuple[subprocess.Popen[bytes], str]]) -> None:
    """Stop the worker processes :func:`start_workers` started: terminate, then kill what
    has not ended 20 s later."""
    for proc, _ in workers:
        proc.terminate()
    for proc, _ in workers:
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


async def wait_healthy(url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as http:
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if (await http.get(f"{url}/health", timeout=1)).status_code == 200:
                    return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not become healthy")


async def _demo(urls: list[str], checkpoints: list[str]) -> int:
    import uvicorn

    from weightsync.router.app import KEEP_ALIVE_S, create_router_app
    from weightsync.router.service import Router

    router = Router(urls, poll_interval_s=0.2)
    sock = _free_socket()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(
        uvicorn.Config(
            create_router_app(router), log_level="warning", lifespan="on", timeout_keep_alive=KEEP_ALIVE_S
        )
    )
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    await wait_healthy(url)
    print(f"router on {url} in front of {len(urls)} workers (baseline: {router.view.baseline.message})")

    served: collections.Counter[tuple[Any, Any]] = collections.Counter()
    failed: collections.Counter[str] = collections.Counter()
    stop = asyncio.Event()

    async def client(http: httpx.AsyncClient, i: int) -> None:
        while not stop.is_set():
            r = await http.post("/v1/completions", json={"prompt": f"client {i}", "max_tokens": 8})
            body = r.json()
            if r.status_code == 200:
                served[(body["weight_version"], body["weight_epoch"])] += 1
            else:
                failed[body.get("code", str(r.status_code))] += 1
                await asyncio.sleep(0.05)

    async def watch() -> None:
        last: dict[str, str] = {}
        while not stop.is_set():
            for w in router.view.status()["workers"]:
                if last.get(w["url"]) != w["state"]:
                    last[w["url"]] = w["state"]
                    print(f"  {w['url']}: {w['state']} (version {w['version']}, epoch {w['epoch']})")
            await asyncio.sleep(0.02)

    code = 0
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        tasks = [asyncio.create_task(client(http, i)) for i in range(CLIENTS)]
        watcher = asyncio.create_task(watch())
        await asyncio.sleep(1.0)
        for step, path in enumerate(checkpoints, start=1):
            print(
                f"rolling update to step-{step}, max_unavailable=1 ({sum(served.values())} requests served so far)"
            )
            r = await http.post(
                "/fleet/update_weights_from_disk",
                json={"model_path": path, "weight_version": f"step-{step}", "max_unavailable": 1},
            )
            result = r.json()
            print(f"  -> {result.get('phase')}, epoch {result.get('epoch')}")
            if r.status_code != 200:
                print(f"  the update failed: {result.get('code')}: {result.get('message')}")
                code = 1
            await asyncio.sleep(1.0)
        stop.set()
        await asyncio.gather(*tasks, watcher)
        status = (await http.get("/fleet/status")).json()
    server.should_exit = True
    await serving

    total = sum(served.values())
    print(f"\n{total} completions served, {sum(failed.values())} failed {dict(failed) or ''}")
    for (version, epoch), n in sorted(served.items(), key=lambda kv: kv[0][1] or 0):
        print(f"  {n:5d} from version {version!r} (epoch {epoch})")
    for w in status["workers"]:
        print(f"  {w['url']}: {w['state']}, version {w['version']!r}, epoch {w['epoch']}")
    if failed or any(w["epoch"] != status["epoch"] for w in status["workers"]):
        code = 1
    return code


def run_router_demo(steps: int = 2) -> int:
    """Run the demo; 0 when no request failed and the fleet ended on its last epoch."""
    workers = start_workers(3)
    try:
        with tempfile.TemporaryDirectory(prefix="weightsync-router-demo-") as tmp:
            print("starting 3 workers and writing checkpoints ...")
            checkpoints = _checkpoints(Path(tmp), steps)

            async def main() -> int:
                await asyncio.gather(*(wait_healthy(u) for _, u in workers))
                return await _demo([u for _, u in workers], checkpoints)

            return asyncio.run(main())
    finally:
        stop_workers(workers)
