"""The reference engine's model and cache give the same answers whichever path computes them."""

from __future__ import annotations

import torch

from tests.helpers import TINY, run
from weightsync.engines.reference import CausalLM, ReferenceEngine


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
    import asyncio

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
