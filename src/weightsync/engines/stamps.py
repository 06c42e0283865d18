"""Version stamps for generated tokens, shared by every engine.

An engine numbers the weights it serves with an *epoch* (bumped whenever weights change)
and stamps each generated token with the epoch that produced it.  The controller tells the
engine, after every commit, which version the current epoch is (``observe_commit``); when a
completion ends its epochs become spans of versions.  An epoch that was never committed
(weights written by an update still in flight, or one that failed) is reported as
``version: null, version_declared: false``: those tokens came from no declared version.

A sequence that ran with a LoRA adapter names it beside the base's version, in its completion,
its chunks and every span: :class:`AdapterStamp` (the adapter's slot, the version it was loaded
as, its digest).  A sequence keeps the adapter version it started with to its end, so one stamp
holds for all its tokens.
"""

from __future__ import annotations

from typing import Any

import attrs

from weightsync.core.snapshot import Snapshot
from weightsync.engines.sampling import TokenLogprob


@attrs.frozen
class AdapterStamp:
    """The LoRA adapter a sequence ran with: its slot ``name``, the ``version`` it was loaded as
    (``version_declared``: whether it had one), whether that label was declared for these very
    bytes (``version_current``), and its ``digest`` (matrices and the config that changes the math)."""

    name: str
    version: Any
    version_declared: bool
    version_current: bool
    digest: str

    def to_reply(self) -> dict[str, Any]:
        return attrs.asdict(self, recurse=False)


@attrs.frozen
class Span:
    """Tokens ``first_token``..``last_token`` (inclusive) came from one set of weights: those
    committed as ``version``.  ``version_current`` says whether that label described those
    weights (an update that omits ``weight_version`` keeps the label on new weights: its
    tokens start a new span with ``version_current: false``); ``digest`` is their content
    digest when known; ``epoch`` the fleet epoch the version was committed under (``None``
    outside a fleet).  ``(version, epoch, digest, version_current)`` is the span's
    certificate: a trainer checks it against the fleet's journal
    (:func:`weightsync.fleet.samples.verify_samples`)."""

    version: Any
    version_declared: bool
    first_token: int
    last_token: int
    version_current: bool = False
    digest: str | None = None
    epoch: int | None = None
    adapter: AdapterStamp | None = None
    """The LoRA adapter these tokens ran with (``None``: the base alone, and no key in replies)."""

    def to_reply(self) -> dict[str, Any]:
        # Not recursive: the version value is the caller's JSON, passed on as it is.
        reply = attrs.asdict(self, recurse=False, filter=lambda a, _: a.name != "adapter")
        if self.adapter is not None:
            reply["adapter"] = self.adapter.to_reply()
        return reply


@attrs.frozen
class Completion:
    id: str
    prompt_tokens: int
    token_ids: list[int]
    finish_reason: str
    weight_version: Any
    version_declared: bool
    spans: list[Span]
    cached_tokens: int = 0
    version_current: bool = False
    """Whether ``weight_version`` described the weights that produced the first token (an
    update that omits ``weight_version`` keeps the label on new weights)."""
    logprobs: list[TokenLogprob] | None = None
    """One per generated token, when the request asked for them."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """One per prompt token (the first has none), when the request asked for them."""
    stop_reason: int | str | None = None
    """What ended a ``"stop"``: the stop token id or stop string (``None`` for end-of-sequence)."""
    detokenized: str | None = None
    """The text the engine's own detokenizer made of the tokens (vLLM with a tokenizer), or
    ``None``: then :attr:`text` reads the tokens byte-level."""
    adapter: AdapterStamp | None = None
    """The LoRA adapter the sequence ran with (``None``: the base alone)."""

    @property
    def text(self) -> str:
        """The engine's text of the tokens when it detokenizes, else the tokens byte-level (ids
        below 256 are UTF-8 bytes), a matched stop string left out, as vLLM leaves it out."""
        if self.detokenized is not None:
            return self.detokenized
        raw = bytes(t for t in self.token_ids if t < 256)
        if isinstance(self.stop_reason, str):
            stop = self.stop_reason.encode("utf-8")
            raw = raw[: -len(stop)] if raw.endswith(stop) else raw
        return raw.decode("utf-8", errors="replace")


@attrs.frozen
class Chunk:
    """Tokens a streaming generation produced since its last chunk, stamped like the
    completion they belong to (the version of the weights of its first token)."""

    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    weight_version: Any
    version_declared: bool
    version_current: bool
    text: str | None = None
    """The text these tokens added, by the engine's own detokenizer (``None`` when it has none)."""
    adapter: AdapterStamp | None = None
    """The LoRA adapter the sequence runs with (``None``: the base alone)."""


class VersionStamps:
    """Epochs of served weights and the versions they were committed as."""

    def __init__(self) -> None:
        self.epoch = 0
        self._labels: dict[int, tuple[bool, Any]] = {}
        self._current: dict[int, bool] = {}
        self._digests: dict[int, str | None] = {}
        self._fleet_epochs: dict[int, int | None] = {}
        self.weights_released = False  # the last committed state discarded the weights

    def bump(self) -> None:
        """The served weights changed (an update wrote to them)."""
        self.epoch += 1

    def observe_commit(self, snapshot: Snapshot) -> None:
        self.weights_released = snapshot.weights_released
        if not snapshot.torn:
            self._labels[self.epoch] = (snapshot.version_declared, snapshot.version_value)
            self._current[self.epoch] = snapshot.version_current
            self._digests[self.epoch] = snapshot.digest
            self._fleet_epochs[self.epoch] = snapshot.epoch

    def label(self, epoch: int) -> tuple[bool, Any]:
        return self._labels.get(epoch, (False, None))

    def chunk(
        self,
        first_epoch: int,
        token_ids: list[int],
        logprobs: list[TokenLogprob] | None,
        text: str | None = None,
        adapter: AdapterStamp | None = None,
    ) -> Chunk:
        """A streamed chunk of a completion whose first token came from ``first_epoch`` (with
        ``adapter``, when the sequence runs with one)."""
        declared, version = self.label(first_epoch)
        current = self._current.get(first_epoch, False)
        return Chunk(token_ids, logprobs, version, declared, current, text, adapter)

    def completion(
        self,
        request_id: str,
        prompt_tokens: int,
        token_ids: list[int],
        epochs: list[int],
        finish_reason: str,
        submitted_epoch: int,
        cached_tokens: int = 0,
        adapter: AdapterStamp | None = None,
        **extra: Any,
    ) -> Completion:
        """Build the completion; ``epochs[i]`` is the epoch that produced ``token_ids[i]``;
        ``adapter``: the LoRA adapter it ran with, if any; ``extra``: its logprobs, prompt
        logprobs and stop reason."""
        first = epochs[0] if epochs else submitted_epoch
        declared, version = self.label(first)
        return Completion(
            request_id,
            prompt_tokens,
            list(token_ids),
            finish_reason,
            version,
            declared,
            self.spans(epochs, adapter),
            cached_tokens,
            version_current=self._current.get(first, False),
            adapter=adapter,
            **extra,
        )

    def spans(self, epochs: list[int], adapter: AdapterStamp | None = None) -> list[Span]:
        """The versions of a run of tokens, ``epochs[i]`` the epoch that produced token ``i``:
        one span per stretch of one epoch (an epoch never committed has no version), each
        naming ``adapter`` when the tokens ran with one."""
        spans: list[Span] = []
        for i, e in enumerate(epochs):
            if spans and epochs[i - 1] == e:
                spans[-1] = attrs.evolve(spans[-1], last_token=i)
            else:
                d, v = self.label(e)
                current, digest = self._current.get(e, False), self._digests.get(e)
                spans.append(Span(v, d, i, i, current, digest, self._fleet_epochs.get(e), adapter))
        return spans
