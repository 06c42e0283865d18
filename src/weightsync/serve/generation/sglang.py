"""SGLang's native ``POST /generate`` (slime's and Miles' rollout route), in SGLang's shapes.

Request: ``text`` or ``input_ids`` (one prompt or a batch), ``sampling_params``
(``max_new_tokens``, ``temperature`` — 1 by default, as in SGLang — ``top_p``, ``top_k``,
``min_p``, ``repetition_penalty``, ``stop``, ``stop_token_ids``, ``ignore_eos``, ``n``,
``sampling_seed``), ``return_logprob``, ``top_logprobs_num``, ``logprob_start_len``, ``rid``,
``stream``.  Reply: ``{"text", "output_ids", "meta_info"}`` per sequence (a list for a batch
or ``n`` > 1), ``meta_info`` with ``id``, ``finish_reason`` (``{"type": "length", "length"}``,
``{"type": "stop", "matched"}`` or ``{"type": "abort"}``), token counts, ``cached_tokens``,
``weight_version`` (``"default"`` while undeclared, as SGLang; on a finished sequence the
version of its last span, as SGLang 0.5.23), ``weight_versions`` (0.5.23's spans,
``{version, start, end}`` half-open in the output tokens) and, with ``return_logprob``,
``output_token_logprobs`` (``[logprob, token_id, null]`` per token), ``output_top_logprobs``
and ``input_token_logprobs``; weightsync adds its stamps (``weight_version_declared``,
``weight_version_current``, ``weight_version_spans``).  A stream sends the whole object so
far on every event (SGLang's cumulative streaming) and ends with ``data: [DONE]``.

Known SGLang fields this worker does not implement are accepted at their neutral value and
are ``501 not_supported`` otherwise, as on the OpenAI routes.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Final

from weightsync.core.errors import InvalidRequest, NotSupported
from weightsync.core.validation import Body, array, boolean, integer, obj, string
from weightsync.edge.dialects import DEFAULT_VERSION
from weightsync.serve.generation import runs
from weightsync.serve.generation.fields import (
    MAX_PROMPTS,
    SEED_RANGE,
    Ask,
    number,
    prompts_field,
    refuse_unless_neutral,
    stops_field,
)
from weightsync.serve.generation.text import finite

NEUTRAL: Final = {
    "image_data": (None, []), "audio_data": (None, []), "video_data": (None, []), "lora_path": (None,),
    "custom_logit_processor": (None,), "return_hidden_states": (False,), "session_params": (None,),
    "return_text_in_logprobs": (False,), "input_embeds": (None,), "bootstrap_host": (None,),
    "data_parallel_rank": (None,), "log_metrics": (True, False), "modalities": (None, []),
    "token_ids_logprob": (None,),
    # what Miles' rollouts always send (generate_endpoint_utils.compute_request_payload): no MoE here
    "return_routed_experts": (False,), "return_indexer_topk": (False,),
}  # fmt: skip
SAMPLING_NEUTRAL: Final = {
    "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "min_new_tokens": (0,), "no_stop_trim": (False,),
    "regex": (None,), "json_schema": (None,), "ebnf": (None,), "structural_tag": (None,), "custom_params": (None,),
    "logit_bias": (None, {}), "skip_special_tokens": (True, False), "spaces_between_special_tokens": (True, False),
    "stream_interval": (None, 1),
}  # fmt: skip
FIELDS: Final = (
    "text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len", "top_logprobs_num",
    "stream", *NEUTRAL,
)  # fmt: skip
SAMPLING: Final[dict[str, tuple[str, Callable[[str, Any], Any]]]] = {
    "max_new_tokens": ("max_tokens", lambda f, v: integer(f, v)),
    "temperature": ("temperature", number),
    "top_p": ("top_p", number),
    "top_k": ("top_k", lambda f, v: integer(f, v)),
    "min_p": ("min_p", number),
    "repetition_penalty": ("repetition_penalty", number),
    "stop": ("stop", stops_field),
    "stop_token_ids": ("stop_token_ids", lambda f, v: tuple(array(f, v, lambda g, w: integer(g, w, lo=0)))),
    "ignore_eos": ("ignore_eos", boolean),
    "sampling_seed": ("seed", lambda f, v: integer(f, v, *SEED_RANGE)),
}


def parse_generate(body: Any) -> tuple[Ask, bool, int | None]:
    """``/generate``'s body: the request, whether it is a batch, and ``logprob_start_len``
    when input logprobs are asked for.  Raises ``InvalidRequest`` or ``NotSupported``."""
    b = Body(body, FIELDS)
    refuse_unless_neutral(body, NEUTRAL)
    if b.has("text") == b.has("input_ids"):
        raise InvalidRequest(
            "give exactly one of text and input_ids", code="invalid_value", field="input_ids"
        )
    field = "text" if b.has("text") else "input_ids"
    raw = body[field]
    batch = type(raw) is list and bool(raw) and type(raw[0]) is not int
    prompts = b.get(field, prompts_field)
    params = b.get("sampling_params", lambda f, v: {} if v is None else v, {})
    if type(params) is list:
        if len(params) != 1:
            raise NotSupported("one sampling_params per batch is supported", field="sampling_params")
        params = params[0]
    p = Body(obj("sampling_params", params), (*SAMPLING, "n", *SAMPLING_NEUTRAL))
    refuse_unless_neutral(params, SAMPLING_NEUTRAL)
    sampling: dict[str, Any] = {"temperature": 1.0}  # SGLang's default
    for name, (ours, check) in SAMPLING.items():
        if p.has(name) and params[name] is not None:
            sampling[ours] = p.get(name, check)
    n = p.get("n", lambda f, v: integer(f, v, 1, 128), 1)
    if len(prompts) * n > MAX_PROMPTS:
        raise InvalidRequest(f"n × prompts exceeds {MAX_PROMPTS} sequences", code="invalid_value", field="n")
    start = None
    if b.get("return_logprob", boolean, False):
        sampling["logprobs"] = b.get("top_logprobs_num", lambda f, v: integer(f, v, 0), 0)
        start = b.get("logprob_start_len", lambda f, v: integer(f, v, -1), -1)
        if start >= 0:
            sampling["prompt_logprobs"] = sampling["logprobs"]
        else:
            start = None
    stream = b.get("stream", boolean, False)
    rid = b.get("rid", lambda f, v: v if v is None else string(f, v), None)
    return Ask(prompts, sampling, n, stream, request_id=rid), batch or n > 1, start


def _entry(lp: Any) -> list[Any]:
    return [finite(lp.logprob), lp.token, None]


def _finish(out: Any) -> dict[str, Any]:
    if out.finish_reason == "length":
        return {"type": "length", "length": len(out.token_ids)}
    if out.finish_reason == "stop":
        return {"type": "stop", "matched": out.stop_reason}
    return {"type": "abort", "message": "the request was aborted"}


def _span(span: Any) -> dict[str, Any]:
    """SGLang 0.5.23's ``meta_info.weight_versions`` entry: ``{version, start, end}``, half-open
    in the output tokens (``"default"`` for weights never declared, SGLang's word)."""
    version = span.version if span.version_declared else DEFAULT_VERSION
    return {"version": version, "start": span.first_token, "end": span.last_token + 1}


class Reply:
    """One sequence's ``/generate`` object, growing as its chunks come."""

    def __init__(self, index: int, prompt: list[int], ask: Ask, start: int | None) -> None:
        self.index, self.prompt, self.ask, self.start = index, prompt, ask, start
        self.ids: list[int] = []
        self.logprobs: list[Any] = []
        self.text: str | None = None  # the engine's own text so far, when it detokenizes

    def feed(self, chunk: Any) -> None:
        self.ids += chunk.token_ids
        self.logprobs += chunk.logprobs or []
        if chunk.text is not None:
            self.text = (self.text or "") + chunk.text

    def body(self, out: Any, done: Any = None) -> dict[str, Any]:
        """The object: of the ``done`` completion, else of the chunks so far (``out``: the last)."""
        ids = list(done.token_ids) if done is not None else self.ids
        lps = (done.logprobs or []) if done is not None else self.logprobs
        if done is not None:
            text = done.text
        elif self.text is not None:
            text = self.text
        else:
            text = bytes(t for t in ids if t < 256).decode("utf-8", "replace")
        meta: dict[str, Any] = {
            "id": done.id if done is not None else None,
            "finish_reason": _finish(done) if done is not None else None,
            "prompt_tokens": len(self.prompt),
            "completion_tokens": len(ids),
            "cached_tokens": done.cached_tokens if done is not None else 0,
            "weight_version": out.weight_version if out.version_declared else DEFAULT_VERSION,
            "weight_version_declared": out.version_declared,
            "weight_version_current": out.version_current,
        }
        if done is not None and done.spans:
            meta["weight_version_spans"] = [s.to_reply() for s in done.spans]
            meta["weight_versions"] = [_span(s) for s in done.spans]
            last = done.spans[-1]  # SGLang 0.5.23: the label is the last span's
            meta["weight_version"] = last.version if last.version_declared else DEFAULT_VERSION
            meta["weight_version_declared"] = last.version_declared
            meta["weight_version_current"] = last.version_current
        elif done is not None:
            meta["weight_version_spans"] = []
        if "logprobs" in self.ask.sampling:
            meta["output_token_logprobs"] = [_entry(e) for e in lps]
            meta["output_top_logprobs"] = [[[finite(v), t, None] for t, v in e.top] for e in lps]
            if self.start is not None and done is not None and done.prompt_logprobs is not None:
                meta["input_token_logprobs"] = [
                    [None, t, None] if e is None else _entry(e)
                    for t, e in list(zip(self.prompt, done.prompt_logprobs, strict=True))[self.start :]
                ]
        reply = {"text": text, "output_ids": ids, "meta_info": meta}
        return {**reply, "index": self.index} if self.ask.stream else reply


def whole(replies: Sequence[Reply], outs: Sequence[Any], batch: bool) -> Any:
    bodies = [r.body(o, o) for r, o in zip(replies, outs, strict=True)]
    return bodies if batch else bodies[0]


async def events(
    replies: Sequence[Reply], streams: list[Any], finished: Callable[[str], None]
) -> AsyncIterator[dict[str, Any]]:
    """Every sequence's object so far, after each of its chunks; its final object at the end
    (``finished(finish_reason)`` is called for each)."""
    async with contextlib.aclosing(runs.merged(streams)) as merged:
        async for index, item in merged:
            reply = replies[index]
            if hasattr(item, "spans"):
                finished(item.finish_reason)
                yield reply.body(item, item)
            else:
                reply.feed(item)
                yield reply.body(item)
