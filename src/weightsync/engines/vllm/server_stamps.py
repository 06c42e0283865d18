"""weightsync's version stamps on vLLM's own completions, inside vLLM's server (the middleware).

Replies of vLLM's ``POST /v1/completions`` and ``/v1/chat/completions`` get the fields the
worker's own generation routes carry (:mod:`weightsync.serve.generation.openai`): a whole
reply, on each choice and (the first choice's) at the top, ``weight_version``,
``weight_version_declared``, ``weight_version_current`` and ``weight_version_spans``; a
stream, the stamps on every event and a choice's spans on the event that finishes it (the
first choice's on the usage event).  Both get the header ``x-weightsync-weight-version``: the
version (canonical JSON, ``null`` while undeclared) of the first choice, as the router sets
it; a stream's response starts with its first event, so the header can name it.

Where the versions come from.  While vLLM answers the request, the engine client's
``generate`` (which vLLM's serving layer calls once per prompt) is followed (a context variable
names the HTTP request's :class:`Tracker`), output by output:

* spans: vLLM's engine core labels each step's tokens with its weight version and reports
  a finished choice's spans (``CompletionOutput.weight_versions``); the vLLM engine names every
  weight epoch there before and after it writes (:func:`~weightsync.engines.vllm.engine.epoch_label`),
  so the spans are those of the steps that produced the tokens.  A vLLM that reports none:
  each token counts for the epoch at which it reached the server, and a whole (not streamed)
  reply across a write names no version;
* a stream's per-event stamps: the epoch at which the choice's first tokens reached the
  server (the worker's rule for its streams), the current epoch before they did.

Beam search (``use_beam_search``) runs engine requests of its own and is not followed: its
choices are stamped with the epoch the request started under when no write happened until the
reply (else no version), with spans only where the reply says how many tokens a choice has.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import attrs
from starlette.types import Message, Send

from weightsync.engines.stamps import VersionStamps
from weightsync.engines.vllm.engine import label_epoch
from weightsync.serve.generation.openai import stamps

HEADER = b"x-weightsync-weight-version"
NO_VERSION = -1
"""The epoch of tokens whose weights are unknown (never committed as a version)."""

CURRENT: contextvars.ContextVar[Tracker | None] = contextvars.ContextVar("weightsync_tracker", default=None)
"""The tracker of the HTTP request vLLM is answering in this context."""


@attrs.define(eq=False)
class _Choice:
    """One sequence of one prompt, as its outputs reached the server."""

    first: int | None = None
    """The epoch when its first tokens arrived."""
    arrived: list[int] = attrs.field(factory=list)
    """The epoch at which each token arrived."""
    labelled: list[int] | None = None
    """The epoch of each token, from vLLM's spans (once finished)."""

    def epochs(self) -> list[int]:
        return self.labelled if self.labelled is not None else self.arrived


def _epochs_of(weight_versions: Any, count: int) -> list[int] | None:
    """Per-token epochs from vLLM's spans (``version``, ``start``, ``end``), ``None`` unless
    they cover exactly ``count`` tokens."""
    out: list[int] = []
    for span in weight_versions:
        if span.start != len(out) or span.end < span.start:
            return None
        epoch = label_epoch(span.version)
        out += [NO_VERSION if epoch is None else epoch] * (span.end - span.start)
    return out if len(out) == count else None


class Tracker:
    """The engine requests of one HTTP request (prompt by prompt, ``n`` choices each) and the
    epochs of their tokens; stamps the reply vLLM makes of them."""

    def __init__(self, versions: VersionStamps, n: int, *, following: bool = True) -> None:
        self.versions = versions
        self.n = n
        self.following = following
        """Whether the engine requests are followed (not for beam search)."""
        self.start = versions.epoch
        self._prompts: list[dict[int, _Choice]] = []

    # ------------------------------------------------------------------ following the engine

    def follow(self, outputs: AsyncIterator[Any], params: Any) -> AsyncIterator[Any]:
        """``outputs`` (an engine request's ``RequestOutput`` stream, the next prompt's), each
        output recorded before it is passed on."""
        from vllm.sampling_params import RequestOutputKind

        choices: dict[int, _Choice] = {}
        self._prompts.append(choices)
        kind = getattr(params, "output_kind", None)
        delta, whole = kind == RequestOutputKind.DELTA, kind == RequestOutputKind.FINAL_ONLY

        async def followed() -> AsyncIterator[Any]:
            async with contextlib.aclosing(outputs) as source:  # type: ignore[type-var]
                async for res in source:
                    for o in res.outputs:
                        self._observe(choices.setdefault(o.index, _Choice()), o, delta, whole)
                    yield res

        return followed()

    def _observe(self, c: _Choice, o: Any, delta: bool, whole: bool) -> None:
        new = len(o.token_ids) if delta else len(o.token_ids) - len(c.arrived)
        epoch = self.versions.epoch
        if new > 0:
            c.first = epoch if c.first is None else c.first
            c.arrived += [epoch] * new
        if o.finish_reason is None:
            return
        found = getattr(o, "weight_versions", None)
        c.labelled = None if found is None else _epochs_of(found, len(c.arrived))
        if c.labelled is None and whole and epoch != self.start:  # came whole across a write
            c.labelled = [NO_VERSION] * len(c.arrived)

    # ------------------------------------------------------------------ stamping the reply

    def _choice(self, index: Any) -> _Choice | None:
        if not isinstance(index, int) or index < 0:
            return None
        p, j = divmod(index, self.n)
        return self._prompts[p].get(j) if p < len(self._prompts) else None

    def _untracked(self) -> int:
        """The epoch of a choice not followed: the request's, unless weights were written since."""
        return self.start if self.versions.epoch == self.start else NO_VERSION

    def _stamps(self, epoch: int) -> dict[str, Any]:
        return stamps(self.versions.chunk(epoch, [], None))

    def _whole_choice(self, choice: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]] | None]:
        """A finished choice's stamps and spans (``None``: unknown, the choice untracked and
        its token count not in the reply)."""
        c = self._choice(choice.get("index"))
        if c is not None:
            epochs: list[int] | None = c.epochs()
        else:
            count = _token_count(choice)
            epochs = None if count is None else [self._untracked()] * count
        first = epochs[0] if epochs else (self._untracked() if c is None else self.start)
        found = None if epochs is None else [s.to_reply() for s in self.versions.spans(epochs)]
        return self._stamps(first), found

    def stamp_reply(self, reply: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        """``reply`` (a whole completion or chat completion) stamped, and its version."""
        choices = [c for c in reply.get("choices") or [] if isinstance(c, dict)]
        top: tuple[dict[str, Any], list[dict[str, Any]] | None] | None = None
        for choice in choices:
            found, span_list = self._whole_choice(choice)
            choice.update(found)
            if span_list is not None:
                choice["weight_version_spans"] = span_list
            top = top or (found, span_list)
        if top is None:
            top = (self._stamps(self._untracked()), None)
        reply.update(top[0])
        if top[1] is not None:
            reply["weight_version_spans"] = top[1]
        return reply, top[0]["weight_version"]

    def stamp_event(self, event: dict[str, Any]) -> Any:
        """One streamed event stamped (its choice's spans when it finishes it); returns the
        version it names."""
        choices = [c for c in event.get("choices") or [] if isinstance(c, dict)]
        if not choices:  # the usage event: the first choice's, as the worker's
            found, span_list = self._whole_choice({"index": 0})
            event.update(found)
            if span_list is not None:
                event["weight_version_spans"] = span_list
            return found["weight_version"]
        for choice in choices:
            if choice.get("finish_reason") is not None:
                _, span_list = self._whole_choice(choice)
                if span_list is not None:
                    choice["weight_version_spans"] = span_list
        c = self._choice(choices[0].get("index"))
        if c is not None and c.first is not None:
            epoch = c.first
        else:  # no token yet: the weights it will start on, as far as they are known
            epoch = self.versions.epoch if self.following else self._untracked()
        found = self._stamps(epoch)
        event.update(found)
        return found["weight_version"]

    def relay(self, send: Send) -> Send:
        """``send`` with every reply of vLLM's stamped (see :class:`StampedSend`)."""
        return StampedSend(self, send)


def _token_count(choice: dict[str, Any]) -> int | None:
    """How many tokens a choice has, where the reply says it: ``token_ids``, else its logprobs."""
    if isinstance(choice.get("token_ids"), list):
        return len(choice["token_ids"])
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict):
        for key in ("tokens", "content"):  # completions, chat
            if isinstance(logprobs.get(key), list):
                return len(logprobs[key])
    return None


def canonical(version: Any) -> bytes:
    """The header's value: the version as canonical JSON (as the router writes it)."""
    return json.dumps(version, sort_keys=True, separators=(",", ":")).encode()


class StampedSend:
    """An ASGI ``send`` that stamps a successful JSON reply whole and a stream event by event
    (holding the response start until the first event, to name its version), and passes
    anything else (errors, other media) as it is."""

    def __init__(self, tracker: Tracker, send: Send) -> None:
        self.tracker = tracker
        self.send = send
        self.mode = "pass"
        self.start: Message | None = None
        self.buffer = b""

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            kind = dict(message.get("headers", [])).get(b"content-type", b"")
            if message["status"] == 200 and kind.startswith((b"application/json", b"text/event-stream")):
                self.mode = "json" if kind.startswith(b"application/json") else "events"
                self.start = message
                return
        elif message["type"] == "http.response.body" and self.mode != "pass":
            self.buffer += message.get("body", b"")
            more = bool(message.get("more_body", False))
            await (self._events(more) if self.mode == "events" else self._json(more))
            return
        await self.send(message)

    async def _begin(self, version: Any, length: int | None = None) -> None:
        assert self.start is not None
        drop = {HEADER, b"content-length"} if length is not None else {HEADER}
        headers = [(k, v) for k, v in self.start.get("headers", []) if k.lower() not in drop]
        headers.append((HEADER, canonical(version)))
        if length is not None:
            headers.append((b"content-length", str(length).encode()))
        await self.send({**self.start, "headers": headers})
        self.start = None

    async def _json(self, more: bool) -> None:
        if more:
            return
        body, self.buffer = self.buffer, b""
        try:
            reply = json.loads(body)
        except ValueError:
            reply = None
        if isinstance(reply, dict):
            stamped, version = self.tracker.stamp_reply(reply)
            body = json.dumps(stamped).encode()
        else:  # not a reply vLLM makes: passed on as it is, unlabelled
            version = None
        await self._begin(version, len(body))
        await self.send({"type": "http.response.body", "body": body, "more_body": False})

    async def _events(self, more: bool) -> None:
        *complete, self.buffer = self.buffer.split(b"\n\n")
        out, versions = [], []
        for raw in complete:
            stamped, named = _stamped_event(raw, self.tracker.stamp_event)
            out.append(stamped + b"\n\n")
            versions += named
        if not more:
            out.append(self.buffer)
            self.buffer = b""
        if not out and more:
            return
        if self.start is not None:
            await self._begin(versions[0] if versions else None)
        await self.send({"type": "http.response.body", "body": b"".join(out), "more_body": more})


def _stamped_event(raw: bytes, stamp: Callable[[dict[str, Any]], Any]) -> tuple[bytes, list[Any]]:
    """One event's bytes (``data: {...}``) stamped, and the version it names (none for an
    event that is not a chunk: ``[DONE]``, an error)."""
    if not raw.startswith(b"data: ") or raw == b"data: [DONE]":
        return raw, []
    try:
        event = json.loads(raw[6:])
    except ValueError:
        return raw, []
    if not isinstance(event, dict) or "choices" not in event:
        return raw, []
    version = stamp(event)
    return b"data: " + json.dumps(event).encode(), [version]


def follow_generation(engine_client: Any) -> None:
    """Wrap ``engine_client.generate`` (once) so that the engine requests made for a request
    with a :class:`Tracker` in :data:`CURRENT` are followed by it."""
    original = engine_client.generate
    if getattr(original, "weightsync_followed", False):
        return

    def generate(*args: Any, **kwargs: Any) -> Any:
        outputs = original(*args, **kwargs)
        tracker = CURRENT.get()
        if tracker is None or not tracker.following:
            return outputs
        params = args[1] if len(args) > 1 else kwargs.get("sampling_params")
        return tracker.follow(outputs, params)

    generate.weightsync_followed = True  # type: ignore[attr-defined]
    engine_client.generate = generate
