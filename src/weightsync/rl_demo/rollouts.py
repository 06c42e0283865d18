"""Rollouts through the router: one streamed completion request per prompt, ``n`` samples
each, with the log-probability of every sampled token and the spans of versions that
produced them.

Streamed, because a non-streamed reply whose tokens came from two versions (a fleet
transaction paused it mid-request, with ``pause_mode="keep"``, and it resumed on the new
weights) is one the router will not relay: it fences the worker and retries the whole request
elsewhere.  A stream is relayed as it comes, so a sample that crossed a version reaches the
trainer with both of its spans, and the trainer decides what to do with it.

:func:`samples_from_events` turns one request's events into :class:`Sample` values (pure);
:class:`Rollouts` sends the requests, retrying while the router has no routable worker (a
fleet transaction is committing: ``503 no_worker``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable, Mapping
from typing import Any, Final

import attrs
import httpx

from weightsync.rl_demo.task import Prompt, reward

RETRY_S: Final = 0.05
"""How long a rollout waits before asking the router again after ``503``."""
TOKEN_ID: Final = "token_id:"


class RolloutFailed(Exception):
    """The router (or the worker behind it) answered a rollout with an error."""


@attrs.frozen
class Span:
    """Tokens ``first``..``last`` (inclusive) of a sample came from the weights committed as
    ``version`` with content digest ``digest``, under fleet epoch ``epoch`` where the worker
    names it (``None`` where it does not)."""

    version: Any
    digest: str | None
    first: int
    last: int
    declared: bool
    current: bool
    epoch: int | None = None

    @classmethod
    def from_reply(cls, span: Mapping[str, Any]) -> Span:
        epoch = span.get("epoch")
        return cls(
            span.get("version"),
            span.get("digest"),
            int(span["first_token"]),
            int(span["last_token"]),
            span.get("version_declared") is True,
            span.get("version_current") is True,
            epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None,
        )


@attrs.frozen
class Sample:
    """One sampled completion: its tokens, the rollout's log-probability of each (from the
    forward pass that sampled it), the version spans, who served it and its reward.
    ``epoch`` is the fleet epoch the router labelled the reply with: that of the committed
    weights it was routed to (its first token's)."""

    prompt: Prompt
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    spans: tuple[Span, ...]
    worker: str
    epoch: int | None
    reward: float

    @property
    def crossed(self) -> bool:
        """Whether its tokens came from more than one version (a mid-request update)."""
        return len({json.dumps(s.version) for s in self.spans}) > 1


def _token_id(token: str) -> int:
    if not token.startswith(TOKEN_ID):
        raise RolloutFailed(f"a token is not spelled {TOKEN_ID}N: {token[:40]!r}")
    return int(token.removeprefix(TOKEN_ID))


def samples_from_events(
    prompt: Prompt, events: Iterable[Mapping[str, Any]], worker: str, epoch: int | None
) -> list[Sample]:
    """The samples of one streamed request (its decoded events, ``[DONE]`` left out), in
    choice order.  Raises :class:`RolloutFailed` for an error event, a choice that never
    finished, or spans that do not cover its tokens exactly."""
    tokens: dict[int, list[int]] = {}
    logprobs: dict[int, list[float]] = {}
    spans: dict[int, tuple[Span, ...]] = {}
    for ev in events:
        if "error" in ev:
            raise RolloutFailed(f"the stream ended with an error: {json.dumps(ev['error'])[:300]}")
        for choice in ev.get("choices", ()):
            i = int(choice["index"])
            lp = choice.get("logprobs")
            if lp:
                tokens.setdefault(i, []).extend(_token_id(t) for t in lp["tokens"])
                logprobs.setdefault(i, []).extend(float(x) for x in lp["token_logprobs"])
            if choice.get("finish_reason") is not None:
                spans[i] = tuple(Span.from_reply(s) for s in choice.get("weight_version_spans") or ())
    out = []
    prompt_ids = tuple(prompt.text.encode())
    for i in sorted(tokens):
        if i not in spans:
            raise RolloutFailed(f"choice {i} never finished")
        ids, covered = tokens[i], [t for s in spans[i] for t in range(s.first, s.last + 1)]
        if covered != list(range(len(ids))):
            raise RolloutFailed(f"choice {i}'s spans do not cover its {len(ids)} tokens once each")
        out.append(
            Sample(
                prompt,
                prompt_ids,
                tuple(ids),
                tuple(logprobs[i]),
                spans[i],
                worker,
                epoch,
                reward(prompt, ids),
            )
        )
    return out


class Rollouts:
    """Samples groups through the router at ``url``: ``group_size`` completions of
    ``max_tokens`` tokens per prompt, temperature 1 (the log-probabilities the worker reports
    are then those of the distribution it sampled from)."""

    def __init__(self, url: str, *, group_size: int, max_tokens: int, deadline_s: float = 120.0) -> None:
        self.http = httpx.AsyncClient(base_url=url, timeout=deadline_s)
        self.group_size = group_size
        self.max_tokens = max_tokens
        self.deadline_s = deadline_s

    async def aclose(self) -> None:
        await self.http.aclose()

    async def group(self, prompt: Prompt, seed: int) -> list[Sample]:
        """``group_size`` samples for ``prompt``.  Raises :class:`RolloutFailed` for an error
        reply, or when the router had no routable worker for ``deadline_s``."""
        body = {
            "prompt": prompt.text,
            "n": self.group_size,
            "max_tokens": self.max_tokens,
            "temperature": 1.0,
            "logprobs": 0,
            "seed": seed,
            "stream": True,
            "return_tokens_as_token_ids": True,
        }
        deadline = time.monotonic() + self.deadline_s
        while True:
            async with self.http.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code == 200:
                    events = [json.loads(line[5:]) async for line in r.aiter_lines() if _is_event(line)]
                    epoch = r.headers.get("x-weightsync-weight-epoch")
                    worker = r.headers.get("x-weightsync-worker", "")
                    return samples_from_events(
                        prompt, events, worker, None if epoch in (None, "null") else int(epoch)
                    )
                text = (await r.aread()).decode(errors="replace")
            if r.status_code != 503 or time.monotonic() > deadline:
                raise RolloutFailed(f"HTTP {r.status_code}: {text[:300]}")
            await asyncio.sleep(RETRY_S)  # a fleet transaction is committing: no worker routable yet


def _is_event(line: str) -> bool:
    return line.startswith("data:") and line[5:].strip() != "[DONE]"
