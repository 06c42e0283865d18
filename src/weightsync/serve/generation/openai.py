"""OpenAI's reply shapes for completions and chat, whole or streamed, with weightsync's stamps.

A whole reply carries, beside OpenAI's and vLLM's fields, the stamps of its first choice at
the top (``weight_version``, ``weight_version_declared``, ``weight_version_current``,
``weight_version_spans``, SGLang's ``metadata.weight_version``) and each choice's own stamps
on it.  A stream is ``chat.completion.chunk`` / ``text_completion`` events; every event carries
the version stamps of its choice, and the event that finishes a choice carries its spans.
A choice that ran with a LoRA adapter names it (``adapter``: name, version, digest) beside
the base's stamps, in every event and span.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import attrs

from weightsync.edge.dialects import DEFAULT_VERSION
from weightsync.serve.generation.fields import Ask
from weightsync.serve.generation.text import (
    Spelling,
    TextStream,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs,
)


def stamps(out: Any) -> dict[str, Any]:
    """The version stamps of a chunk or a completion (and its LoRA adapter's, when it ran with one)."""
    return {
        "weight_version": out.weight_version,
        "weight_version_declared": out.version_declared,
        "weight_version_current": out.version_current,
        **({} if out.adapter is None else {"adapter": out.adapter.to_reply()}),
    }


def spans(out: Any) -> list[dict[str, Any]]:
    return [s.to_reply() for s in out.spans]


def weight_versions(out: Any) -> list[dict[str, Any]]:
    """vLLM 0.33's ``choices[i].weight_versions``: the spans half-open, ``[start, end)`` in
    the choice's output tokens, each with the version that produced them (``null`` for weights
    never declared).  weightsync's ``weight_version_spans`` say the same, closed, with more."""
    return [
        {
            "version": s.version if s.version_declared else None,
            "start": s.first_token,
            "end": s.last_token + 1,
        }
        for s in out.spans
    ]


def usage(outs: Sequence[Any], n: int) -> dict[str, Any]:
    """Token counts of every choice (``n`` per prompt, prompt-major); a prompt and its cached
    tokens count once, however many samples it had, as vLLM counts them."""
    firsts = outs[::n]
    prompt = sum(o.prompt_tokens for o in firsts)
    cached = sum(o.cached_tokens for o in firsts)
    completion = sum(len(o.token_ids) for o in outs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "cached_tokens": cached,
    }


@attrs.frozen
class Shape:
    """What every reply of one request shares."""

    ask: Ask
    chat: bool
    model: str
    id: str
    spell: Spelling
    prompts: list[list[int]]
    created: int = attrs.field(factory=lambda: int(time.time()))

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def head(self, obj: str | None = None) -> dict[str, Any]:
        return {"id": self.id, "object": obj or self.object, "created": self.created, "model": self.model}

    def logprobs(self, entries: Sequence[Any] | None, start: int = 0) -> dict[str, Any] | None:
        if entries is None:
            return None
        return (
            chat_logprobs(entries, self.spell)
            if self.chat
            else completion_logprobs(entries, self.spell, start)
        )

    def versions(self, out: Any) -> dict[str, Any]:
        """``weight_versions`` when the request asked for them (``return_weight_versions``)."""
        return {"weight_versions": weight_versions(out)} if self.ask.return_weight_versions else {}

    def ids(self, index: int, out: Any) -> dict[str, Any]:
        """vLLM's token-id fields of a choice (``prompt_token_ids`` when asked)."""
        extra: dict[str, Any] = {"token_ids": list(out.token_ids)}
        if self.ask.return_token_ids:
            extra["prompt_token_ids"] = self.prompts[index // self.ask.n]
        if self.ask.sampling.get("prompt_logprobs") is not None:
            extra["prompt_logprobs"] = prompt_logprobs(out.prompt_logprobs, self.spell)
        return extra


def whole(shape: Shape, outs: Sequence[Any]) -> dict[str, Any]:
    """The reply to a request not streamed: every choice, in order."""
    choices = []
    for i, out in enumerate(outs):
        body = {"message": {"role": "assistant", "content": out.text}} if shape.chat else {"text": out.text}
        choices.append(
            {
                "index": i,
                **body,
                "logprobs": shape.logprobs(out.logprobs),
                "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason,
                **shape.ids(i, out),
                **stamps(out),
                "weight_version_spans": spans(out),
                **shape.versions(out),
            }
        )
    first = outs[0]
    top: dict[str, Any] = {}
    if shape.chat and shape.ask.return_token_ids:  # vLLM's chat puts the prompt's ids at the top
        top["prompt_token_ids"] = shape.prompts[0]
    return {
        **shape.head(),
        "choices": choices,
        **top,
        "usage": usage(outs, shape.ask.n),
        **stamps(first),
        "weight_version_spans": spans(first),
        # SGLang's place for it (its OpenAI replies' `metadata`), "default" while undeclared
        "metadata": {"weight_version": first.weight_version if first.version_declared else DEFAULT_VERSION},
    }


class Events:
    """The streamed events of one request: :meth:`item` turns each ``(choice, chunk or
    completion)`` into the events to send, :meth:`tail` gives the closing ones."""

    def __init__(self, shape: Shape, stops: Sequence[str]) -> None:
        self.shape = shape
        count = len(shape.prompts) * shape.ask.n
        self._text = [TextStream(stops) for _ in range(count)]
        self._shown = [0] * count  # characters sent per choice (text offsets of logprobs)
        self._sent = [0] * count  # characters of the engine's own text sent per choice
        self._started = [False] * count
        self._done: list[Any] = [None] * count

    def _event(self, index: int, out: Any, delta: str, **fields: Any) -> dict[str, Any]:
        shape = self.shape
        if shape.chat:
            d: dict[str, Any] = {"content": delta}
            if not self._started[index]:
                d = {"role": "assistant", **d}
            choice: dict[str, Any] = {"index": index, "delta": d}
        else:
            choice = {"index": index, "text": delta}
        self._started[index] = True
        choice.update(fields)
        return {
            **shape.head(f"{shape.object}.chunk" if shape.chat else None),
            "choices": [choice],
            **stamps(out),
        }

    def item(self, index: int, item: Any) -> list[dict[str, Any]]:
        if hasattr(item, "spans"):  # the completion: the choice's last event
            self._done[index] = item
            if item.detokenized is None:
                tail = self._text[index].end(item.stop_reason)
            else:  # the engine's text: what its chunks did not carry yet
                tail = item.detokenized[self._sent[index] :]
            return [
                self._event(
                    index,
                    item,
                    tail,
                    logprobs=None,
                    finish_reason=item.finish_reason,
                    stop_reason=item.stop_reason,
                    weight_version_spans=spans(item),
                    **self.shape.versions(item),
                )
            ]
        if item.text is None:
            delta = self._text[index].feed(item.token_ids)
        else:  # the engine detokenizes (and holds back a tail that may become a stop string)
            delta = item.text
            self._sent[index] += len(delta)
        logprobs = self.shape.logprobs(item.logprobs, self._shown[index])
        self._shown[index] += len(delta)
        fields: dict[str, Any] = {"logprobs": logprobs, "finish_reason": None}
        if self.shape.ask.return_token_ids:
            fields["token_ids"] = list(item.token_ids)
            if not self._started[index]:
                fields["prompt_token_ids"] = self.shape.prompts[index // self.shape.ask.n]
        return [self._event(index, item, delta, **fields)]

    def tail(self) -> list[dict[str, Any]]:
        """After every choice finished: the usage event, when ``stream_options`` asked."""
        if not self.shape.ask.include_usage:
            return []
        outs = [o for o in self._done if o is not None]
        first = outs[0]
        return [
            {
                **self.shape.head(f"{self.shape.object}.chunk" if self.shape.chat else None),
                "choices": [],
                "usage": usage(outs, self.shape.ask.n),
                **stamps(first),
                "weight_version_spans": spans(first),
            }
        ]
