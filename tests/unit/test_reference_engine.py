"""The reference engine's model and cache give the same answers whichever path computes them."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from tests.helpers import TINY, hashes, perturbed, run
from weightsync.core import Controller, Declared, DiskSource, UpdateRequest, WeightsTorn, WeightSyncError
from weightsync.engines.reference import CausalLM, ModelConfig, ReferenceEngine
from weightsync.engines.stamps import Completion
from weightsync.trainer import save_checkpoint
from weightsync.transports.disk import checks as disk_checks
from weightsync.transports.disk import copy_loop
from weightsync.transports.sink import TensorSink


def test_prefill_incremental_and_full_forward_agree() -> None:
    model = CausalLM(TINY)
    tokens = torch.tensor([list(b"weights move honestly")])
    at_once = model.forward_slots(tokens, torch.tensor([0]), torch.tensor([0]))
    step = model.forward_slots(tokens[:, :5], torch.tensor([1]), torch.tensor([0]))
    for i in range(5, tokens.shape[1]):
        step = model.forward_slots(tokens[:, i : i + 1], torch.tensor([1]), torch.tensor([i]))
    full = model.forward_full(tokens)[:, -1]
    assert torch.allclose(at_once, step, atol=1e-5) and torch.allclose(at_once, full, atol=1e-5)


def test_prefix_cache_hits_do_not_change_outputs() -> None:
    async def main() -> tuple[list[int], list[int], int]:
        engine = ReferenceEngine(TINY)
        prompt = list(range(1, 50))
        cold = await engine.generate(prompt, max_tokens=12)
        warm = await engine.generate(prompt, max_tokens=12)
        await engine.close()
        return cold.token_ids, warm.token_ids, warm.cached_tokens

    cold, warm, cached = run(main())
    assert cached == 48 and warm == cold


def test_batched_decoding_matches_one_request_at_a_time() -> None:
    prompts = [list(b"alpha"), list(b"beta beta"), list(b"gamma gamma gamma")]

    async def alone() -> list[list[int]]:
        engine = ReferenceEngine(TINY)
        outs = [(await engine.generate(p, max_tokens=10)).token_ids for p in prompts]
        await engine.close()
        return outs

    async def together() -> list[list[int]]:
        engine = ReferenceEngine(TINY)
        outs = await asyncio.gather(*(engine.generate(p, max_tokens=10) for p in prompts))
        await engine.close()
        return [o.token_ids for o in outs]

    assert run(alone()) == run(together())


def after_each_tensor(monkeypatch: pytest.MonkeyPatch, hook: Callable[[TensorSink], None]) -> None:
    """Call ``hook(sink)`` after every tensor a channel puts into any sink, whichever way
    (copied by ``write`` or received straight into the target)."""
    write, written_directly = TensorSink.write, TensorSink.written_directly

    def write_then(self: TensorSink, name: str, tensor: torch.Tensor) -> None:
        write(self, name, tensor)
        hook(self)

    def written_directly_then(self: TensorSink, *args: Any, **kwargs: Any) -> None:
        written_directly(self, *args, **kwargs)
        hook(self)

    monkeypatch.setattr(TensorSink, "write", write_then)
    monkeypatch.setattr(TensorSink, "written_directly", written_directly_then)


LONG = ModelConfig.tiny(max_position=512)  # room for a completion that outlives an update


def staged_update(path: Path, version: str) -> UpdateRequest:
    return UpdateRequest(
        DiskSource(str(path)), Declared(version), allow_unpaused=True, reset_prefix_cache=False
    )


async def started(
    engine: ReferenceEngine, prompt: list[int], max_tokens: int, request_id: str = "rollout"
) -> asyncio.Task[Completion]:
    """A completion that is running (admitted, generating) when this returns."""
    task = asyncio.create_task(engine.generate(prompt, max_tokens=max_tokens, request_id=request_id))
    while not engine.in_flight():
        await asyncio.sleep(0.001)
    await asyncio.sleep(0.02)
    return task


def test_unpaused_update_without_cache_reset_never_reuses_kv_of_the_old_weights(tmp_path: Path) -> None:
    new_config = attrs.evolve(LONG, seed=1)
    ckpt = save_checkpoint(CausalLM(new_config).weights(), tmp_path / "ckpt")
    prompt = list(range(1, 50))  # three cacheable blocks

    async def fresh() -> list[int]:
        engine = ReferenceEngine(new_config)
        out = await engine.generate(prompt, max_tokens=12)
        await engine.close()
        return out.token_ids

    async def main() -> None:
        engine = ReferenceEngine(LONG)
        c = Controller(engine, version=Declared("v0"))
        old = await engine.generate(prompt, max_tokens=12)
        holder = await started(engine, [*prompt, 7], max_tokens=400, request_id="holder")  # holds old blocks
        await c.update(staged_update(ckpt, "v1"))
        after = await engine.generate(prompt, max_tokens=12)
        assert after.cached_tokens == 0, "a block computed by the old weights was reused"
        assert after.token_ids == await fresh() != old.token_ids
        assert after.weight_version == "v1" and [s.version for s in after.spans] == ["v1"]
        stats = (await engine.rpc("prefix_cache_stats", (), {}))["blocks"]
        assert stats == 6  # the new epoch's three, and the old three the running request holds
        assert await engine.abort_request("holder")
        assert (await holder).finish_reason == "abort"
        assert (await engine.rpc("prefix_cache_stats", (), {}))["blocks"] == 3  # old ones dropped
        again = await engine.generate(prompt, max_tokens=12)
        assert again.cached_tokens == 48 and again.token_ids == after.token_ids
        assert again.weight_version == "v1"
        await engine.close()

    run(main())


def test_failed_unpaused_update_keeps_served_weights_and_running_completions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = save_checkpoint(perturbed(CausalLM(LONG).weights(), seed=3), tmp_path / "ckpt", shard_bytes=60_000)
    last = sorted(ckpt.glob("*.safetensors"))[-1]
    running_during_load: list[list[str]] = []

    def shrink_last_shard_after_first_tensor(sink: TensorSink) -> None:
        if sink.tensors == 1:  # the staging copy has been written to: shrink a shard not yet read
            running_during_load.append(engine.in_flight())
            with last.open("r+b") as f:
                f.truncate(last.stat().st_size // 2)

    after_each_tensor(monkeypatch, shrink_last_shard_after_first_tensor)
    # One reader, in the loop's own thread: with several, read-ahead may take the last shard
    # before the first tensor is written, and the load would then succeed by chance.
    monkeypatch.setattr(disk_checks, "copy_into", functools.partial(copy_loop.copy_into, readers=1))
    engine: ReferenceEngine

    async def main() -> None:
        nonlocal engine
        engine = ReferenceEngine(LONG)
        c = Controller(engine, version=Declared("v0"))
        before = hashes(engine)
        rollout = await started(engine, list(b"rollout"), max_tokens=400)
        with pytest.raises(WeightSyncError) as err:
            await c.update(staged_update(ckpt, "v1"))
        assert not isinstance(err.value, WeightsTorn), err.value
        assert running_during_load == [engine.in_flight()] and not rollout.done()
        snap = c.snapshot()
        assert not snap.torn and not snap.paused and snap.version == Declared("v0")
        assert hashes(engine) == before, "the served weights changed"
        out = await rollout
        assert out.finish_reason == "length" and len(out.token_ids) == 400
        assert [s.version for s in out.spans] == ["v0"]
        await engine.close()

    run(main())
