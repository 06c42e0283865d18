"""The reference engine's sampler: one token from one row of logits, in vLLM's order.

Repetition penalty (over the prompt and the output so far), then greedy, or temperature,
min-p, top-k, top-p and a draw from the request's own seeded generator.  The reported
log-probabilities are those of the raw row (see :mod:`weightsync.engines.sampling`), so they
come from the very forward pass that chose the token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from weightsync.engines.sampling import Sampling, TokenLogprob


def sample(
    logits: torch.Tensor, s: Sampling, history: Sequence[int], generator: torch.Generator | None
) -> tuple[int, TokenLogprob | None]:
    """The token drawn from ``logits`` ([V], float32) under ``s`` (``history``: the prompt and
    the tokens generated so far), and its log-probability when ``s.logprobs`` asks for it."""
    x = logits.double()
    if s.repetition_penalty != 1.0 and history:
        ids = torch.tensor(sorted(set(history)), dtype=torch.long)
        seen = x[ids]
        x[ids] = torch.where(seen > 0, seen / s.repetition_penalty, seen * s.repetition_penalty)
        x = x.clamp(-1e300, 1e300)  # a penalty near 0 or huge overflows to inf: still a distribution
    if s.greedy:
        token = int(x.argmax())
    else:
        token = int(torch.multinomial(filtered_probs(x, s), 1, generator=generator))
    return token, (None if s.logprobs is None else logprob_of(logits, token, s.logprobs))


def filtered_probs(x: torch.Tensor, s: Sampling) -> torch.Tensor:
    """The distribution a non-greedy token is drawn from: ``softmax(x / temperature)`` with
    min-p, top-k and top-p applied (what they cut is zero; the rest is renormalised)."""
    probs = torch.softmax((x - x.max()) / s.temperature, dim=-1)
    if s.min_p > 0:
        probs = torch.where(probs < s.min_p * probs.max(), 0.0, probs)
    if s.top_k > 0 and s.top_k < probs.numel():
        kth = torch.topk(probs, s.top_k).values[-1]
        probs = torch.where(probs < kth, 0.0, probs)
    if s.top_p < 1.0:
        ordered, order = torch.sort(probs, descending=True)
        before = torch.cumsum(ordered, 0) - ordered  # the mass of the more likely tokens
        cut = before >= s.top_p * ordered.sum()
        cut[0] = False  # the most likely token always stays
        probs = probs.clone()
        probs[order[cut]] = 0.0
    return probs / probs.sum()


def logprob_of(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """``token``'s raw log-probability under ``logits`` ([V]), with the ``top`` most likely."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    alternatives: tuple[tuple[int, float], ...] = ()
    if top:
        values, ids = torch.topk(lp, min(top, lp.numel()))
        alternatives = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    rank = 1 + int((lp > lp[token]).sum())
    return TokenLogprob(token, float(lp[token]), alternatives, rank)


def prompt_logprobs(logits: torch.Tensor, prompt: Sequence[int], top: int) -> list[TokenLogprob | None]:
    """Every prompt token's log-probability given the tokens before it (``logits`` [T, V] of
    a full forward of ``prompt``); the first has none."""
    return [None] + [logprob_of(logits[i - 1], t, top) for i, t in enumerate(prompt) if i]
