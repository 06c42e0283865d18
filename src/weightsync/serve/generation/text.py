"""Tokens as text for the generation replies: the tokenizer the engine brings, how a token
reads on its own (or ``"token_id:N"``), and a streamed text that never shows a stop string.

Engines and their values are read by shape (this front door sits below the engines): a
completion has ``token_ids``, ``logprobs`` (entries with ``token``, ``logprob``, ``rank``,
``top`` and ``decoded``, the engine's own spelling of them) and ``stop_reason``.
"""

from __future__ import annotations

import codecs
import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from weightsync.core.errors import NotSupported

FLOOR = -9999.0
"""What a log-probability of ``-inf`` reads as in JSON (vLLM's floor)."""


@runtime_checkable
class Tokenizer(Protocol):
    """What the generation routes need of an engine's tokenizer."""

    def encode(self, text: str, field: str = ...) -> list[int]: ...

    def token_text(self, token: int) -> str: ...

    def chat(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = ...
    ) -> str | list[int]:
        """The messages in the chat template: text to encode, or the prompt's token ids."""


def tokenizer_of(engine: Any, what: str) -> Tokenizer:
    """``engine``'s tokenizer.  Raises ``NotSupported`` when it has none (``what`` needs one)."""
    tok = getattr(engine, "tokenizer", None)
    if not isinstance(tok, Tokenizer):
        raise NotSupported(
            f"{what} needs a tokenizer and this engine has none: send token ids", field="prompt"
        )
    return tok


def finite(x: float) -> float:
    return x if math.isfinite(x) else FLOOR


class Spelling:
    """How tokens read in logprobs: ``"token_id:N"`` when asked, else the engine's own spelling
    where its entry carries one (``decoded``), else the tokenizer's reading of the token alone
    (``"token_id:N"`` without a tokenizer), as vLLM spells them."""

    def __init__(self, tokenizer: Tokenizer | None, as_ids: bool) -> None:
        self.as_ids = as_ids
        self.tokenizer = tokenizer

    def __call__(self, token: int, decoded: Sequence[tuple[int, str]] = ()) -> str:
        text = None if self.as_ids else self.text(token, decoded)
        return f"token_id:{token}" if text is None else text

    def text(self, token: int, decoded: Sequence[tuple[int, str]] = ()) -> str | None:
        """The token's own text however tokens are spelled (``None`` without a tokenizer)."""
        for t, text in decoded:
            if t == token:
                return text
        return None if self.tokenizer is None else self.tokenizer.token_text(token)


class TextStream:
    """The text of a byte-level output as it grows: each :meth:`feed` returns what can be
    shown now, holding back a partial UTF-8 character and any tail that may still become a
    stop string; :meth:`end` returns the rest, the matched stop string left out."""

    def __init__(self, stops: Sequence[str] = ()) -> None:
        self._stops = [s.encode("utf-8") for s in stops]
        # The last bytes stay until the next token: a stop string matched at the end is whole in them.
        self._hold = max((len(s) for s in self._stops), default=0)
        self._pending = b""
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_ids: Sequence[int]) -> str:
        self._pending += bytes(t for t in token_ids if t < 256)
        cut = len(self._pending) - self._hold
        if cut <= 0:
            return ""
        ready, self._pending = self._pending[:cut], self._pending[cut:]
        return self._decoder.decode(ready)

    def end(self, stop_reason: Any = None) -> str:
        rest = self._pending
        if isinstance(stop_reason, str):
            stop = stop_reason.encode("utf-8")
            rest = rest[: -len(stop)] if rest.endswith(stop) else rest
        self._pending = b""
        return self._decoder.decode(rest, final=True)


def offsets(spelled: Sequence[str], start: int = 0) -> list[int]:
    """``text_offset`` as vLLM counts it: ``start`` (the text already sent), then each token
    after the one before, by the length of the token as spelled."""
    out, at = [], start
    for text in spelled:
        out.append(at)
        at += len(text)
    return out


def completion_logprobs(entries: Sequence[Any], spell: Spelling, start: int = 0) -> dict[str, Any]:
    """OpenAI completions' ``logprobs`` object for ``entries`` (one per token): the sampled
    token's log-probability, and as ``top_logprobs`` it with the alternatives (as vLLM)."""
    tokens = [spell(e.token, e.decoded) for e in entries]
    return {
        "text_offset": offsets(tokens, start),
        "token_logprobs": [finite(e.logprob) for e in entries],
        "tokens": tokens,
        "top_logprobs": [
            {text: finite(e.logprob), **{spell(t, e.decoded): finite(lp) for t, lp in e.top}}
            for text, e in zip(tokens, entries, strict=True)
        ],
    }


def chat_logprobs(entries: Sequence[Any], spell: Spelling) -> dict[str, Any]:
    """OpenAI chat's ``logprobs`` object (``content``: one entry per token).  As vLLM, a
    sampled token's ``bytes`` are its own text's (``null`` without a tokenizer) however it is
    spelled, an alternative's those of its spelling."""

    def one(token: int, logprob: float, decoded: Sequence[tuple[int, str]]) -> dict[str, Any]:
        text = spell(token, decoded)
        return {"token": text, "logprob": finite(logprob), "bytes": _utf8(text)}

    def sampled(e: Any) -> dict[str, Any]:
        text = spell.text(e.token, e.decoded)
        return {**one(e.token, e.logprob, e.decoded), "bytes": None if text is None else _utf8(text)}

    return {
        "content": [
            {**sampled(e), "top_logprobs": [one(t, lp, e.decoded) for t, lp in e.top]} for e in entries
        ]
    }


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def prompt_logprobs(entries: Sequence[Any] | None, spell: Spelling) -> list[Any] | None:
    """vLLM's ``prompt_logprobs``: per prompt token (the first ``None``), token id ->
    ``{logprob, rank, decoded_token}`` for it and the alternatives."""
    if entries is None:
        return None
    out: list[Any] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        ranked = {t: (lp, r) for r, (t, lp) in enumerate(e.top, 1)}
        ranked[e.token] = (e.logprob, e.rank)
        out.append(
            {
                str(t): {"logprob": finite(lp), "rank": r, "decoded_token": spell(t, e.decoded)}
                for t, (lp, r) in ranked.items()
            }
        )
    return out
