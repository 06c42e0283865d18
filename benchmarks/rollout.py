"""Rollout generation through weightsync against the engine it serves, same run: ``--n`` samples
per prompt with logprobs (``logprobs: 1``), streamed and not.

Every configuration answers the same rounds: ``--prompts`` requests at once, one per prompt,
each asking for ``n`` samples of ``--max-tokens`` tokens (``ignore_eos``, temperature 1,
seeded); its figure is completion tokens per second over the round's wall time, the median of
``--rounds`` rounds after one warm-up round.

* Reference engine (``--model-config``): the baseline is the engine driven in-process, each
  sample one ``generate`` (or ``stream``) call with the same sampling and the seeds the worker
  gives its ``n`` samples; against it a ``weightsync serve`` worker (``/v1/completions``) and a
  ``weightsync router`` in front of that worker.
* vLLM (the tiny Llama of ``tests/vllm``, float32, token-id prompts, the tests' engine
  arguments): the baseline is vLLM's own OpenAI server, against it ``weightsync serve --engine
  vllm``; the same body to both (``return_tokens_as_token_ids``: both run without a
  tokenizer).  Both run at once, their rounds interleaved, each reserving a tenth of host
  memory; their rounds are short, so there are three times as many.

Each ratio is ours over the baseline, the worse of streamed and not.  ``--quick`` is a small
run (the tiny reference model, short completions, one round) that checks the script works;
``--no-vllm`` leaves vLLM out (its ratio is then ``nan``).

Last line: ``RESULT ratio_worker_vs_engine=<x> ratio_router_vs_engine=<y>
ratio_vllm_vs_vllm_server=<z>`` (tokens per second, higher is better; goal x ≥ 0.9, y ≥ 0.85,
z ≥ 0.9).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: runs from any cwd
from tests.helpers import RouterProcess, WorkerProcess

from weightsync.engines.reference import ModelConfig, build_engine
from weightsync.engines.stamps import Chunk
from weightsync.trainer.checkpoint import save_checkpoint

SEED = 1234
VLLM_MEMORY = 0.1
"""The share of host memory each vLLM reserves (its KV cache): both run at once."""
VLLM_ROUNDS = 3
"""vLLM's rounds are short (the tiny Llama): this many times ``--rounds`` of them."""
Round = Callable[[bool], Awaitable[int]]
"""One round of a configuration, streamed or not: the completion tokens it produced."""


def prompts(count: int) -> list[list[int]]:
    """``count`` distinct token-id prompts (bytes, so the reference engine and the tiny Llama's
    512-token vocabulary both take them)."""
    return [list(f"Question {i}: what does rollout {i} sample next?".encode()) for i in range(count)]


def body(prompt: list[int], args: argparse.Namespace, stream: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt": prompt, "n": args.n, "max_tokens": args.max_tokens, "temperature": 1.0, "seed": SEED,
        "logprobs": 1, "ignore_eos": True, "return_tokens_as_token_ids": True, "stream": stream,
    }  # fmt: skip
    if stream:
        out["stream_options"] = {"include_usage": True}
    return out


async def completion_tokens(http: httpx.AsyncClient, url: str, payload: dict[str, Any]) -> int:
    """Post one completion (streamed or not) and return its ``usage.completion_tokens``, after
    checking every sample came back with a logprob per token."""
    if not payload["stream"]:
        r = await http.post(f"{url}/v1/completions", json=payload)
        assert r.status_code == 200, r.text
        reply = r.json()
        assert all(len(c["logprobs"]["token_logprobs"]) == payload["max_tokens"] for c in reply["choices"])
        return int(reply["usage"]["completion_tokens"])
    usage, logprobs, done = None, 0, False
    async with http.stream("POST", f"{url}/v1/completions", json=payload) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line:
                continue
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line.removeprefix("data: "))
            assert "error" not in event, event
            usage = event.get("usage") or usage
            for choice in event["choices"]:
                logprobs += len((choice.get("logprobs") or {}).get("token_logprobs") or [])
    assert done and usage is not None
    assert logprobs == usage["completion_tokens"], (logprobs, usage)
    return int(usage["completion_tokens"])


def http_round(http: httpx.AsyncClient, url: str, model: str | None, args: argparse.Namespace) -> Round:
    async def run(stream: bool) -> int:
        extra = {} if model is None else {"model": model}
        counts = await asyncio.gather(
            *(completion_tokens(http, url, {**body(p, args, stream), **extra}) for p in prompts(args.prompts))
        )
        return sum(counts)

    return run


def engine_round(engine: Any, args: argparse.Namespace) -> Round:
    """The reference engine in-process: sample ``j`` of a prompt seeded ``SEED + j``, as the
    worker seeds its ``n`` samples."""

    async def sample(prompt: list[int], j: int, stream: bool) -> int:
        fields = {"max_tokens": args.max_tokens, "temperature": 1.0, "seed": SEED + j, "logprobs": 1,
                  "ignore_eos": True}  # fmt: skip
        if not stream:
            out = await engine.generate(prompt, **fields)
            assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
            return len(out.token_ids)
        count = 0
        async for item in engine.stream(prompt, **fields):
            if isinstance(item, Chunk):
                assert item.logprobs is not None
                count += len(item.token_ids)
        return count

    async def run(stream: bool) -> int:
        jobs = [sample(p, j, stream) for p in prompts(args.prompts) for j in range(args.n)]
        return sum(await asyncio.gather(*jobs))

    return run


async def measure(configs: dict[str, Round], rounds: int, expected: int) -> dict[tuple[str, bool], float]:
    """Tokens per second of every configuration, streamed and not: one warm-up round each, then
    ``rounds`` rounds with the configurations interleaved; the median of each."""
    seen: dict[tuple[str, bool], list[float]] = {(name, s): [] for name in configs for s in (False, True)}
    for i in range(rounds + 1):
        for name, run in configs.items():
            for stream in (False, True):
                t0 = time.perf_counter()
                tokens = await run(stream)
                elapsed = time.perf_counter() - t0
                assert tokens == expected, (name, stream, tokens, expected)
                if i:
                    seen[(name, stream)].append(tokens / elapsed)
    return {key: statistics.median(values) for key, values in seen.items()}


def report(figures: dict[tuple[str, bool], float], ours: str, base: str) -> float:
    """Print both modes' figures; return the worse ratio of ``ours`` over ``base``."""
    ratios = []
    for stream in (False, True):
        mode = "streamed" if stream else "whole"
        a, b = figures[(ours, stream)], figures[(base, stream)]
        ratios.append(a / b)
        print(f"{mode:9} {ours}: {a:8.1f} tok/s   {base}: {b:8.1f} tok/s   ratio {a / b:.3f}")
    return min(ratios)


async def reference(args: argparse.Namespace, tmp: Path) -> tuple[float, float]:
    config = ModelConfig.tiny() if args.model_config == "tiny" else ModelConfig()
    engine = build_engine(config)
    old = save_checkpoint(dict(engine.model.weights()), tmp / "step-0")
    worker = WorkerProcess("--initial-version", '"v0"', model_config=args.model_config)
    router: RouterProcess | None = None
    try:
        worker.wait_ready()
        router = RouterProcess(
            [worker.url], "--journal", str(tmp / "fleet.db"), "--initial-source", str(old)
        ).wait_ready()
        limits = httpx.Limits(max_connections=args.prompts * 2)
        async with httpx.AsyncClient(timeout=600, limits=limits) as http:
            configs = {
                "engine": engine_round(engine, args),
                "worker": http_round(http, worker.url, None, args),
                "router": http_round(http, router.url, None, args),
            }
            figures = await measure(configs, args.rounds, args.prompts * args.n * args.max_tokens)
    finally:
        if router is not None:
            router.stop()
        worker.stop()
        await engine.close()
    print(
        f"reference engine ({args.model_config}): {args.prompts} prompts x n={args.n} x {args.max_tokens} tokens"
    )
    return report(figures, "worker", "engine"), report(figures, "router", "engine")


async def vllm_paths(args: argparse.Namespace, tmp: Path) -> float:
    from tests.vllm.servers import vllm_server, vllm_worker
    from tests.vllm.tiny_llama import make_tiny_llama

    model = make_tiny_llama(tmp / "llama", seed=1)
    memory = str(VLLM_MEMORY)
    procs = []
    try:  # both at once, each reserving a smaller share of host memory than the tests' engines
        procs.append(vllm_server(model, "--gpu-memory-utilization", memory, log=tmp / "vllm-server.log"))
        procs.append(
            vllm_worker(
                model, tmp, log=tmp / "weightsync-vllm.log", vllm_args=[f"gpu_memory_utilization={memory}"]
            )
        )
        async with httpx.AsyncClient(
            timeout=600, limits=httpx.Limits(max_connections=args.prompts * 4)
        ) as http:
            configs = {}
            for name, proc in zip(("vllm_server", "weightsync"), procs, strict=True):
                served = (await http.get(f"{proc.url}/v1/models")).json()["data"][0]["id"]
                configs[name] = http_round(http, proc.url, served, args)
            expected = args.prompts * args.n * args.max_tokens
            figures = await measure(configs, VLLM_ROUNDS * args.rounds, expected)
    finally:
        for proc in procs:
            proc.stop()
    print(f"vLLM (tiny Llama): {args.prompts} prompts x n={args.n} x {args.max_tokens} tokens")
    return report(figures, "weightsync", "vllm_server")


async def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-config", default="default", choices=["tiny", "default"])
    parser.add_argument("--prompts", type=int, default=4, help="requests at once, one per prompt")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--quick", action="store_true", help="a small run: tiny model, 2 prompts, 8 tokens, 1 round"
    )
    parser.add_argument("--no-vllm", action="store_true", help="leave vLLM out (its ratio is nan)")
    args = parser.parse_args()
    if args.quick:
        args.model_config, args.prompts, args.max_tokens, args.rounds = "tiny", 2, 8, 1
    if not args.no_vllm and importlib.util.find_spec("vllm") is None:
        raise SystemExit("vLLM is not installed (make venv-vllm), or pass --no-vllm")
    with tempfile.TemporaryDirectory(prefix="rollout-bench-") as name:
        tmp = Path(name)
        x, y = await reference(args, tmp)
        z = float("nan") if args.no_vllm else await vllm_paths(args, tmp)
    print("goal: x >= 0.9, y >= 0.85, z >= 0.9")
    print(
        f"RESULT ratio_worker_vs_engine={x:.3f} ratio_router_vs_engine={y:.3f} ratio_vllm_vs_vllm_server={z:.3f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
