"""The bodies of ``/v1/completions`` and ``/v1/chat/completions``, parsed strictly.

Three kinds of field: those honoured (their values become a :class:`Ask`), those accepted
and without effect on what is generated (``user``; ``model`` too, unless the worker serves
LoRA adapters: then it chooses one, :mod:`weightsync.serve.lora`), and those known to
OpenAI's or vLLM's API that this worker does not implement.  A field of the last kind is
accepted at its neutral value (``echo: false``, ``frequency_penalty: 0``…) and any other
value is a ``501 not_supported``, never silently ignored; a field of no kind is a
``400 unknown_field``.  Ranges of the sampling fields are checked by the engine's sampling
value (``invalid_value`` with the field's name) before anything is generated.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

import attrs

from weightsync.core.errors import InvalidRequest, NotSupported
from weightsync.core.validation import Body, array, boolean, integer, obj, string, type_name

SEED_RANGE: Final = (-(2**63), 2**63 - 1)
MAX_N: Final = 128
MAX_PROMPTS: Final = 256

NEUTRAL: Final[Mapping[str, tuple[Any, ...]]] = {
    "echo": (False,),
    "best_of": (None, 1),
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "logit_bias": (None, {}),
    "suffix": (None, ""),
    "min_tokens": (0,),
    "include_stop_str_in_output": (False,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "structured_outputs": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "response_format": (None,),
    "priority": (0,),
    "truncate_prompt_tokens": (None,),
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0),
    "logprobs_mode": (None, "raw_logprobs"),
    "skip_special_tokens": (True, False),  # a byte vocabulary has no special tokens
    "spaces_between_special_tokens": (True, False),
    "add_special_tokens": (True, False),
}
"""Known fields this worker does not implement, with the values that ask for nothing."""

CHAT_NEUTRAL: Final[Mapping[str, tuple[Any, ...]]] = {
    "continue_final_message": (False,),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, True, False),
    "documents": (None,),
    "mm_processor_kwargs": (None,),
}

SAMPLING: Final = (
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop",
    "stop_token_ids", "ignore_eos", "prompt_logprobs", "cache_salt",
)  # fmt: skip
COMMON: Final = (
    *SAMPLING, "model", "user", "n", "stream", "stream_options", "request_id", "return_token_ids",
    "return_tokens_as_token_ids", "return_weight_versions",
)  # fmt: skip
COMPLETION_FIELDS: Final = (*COMMON, "prompt", "logprobs", *NEUTRAL)
CHAT_FIELDS: Final = (
    *COMMON, "messages", "logprobs", "top_logprobs", "max_completion_tokens", "add_generation_prompt",
    *NEUTRAL, *CHAT_NEUTRAL,
)  # fmt: skip


@attrs.frozen
class Ask:
    """One generation request: ``n`` samples of each prompt (token ids, or text to encode),
    with ``sampling`` (the engine's sampling fields by name)."""

    prompts: list[list[int] | str]
    sampling: dict[str, Any]
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    tokens_as_ids: bool = False
    request_id: str | None = None
    return_weight_versions: bool = False
    """vLLM 0.33's ``return_weight_versions``: each choice's ``weight_versions``, half-open
    ``{version, start, end}`` spans of its tokens (on a stream, on the choice's last event)."""
    model: str | None = None
    """The model the request names: the base, or a LoRA adapter on a worker that serves them
    (:mod:`weightsync.serve.lora`); metadata on one that does not."""


def number(field: str, value: Any) -> float:
    if type(value) not in (int, float):
        raise InvalidRequest(
            f"{field} must be a number, got {type_name(value)}", code="wrong_type", field=field
        )
    return float(value)


def token_ids(field: str, value: Any) -> list[int]:
    ids = array(field, value, lambda f, v: integer(f, v, lo=0))
    if not ids:
        raise InvalidRequest(f"{field} must not be empty", code="invalid_value", field=field)
    return ids


def prompts_field(field: str, value: Any) -> list[list[int] | str]:
    """A prompt, or a batch: text, token ids, or a list of either."""
    if type(value) is str:
        return [_text(field, value)]
    if type(value) is not list or not value:
        raise InvalidRequest(
            f"{field} must be text, token ids, or a non-empty list of them", code="wrong_type", field=field
        )
    if all(type(v) is int for v in value):
        return [token_ids(field, value)]
    if len(value) > MAX_PROMPTS:
        raise InvalidRequest(
            f"{field} holds more than {MAX_PROMPTS} prompts", code="invalid_value", field=field
        )
    return [_text(field, v) if type(v) is str else token_ids(field, v) for v in value]


def _text(field: str, value: str) -> str:
    if not value:
        raise InvalidRequest(f"{field} must not be empty", code="invalid_value", field=field)
    return value


def stops_field(field: str, value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if type(value) is str:
        return (value,)
    return tuple(array(field, value, string))


def _sampling(b: Body, max_tokens_field: str = "max_tokens") -> dict[str, Any]:
    """The sampling fields given (absent ones keep the engine's defaults)."""
    checks: dict[str, Callable[[str, Any], Any]] = {
        "max_tokens": lambda f, v: integer(f, v),
        "temperature": number,
        "top_p": number,
        "top_k": lambda f, v: integer(f, v),
        "min_p": number,
        "repetition_penalty": number,
        "seed": lambda f, v: integer(f, v, *SEED_RANGE),
        "stop": stops_field,
        "stop_token_ids": lambda f, v: tuple(array(f, v, lambda g, w: integer(g, w, lo=0))),
        "ignore_eos": boolean,
        "prompt_logprobs": lambda f, v: integer(f, v),
        "cache_salt": string,  # vLLM's; its bounds are the engine's (Sampling)
    }
    out = {
        name: b.get(name, check)
        for name, check in checks.items()
        if b.has(name) and b.get(name, _any) is not None
    }
    if (
        max_tokens_field != "max_tokens"
        and b.has(max_tokens_field)
        and b.get(max_tokens_field, _any) is not None
    ):
        out["max_tokens"] = b.get(max_tokens_field, lambda f, v: integer(f, v))
    return out


def _any(field: str, value: Any) -> Any:
    return value


MAX_LOGPROBS: Final = 20
"""The most alternatives per token a request may ask for by default (vLLM's default
``max_logprobs``); ``serve --max-logprobs`` sets a worker's."""


def check_logprobs(sampling: Mapping[str, Any], cap: int) -> None:
    """Raises ``InvalidRequest`` (``invalid_value``) when ``sampling`` asks for more than ``cap``
    alternatives per position (``logprobs``, ``prompt_logprobs``); ``cap`` -1 sets no bound, as
    vLLM's ``--max-logprobs -1``."""
    for name in ("logprobs", "prompt_logprobs"):
        value = sampling.get(name)
        if cap >= 0 and value is not None and value > cap:
            raise InvalidRequest(
                f"{name} asks for {value} alternatives per token; this worker reports at most {cap} "
                "(serve --max-logprobs)",
                code="invalid_value",
                field=name,
            )


def refuse_unless_neutral(body: Mapping[str, Any], table: Mapping[str, tuple[Any, ...]]) -> None:
    for name, neutral in table.items():
        if name in body and not any(type(body[name]) is type(n) and body[name] == n for n in neutral):
            raise NotSupported(
                f"{name}={str(body[name])[:80]} is not supported by this worker "
                f"(accepted only as {' or '.join(repr(n) for n in neutral)})",
                code="not_supported",
                field=name,
            )


def _common(b: Body, body: Mapping[str, Any], sampling: dict[str, Any], prompts: list[Any]) -> dict[str, Any]:
    model = b.get("model", lambda f, v: v if v is None else string(f, v), None)
    b.get("user", lambda f, v: v if v is None else string(f, v), None)
    options = b.get("stream_options", lambda f, v: v if v is None else obj(f, v), None) or {}
    opts = Body(options, ("include_usage", "continuous_usage_stats"))
    if opts.get("continuous_usage_stats", boolean, False):
        raise NotSupported("stream_options.continuous_usage_stats is not supported", field="stream_options")
    n = b.get("n", lambda f, v: integer(f, v, 1, MAX_N), 1)
    if len(prompts) * n > MAX_PROMPTS:
        raise InvalidRequest(f"n × prompts exceeds {MAX_PROMPTS} sequences", code="invalid_value", field="n")
    return dict(
        prompts=prompts,
        sampling=sampling,
        n=n,
        stream=b.get("stream", lambda f, v: v is not None and boolean(f, v), False),
        include_usage=opts.get("include_usage", boolean, False),
        return_token_ids=b.get("return_token_ids", lambda f, v: v is not None and boolean(f, v), False),
        tokens_as_ids=b.get(
            "return_tokens_as_token_ids", lambda f, v: v is not None and boolean(f, v), False
        ),
        request_id=b.get("request_id", string, None),
        return_weight_versions=b.get(
            "return_weight_versions", lambda f, v: v is not None and boolean(f, v), False
        ),
        model=model,
    )


def parse_completion(body: Any) -> Ask:
    """``/v1/completions``' body.  Raises ``InvalidRequest`` or ``NotSupported``."""
    b = Body(body, COMPLETION_FIELDS)
    refuse_unless_neutral(body, NEUTRAL)
    sampling = _sampling(b)
    logprobs = b.get("logprobs", lambda f, v: v if v is None else integer(f, v), None)
    if logprobs is not None:
        sampling["logprobs"] = logprobs
    return Ask(**_common(b, body, sampling, b.get("prompt", prompts_field)))


def parse_chat(body: Any, render: Callable[[list[dict[str, str]], bool], str | list[int]]) -> Ask:
    """``/v1/chat/completions``' body, its messages rendered to one prompt (text, or token ids)
    by ``render(messages, add_generation_prompt)``.  Raises ``InvalidRequest`` or
    ``NotSupported``."""
    b = Body(body, CHAT_FIELDS)
    refuse_unless_neutral(body, {**NEUTRAL, **CHAT_NEUTRAL})
    sampling = _sampling(b, "max_completion_tokens")
    if b.get("logprobs", lambda f, v: v is not None and boolean(f, v), False):
        sampling["logprobs"] = b.get("top_logprobs", lambda f, v: 0 if v is None else integer(f, v), 0)
    elif b.get("top_logprobs", _any, None) is not None:
        raise InvalidRequest("top_logprobs needs logprobs: true", code="invalid_value", field="top_logprobs")
    messages = b.get("messages", lambda f, v: array(f, v, _message))
    if not messages:
        raise InvalidRequest("messages must not be empty", code="invalid_value", field="messages")
    gen_prompt = b.get("add_generation_prompt", boolean, True)
    return Ask(**_common(b, body, sampling, [render(messages, gen_prompt)]))


ROLES: Final = ("system", "developer", "user", "assistant", "tool")


def _message(field: str, value: Any) -> dict[str, str]:
    m = Body(value, ("role", "content", "name", "tool_call_id"))
    role = m.get("role", string)
    if role not in ROLES:
        raise InvalidRequest(f"{field}.role must be one of {list(ROLES)}", code="invalid_value", field=field)
    m.get("name", string, None)
    m.get("tool_call_id", string, None)
    return {"role": role, "content": m.get("content", _content, "")}


def _content(field: str, value: Any) -> str:
    """Text, or OpenAI's list of parts, of which only ``{"type": "text", "text"}`` is supported
    (their texts joined by newlines, as vLLM joins them for a template that takes text)."""
    if value is None or type(value) is str:
        return value or ""
    parts = []
    for part in array(field, value, obj):
        p = Body(part, ("type", "text", "image_url", "input_audio", "file"))
        kind = p.get("type", string)
        if kind != "text":
            raise NotSupported(f"{field}: content parts of type {kind[:40]!r} are not supported", field=field)
        parts.append(p.get("text", string))
    return "\n".join(parts)
