"""Generation on the vLLM engine: every sampling field handed to vLLM's own sampler
(``SamplingParams``), vLLM's logprobs read back, and the tokens stamped with weight epochs.

The one field refused is ``stop`` (strings): the worker's text path is byte-level and the
engine runs without vLLM's detokenizer, so a stop string could not be matched as vLLM
matches it; it is ``not_supported`` rather than ignored.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from weightsync.core.errors import InvalidRequest, NotSupported
from weightsync.engines.sampling import Sampling, TokenLogprob
from weightsync.engines.stamps import Chunk, Completion, VersionStamps


def sampling_params(s: Sampling) -> Any:
    """``s`` as vLLM's ``SamplingParams``.  Raises ``NotSupported`` for stop strings."""
    from vllm import SamplingParams

    if s.stop:
        raise NotSupported(
            "stop strings need vLLM's detokenizer, which this worker runs without; use stop_token_ids",
            code="not_supported",
            field="stop",
        )
    return SamplingParams(
        max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k or -1, min_p=s.min_p,
        repetition_penalty=s.repetition_penalty, seed=s.seed, stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos, logprobs=s.logprobs, prompt_logprobs=s.prompt_logprobs, detokenize=False,
    )  # fmt: skip


def _entry(token: int, ranked: Mapping[int, Any], top: int) -> TokenLogprob:
    """vLLM's logprobs of one position (token id -> ``Logprob(logprob, rank, ...)``)."""
    best = sorted(
        ((lp.rank, t, lp.logprob) for t, lp in ranked.items() if lp.rank is not None and lp.rank <= top)
    )
    mine = ranked[token]
    return TokenLogprob(token, float(mine.logprob), tuple((t, float(v)) for _, t, v in best), mine.rank)


def _logprobs(tokens: list[int], positions: Any, top: int) -> list[TokenLogprob]:
    return [_entry(t, positions[i], top) for i, t in enumerate(tokens)]


async def stream(
    generate: Callable[..., AsyncIterator[Any]],
    stamps: VersionStamps,
    prompt: list[int],
    s: Sampling,
    rid: str,
    salt: str,
    tracked: Any,
) -> AsyncIterator[Chunk | Completion]:
    """Run one request through vLLM's ``generate`` (an ``AsyncLLM.generate``), yielding a
    chunk per step that produced tokens, then the completion; ``tracked`` records the tokens
    and their epochs as they come (the engine's view of the request)."""
    params = sampling_params(s)
    inputs = {"prompt_token_ids": list(prompt), "cache_salt": salt}
    finish, stop_reason, prompt_lps, first = "abort", None, None, None
    try:
        async for out in generate(inputs, params, request_id=rid):
            o = out.outputs[0]
            tokens = list(o.token_ids)
            new = tokens[len(tracked.tokens) :]
            if new:
                first = stamps.epoch if first is None else first
                lps = (
                    None
                    if s.logprobs is None
                    else _logprobs(new, o.logprobs[len(tracked.tokens) :], s.logprobs)
                )
                tracked.tokens = tokens
                tracked.epochs.extend([stamps.epoch] * len(new))
                tracked.logprobs.extend(lps or [])
                yield stamps.chunk(first, new, lps)
            if s.prompt_logprobs is not None and out.prompt_logprobs is not None and prompt_lps is None:
                prompt_lps = [None] + [
                    _entry(t, out.prompt_logprobs[i], s.prompt_logprobs) for i, t in enumerate(prompt) if i
                ]
            if out.finished:
                finish, stop_reason, tracked.done = o.finish_reason or "stop", o.stop_reason, True
    except ValueError as exc:
        tracked.done = True
        raise InvalidRequest(str(exc), code="invalid_value") from None
    yield stamps.completion(
        rid, tracked.prompt_tokens, tracked.tokens, tracked.epochs, finish, tracked.submitted_epoch,
        logprobs=None if s.logprobs is None else list(tracked.logprobs), prompt_logprobs=prompt_lps,
        stop_reason=stop_reason,
    )  # fmt: skip
