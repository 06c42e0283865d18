"""The reference engine computes LoRA for real: several adapters served at once, chosen per
request, each equal to its merged-weights model (``W + scale · B A``), the scale applied once;
a request keeps the adapter version it started with to its end."""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import torch

from weightsync.core.errors import NotFound, NotSupported
from weightsync.core.snapshot import UNDECLARED, Declared
from weightsync.engines.reference import ModelConfig, ReferenceEngine
from weightsync.engines.reference.adapters import ReferenceAdapters
from weightsync.lora.config import AdapterConfig
from weightsync.lora.names import tensor_name
from weightsync.trainer import save_adapter

CONFIG = ModelConfig.tiny()


def sync(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """The async test ``test`` run in an event loop of its own."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(test(*args, **kwargs))

    return run


PROMPT = list(range(40, 80))  # 40 tokens: two and a half prefix-cache blocks
TARGETS = ("q_proj", "v_proj", "o_proj", "down_proj", "lm_head")


def adapter_tensors(seed: int, r: int = 4) -> dict[str, torch.Tensor]:
    modules = ReferenceEngine(CONFIG).model.linear_modules()
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for module, (fan_in, fan_out) in modules.items():
        if module.rsplit(".", 1)[-1] in TARGETS:
            out[tensor_name(module, "A")] = torch.randn(r, fan_in, generator=gen) / math.sqrt(fan_in)
            out[tensor_name(module, "B")] = torch.randn(fan_out, r, generator=gen) * 0.5
    return out


def write(
    tmp_path: Path, name: str, seed: int, **config: Any
) -> tuple[Path, dict[str, torch.Tensor], AdapterConfig]:
    spec = {"r": 4, "lora_alpha": 8, "target_modules": list(TARGETS), **config}
    tensors = adapter_tensors(seed, spec["r"])
    return (
        save_adapter(tensors, spec, tmp_path / name, version=f"{name}-1"),
        tensors,
        AdapterConfig.from_json(spec),
    )


def merged_engine(tensors: dict[str, torch.Tensor], scale: float) -> ReferenceEngine:
    """A fresh engine whose base weights are ``W + scale · B A`` for every adapted module."""
    engine = ReferenceEngine(CONFIG)
    weights = engine.model.weights()
    with torch.no_grad():
        for name, a in tensors.items():
            if ".lora_A." in name:
                module = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                b = tensors[name.replace(".lora_A.", ".lora_B.")]
                weights[f"{module}.weight"].add_(scale * (b @ a))
    return engine


async def serve(engine: ReferenceEngine, name: str, path: Path, version: Any = None) -> None:
    prepared = await engine.adapters.prepare_adapter(str(path))
    label = UNDECLARED if version is None else Declared(version)
    await engine.adapters.install_adapter(name, prepared, label, version is not None)


async def run(
    engine: ReferenceEngine, lora: str | None = None, prompt: list[int] = PROMPT, n: int = 12
) -> Any:
    return await engine.generate(prompt, max_tokens=n, logprobs=0, lora=lora)


def same(a: Any, b: Any) -> bool:
    close = all(abs(x.logprob - y.logprob) < 1e-4 for x, y in zip(a.logprobs, b.logprobs, strict=True))
    return a.token_ids == b.token_ids and close


@sync
async def test_an_adapter_computes_what_its_merged_weights_compute(tmp_path: Path) -> None:
    path, tensors, config = write(tmp_path, "a", seed=1)
    engine, merged, twice = (
        ReferenceEngine(CONFIG),
        merged_engine(tensors, config.scale),
        merged_engine(tensors, 2 * config.scale),
    )
    try:
        await serve(engine, "a", path, "a-1")
        base, lora, want, folded_twice = await asyncio.gather(
            run(engine), run(engine, "a"), run(merged), run(twice)
        )
        assert same(lora, want), (lora.token_ids, want.token_ids)
        assert not same(lora, base)  # the adapter changes what is generated
        assert not same(lora, folded_twice)  # and its scale is applied once, not twice
        assert lora.adapter is not None and lora.adapter.version == "a-1" and lora.adapter.version_declared
        assert all(span.adapter == lora.adapter for span in lora.spans)
        assert base.adapter is None and "adapter" not in base.spans[0].to_reply()
    finally:
        for e in (engine, merged, twice):
            await e.close()


@sync
async def test_rslora_scales_by_the_square_root_of_the_rank(tmp_path: Path) -> None:
    path, tensors, config = write(tmp_path, "rs", seed=2, r=4, lora_alpha=4, use_rslora=True)
    assert config.scale == 2.0
    engine, merged = ReferenceEngine(CONFIG), merged_engine(tensors, 2.0)
    try:
        await serve(engine, "rs", path)
        assert same(await run(engine, "rs"), await run(merged))
    finally:
        await engine.close()
        await merged.close()


@sync
async def test_adapters_in_one_batch_each_apply_to_their_own_rows_only(tmp_path: Path) -> None:
    path_a, _, _ = write(tmp_path, "a", seed=1)
    path_b, _, _ = write(tmp_path, "b", seed=2)
    engine = ReferenceEngine(CONFIG)
    try:
        await serve(engine, "a", path_a)
        await serve(engine, "b", path_b)
        alone = [await run(engine, lora) for lora in (None, "a", "b", "a")]
        together = await asyncio.gather(*(run(engine, lora) for lora in (None, "a", "b", "a")))
        assert all(same(x, y) for x, y in zip(alone, together, strict=True))
        assert len({tuple(x.token_ids) for x in alone}) == 3
        assert [c.adapter.name if c.adapter else None for c in together] == [None, "a", "b", "a"]
    finally:
        await engine.close()


@sync
async def test_a_request_keeps_the_adapter_version_it_started_with(tmp_path: Path) -> None:
    old, _, _ = write(tmp_path, "v1", seed=1)
    new, _, _ = write(tmp_path, "v2", seed=3)
    engine = ReferenceEngine(CONFIG)
    try:
        await serve(engine, "policy", old, 1)
        expected = await run(engine, "policy", n=40)
        stream = engine.stream(PROMPT, max_tokens=40, logprobs=0, lora="policy")
        first = await anext(stream)  # running, holding version 1
        await serve(engine, "policy", new, 2)  # replaced under it
        assert [(a["version"], a["state"], a["requests"]) for a in engine.adapters.listing()] == [
            (2, "resident", 0),
            (1, "draining", 1),
        ]
        items = [first, *[item async for item in stream]]
        done = items[-1]
        assert done.token_ids == expected.token_ids and done.adapter.version == 1
        assert all(chunk.adapter.version == 1 for chunk in items[:-1])
        assert [a["version"] for a in engine.adapters.listing()] == [2]  # version 1 went with it
        assert (await run(engine, "policy")).adapter.version == 2
    finally:
        await engine.close()


@sync
async def test_an_unloaded_adapter_finishes_its_requests_and_serves_no_new_one(tmp_path: Path) -> None:
    path, _, _ = write(tmp_path, "a", seed=1)
    engine = ReferenceEngine(CONFIG)
    try:
        await serve(engine, "a", path, 1)
        running = asyncio.ensure_future(run(engine, "a", n=40))
        await asyncio.sleep(0.05)
        await engine.adapters.evict_adapter("a")
        with pytest.raises(NotFound) as err:
            await run(engine, "a")
        assert err.value.code == "adapter_not_found"
        done = await running
        assert done.finish_reason == "length" and done.adapter.name == "a"
        assert engine.adapters.listing() == []
        with pytest.raises(NotFound):
            await engine.adapters.evict_adapter("a")
    finally:
        await engine.close()


@sync
async def test_a_prefix_computed_without_the_adapter_is_never_reused_with_it(tmp_path: Path) -> None:
    path, tensors, config = write(tmp_path, "a", seed=1)
    engine, merged = ReferenceEngine(CONFIG), merged_engine(tensors, config.scale)
    try:
        await serve(engine, "a", path)
        await run(engine)
        assert (await run(engine)).cached_tokens > 0  # the base reuses its own prefix
        lora = await run(engine, "a")
        assert lora.cached_tokens == 0 and same(lora, await run(merged))
        assert (await run(engine, "a")).cached_tokens > 0  # and the adapter its own
    finally:
        await engine.close()
        await merged.close()


@sync
async def test_an_engine_without_adapters_refuses_one() -> None:
    adapters = ReferenceAdapters(None, torch.float32, None)
    with pytest.raises(NotSupported):
        await adapters.prepare_adapter("/nowhere")
    engine = ReferenceEngine(CONFIG)
    try:
        with pytest.raises(NotFound):
            await run(engine, "never-loaded")
    finally:
        await engine.close()
