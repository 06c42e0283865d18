"""Generation on the vLLM engine: every sampling field handed to vLLM's own sampler
(``SamplingParams``), vLLM's logprobs read back, and the tokens stamped with weight epochs.

The ``n`` samples of a prompt are one vLLM request (``SamplingParams(n=…)``), as vLLM's own
OpenAI server runs them: vLLM fans it out into ``n`` child requests that share the prompt's
KV blocks, seeds the ``j``-th with ``seed + j``, and reports each child's outputs under its
``CompletionOutput.index``; aborting the request aborts every child.  vLLM refuses ``n > 1``
greedy (its samples would all be the one greedy sequence): those samples are one request of
one sequence, which every sample reads (``Sample.shared``).  Outputs are read as deltas
(``RequestOutputKind.DELTA``): each one carries only the tokens, logprobs and text new since
the last.

With vLLM's tokenizer (the engine started without ``skip_tokenizer_init``) the text is vLLM's
own detokenizer's, stop strings included; without it the engine has no text of its own, and
``stop`` (strings) is ``not_supported`` rather than ignored (use ``stop_token_ids``).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import attrs

from weightsync.core.errors import EngineUnavailable, InvalidRequest, NotSupported
from weightsync.engines.sampling import Sampling, TokenLogprob
from weightsync.engines.stamps import Chunk, Completion, VersionStamps


def sequences(s: Sampling, n: int) -> int:
    """How many sequences vLLM runs for ``n`` samples: one when they are greedy."""
    return 1 if s.greedy else n


def client_errors() -> tuple[type[Exception], ...]:
    """What vLLM raises for a request it refuses (``ValueError`` before ``VLLMClientError``)."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:
        return (ValueError,)
    return (ValueError, VLLMClientError)


def busy_errors() -> tuple[type[Exception], ...]:
    """What vLLM raises when its admission limits (``max_num_queued_reqs``, queued prefill
    tokens) turn a request away: a 503 on vLLM's own server, so one here too."""
    try:
        from vllm.exceptions import GracefulHTTPError
    except ImportError:
        return ()
    return (GracefulHTTPError,)


def sampling_params(s: Sampling, n: int = 1, *, detokenize: bool = False) -> Any:
    """``s`` as vLLM's ``SamplingParams`` for ``n`` samples, with vLLM's text when
    ``detokenize``.  Raises ``NotSupported`` for stop strings without it, ``InvalidRequest``
    for what vLLM refuses."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    if s.stop and not detokenize:
        raise NotSupported(
            "stop strings need vLLM's detokenizer, and this worker's vLLM runs without its tokenizer "
            "(skip_tokenizer_init); use stop_token_ids",
            code="not_supported",
            field="stop",
        )
    try:
        return SamplingParams(
            n=sequences(s, n),
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k or -1,
            min_p=s.min_p,
            repetition_penalty=s.repetition_penalty,
            seed=s.seed,
            stop=list(s.stop) or None,
            stop_token_ids=list(s.stop_token_ids),
            ignore_eos=s.ignore_eos,
            logprobs=s.logprobs,
            prompt_logprobs=s.prompt_logprobs,
            detokenize=detokenize,
            output_kind=RequestOutputKind.DELTA,
        )
    except client_errors() as exc:
        raise InvalidRequest(str(exc), code="invalid_value") from None


@attrs.define(eq=False)
class Sample:
    """One sample of a vLLM request as the engine tracks it: ``request_id`` is weightsync's
    name of it, ``index`` its ``CompletionOutput.index`` in vLLM request ``vllm_id`` of ``n``."""

    request_id: str
    vllm_id: str
    index: int
    n: int
    prompt_tokens: int
    submitted_epoch: int
    tokens: list[int] = attrs.field(factory=list)
    epochs: list[int] = attrs.field(factory=list)
    logprobs: list[TokenLogprob] = attrs.field(factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    text: str | None = None  # vLLM's text so far, when it detokenizes
    text_sent: int = 0  # how much of it the chunks carried
    first: int | None = None  # the epoch of the first token
    shared: bool = False  # it reads the request's one sequence (greedy samples)
    aborted: bool = False  # a shared sample asked to end: it does at the request's next output
    done: bool = False


def _entry(token: int, ranked: Mapping[int, Any], top: int) -> TokenLogprob:
    """vLLM's logprobs of one position (token id -> ``Logprob(logprob, rank, decoded_token)``)."""
    best = sorted(
        ((lp.rank, t, lp.logprob) for t, lp in ranked.items() if lp.rank is not None and lp.rank <= top)
    )
    mine = ranked[token]
    decoded = tuple((t, lp.decoded_token) for t, lp in ranked.items() if lp.decoded_token is not None)
    return TokenLogprob(
        token, float(mine.logprob), tuple((t, float(v)) for _, t, v in best), mine.rank, decoded
    )


def _completion(
    stamps: VersionStamps, sample: Sample, s: Sampling, finish: str, stop_reason: Any
) -> Completion:
    sample.done = True
    return stamps.completion(
        sample.request_id,
        sample.prompt_tokens,
        sample.tokens,
        sample.epochs,
        finish,
        sample.submitted_epoch,
        logprobs=None if s.logprobs is None else list(sample.logprobs),
        prompt_logprobs=sample.prompt_logprobs,
        stop_reason=stop_reason,
        detokenized=sample.text,
    )


def _read(stamps: VersionStamps, sample: Sample, s: Sampling, o: Any, out: Any) -> list[Chunk | Completion]:
    """What one of vLLM's outputs (``o``, in request output ``out``) adds to ``sample``: a
    chunk when it brought tokens, the completion when it finished the sample."""
    items: list[Chunk | Completion] = []
    if s.prompt_logprobs is not None and out.prompt_logprobs:  # in pieces, as the prompt is read
        done = sample.prompt_logprobs = sample.prompt_logprobs or []
        for i, ranked in enumerate(out.prompt_logprobs, len(done)):
            done.append(
                None if ranked is None else _entry(out.prompt_token_ids[i], ranked, s.prompt_logprobs)
            )
    if o.text and sample.text is not None:
        sample.text += o.text
    new = list(o.token_ids)
    if new:
        sample.first = stamps.epoch if sample.first is None else sample.first
        lps = (
            None if s.logprobs is None else [_entry(t, o.logprobs[i], s.logprobs) for i, t in enumerate(new)]
        )
        sample.tokens.extend(new)
        sample.epochs.extend([stamps.epoch] * len(new))
        sample.logprobs.extend(lps or [])
        text = None
        if sample.text is not None:
            text, sample.text_sent = sample.text[sample.text_sent :], len(sample.text)
        items.append(stamps.chunk(sample.first, new, lps, text))
    if o.finish_reason is not None and not sample.done:
        items.append(_completion(stamps, sample, s, o.finish_reason, o.stop_reason))
    return items


async def run(
    generate: Callable[..., AsyncIterator[Any]],
    stamps: VersionStamps,
    prompt: list[int],
    s: Sampling,
    samples: list[Sample],
    salt: str,
    detokenize: bool,
) -> AsyncIterator[tuple[int, Chunk | Completion]]:
    """Run ``samples`` (every sample of one prompt) as one request through vLLM's ``generate``
    (an ``AsyncLLM.generate``), yielding ``(sample index, item)``: a chunk per step that gave a
    sample tokens, and each sample's completion as it finishes (``"abort"`` for a sample the
    request ended without finishing).  ``samples`` record their tokens and epochs as they come
    (the engine's view of the request)."""
    params = sampling_params(s, len(samples), detokenize=detokenize)
    inputs = {"prompt_token_ids": list(prompt), "cache_salt": salt}
    for sample in samples:
        sample.text = "" if detokenize else None
    try:
        async for out in generate(inputs, params, request_id=samples[0].vllm_id):
            for o in out.outputs:
                for sample in [x for x in samples if not x.done] if samples[0].shared else [samples[o.index]]:
                    if sample.aborted:
                        yield sample.index, _completion(stamps, sample, s, "abort", None)
                        continue
                    for item in _read(stamps, sample, s, o, out):
                        yield sample.index, item
    except client_errors() as exc:
        for sample in samples:
            sample.done = True
        raise InvalidRequest(str(exc), code="invalid_value") from None
    except busy_errors() as exc:  # vLLM's admission limits: retry later or elsewhere
        for sample in samples:
            sample.done = True
        raise EngineUnavailable(str(exc), code="engine_busy") from None
    for sample in samples:
        if not sample.done:
            yield sample.index, _completion(stamps, sample, s, "abort", None)


class InFlight:
    """The samples running on one ``AsyncLLM`` (``llm``), by weightsync's request id;
    ``salt(epoch, user)``: the prefix-cache salt of a request that starts under weight ``epoch``
    with the caller's own ``cache_salt`` ``user`` (or none)."""

    def __init__(self, llm: Any, stamps: VersionStamps, salt: Callable[[int, str | None], str]) -> None:
        self.llm, self.stamps, self._salt = llm, stamps, salt
        self._samples: dict[str, Sample] = {}

    def ids(self) -> list[str]:
        return list(self._samples)

    async def run(
        self,
        generate: Callable[..., AsyncIterator[Any]],
        prompt: list[int],
        s: Sampling,
        rids: list[str],
        detokenize: bool,
    ) -> AsyncIterator[tuple[int, Chunk | Completion]]:
        """:func:`run` as one vLLM request of one sample per id in ``rids``, each in flight
        until its completion; closing it before the end aborts the request.  Raises
        ``InvalidRequest`` (``invalid_value``) at the first step when one of ``rids`` is in
        flight already (two requests admitted under one id before either ran).

        The vLLM request's id is a fresh random one, never a client's: vLLM lets external
        ids repeat and aborts every request under one, so a client that named its request
        after another's could otherwise abort it."""
        clash = next((r for r in rids if r in self._samples), None)
        if clash is not None:  # checked and registered with no await between: one step
            raise InvalidRequest(
                f"request id {clash!r} is in flight", code="invalid_value", field="request_id"
            )
        vllm_id = f"ws~{uuid.uuid4().hex}"
        epoch = self.stamps.epoch
        shared = sequences(s, len(rids)) < len(rids)
        samples = [
            Sample(rid, vllm_id, j, len(rids), len(prompt), epoch, shared=shared)
            for j, rid in enumerate(rids)
        ]
        for sample in samples:
            self._samples[sample.request_id] = sample
        try:
            # KV cached under other weights is never reused: the salt names the weights' epoch.
            async for j, item in run(
                generate, self.stamps, prompt, s, samples, self._salt(epoch, s.cache_salt), detokenize
            ):
                if isinstance(item, Completion) and self._samples.get(samples[j].request_id) is samples[j]:
                    del self._samples[samples[j].request_id]
                yield j, item
        finally:
            for sample in samples:
                if self._samples.get(sample.request_id) is sample:
                    del self._samples[sample.request_id]
            if not all(sample.done for sample in samples):  # the reader left: vLLM frees every sample
                await self.llm.abort(vllm_id)

    async def abort(self, request_id: str) -> bool:
        """Abort sample ``request_id``; ``False`` when it is not in flight.  A sample of a
        request of several is its child request in vLLM (``<index>_<internal id>``, found in
        vLLM's output processor), the others running on; a vLLM that keeps no such record has
        the whole request aborted instead.  A shared (greedy) sample stops reading the request,
        which is aborted once no sample reads it."""
        sample = self._samples.get(request_id)
        if sample is None:
            return False
        if sample.shared:
            sample.aborted = True
            group = [x for x in self._samples.values() if x.vllm_id == sample.vllm_id]
            if all(x.aborted or x.done for x in group):
                await self.llm.abort(sample.vllm_id)
            return True
        processor = getattr(self.llm, "output_processor", None)
        if sample.n == 1 or processor is None:
            await self.llm.abort(sample.vllm_id)
            return True
        for internal in list(processor.external_req_ids.get(sample.vllm_id, ())):
            state = processor.request_states.get(internal)
            if state is not None and state.request_index == sample.index:
                await self.llm.abort(internal, internal=True)
                break
        return True  # no child left under that index: vLLM finished it already
