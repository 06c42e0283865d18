"""Version stamps for generated tokens, shared by every engine.

An engine numbers the weights it serves with an *epoch* (bumped whenever weights change)
and stamps each generated token with the epoch that produced it.  The controller tells the
engine, after every commit, which version the current epoch is (``observe_commit``); when a
completion ends its epochs become spans of versions.  An epoch that was never committed
(weights written by an update still in flight, or one that failed) is reported as
``version: null, version_declared: false``: those tokens came from no declared version.
"""

from __future__ import annotations

from typing import Any

import attrs

from weightsync.core.snapshot import Snapshot


@attrs.frozen
class Span:
    version: Any
    version_declared: bool
    first_token: int
    last_token: int

    def to_reply(self) -> dict[str, Any]:
        # Not recursive: the version value is the caller's JSON, passed on as it is.
        return attrs.asdict(self, recurse=False)


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

    @property
    def text(self) -> str:
        return bytes(t for t in self.token_ids if t < 256).decode("utf-8", errors="replace")


class VersionStamps:
    """Epochs of served weights and the versions they were committed as."""

    def __init__(self) -> None:
        self.epoch = 0
        self._labels: dict[int, tuple[bool, Any]] = {}
        self._current: dict[int, bool] = {}

    def bump(self) -> None:
        """The served weights changed (an update wrote to them)."""
        self.epoch += 1

    def observe_commit(self, snapshot: Snapshot) -> None:
        if not snapshot.torn:
            self._labels[self.epoch] = (snapshot.version_declared, snapshot.version_value)
            self._current[self.epoch] = snapshot.version_current

    def label(self, epoch: int) -> tuple[bool, Any]:
        return self._labels.get(epoch, (False, None))

    def completion(
        self,
        request_id: str,
        prompt_tokens: int,
        token_ids: list[int],
        epochs: list[int],
        finish_reason: str,
        submitted_epoch: int,
        cached_tokens: int = 0,
    ) -> Completion:
        """Build the completion; ``epochs[i]`` is the epoch that produced ``token_ids[i]``."""
        first = epochs[0] if epochs else submitted_epoch
        declared, version = self.label(first)
        spans: list[Span] = []
        for i, e in enumerate(epochs):
            if spans and epochs[i - 1] == e:
                spans[-1] = attrs.evolve(spans[-1], last_token=i)
            else:
                d, v = self.label(e)
                spans.append(Span(v, d, i, i))
        return Completion(
            request_id, prompt_tokens, list(token_ids), finish_reason, version, declared, spans, cached_tokens,
            version_current=self._current.get(first, False),
        )  # fmt: skip
