"""The ``generate`` and ``stream`` entry points every engine shares: one signature and the
checks that do not depend on the engine, then the engine's own :meth:`Generating._generate`
and :meth:`Generating._stream`."""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from typing import Any

from weightsync.core.errors import IllegalState, InvalidRequest
from weightsync.engines.sampling import Sampling
from weightsync.engines.stamps import Chunk, Completion, VersionStamps


class Generating(abc.ABC):
    """Base of the engines that generate (the generation routes call :meth:`generate` and
    :meth:`stream`).  An engine honours every field of :class:`Sampling` or refuses the
    request with ``NotSupported`` before generating: a field is never silently ignored.
    While the committed state says the weights were discarded (``stamps`` learns every
    commit), every request is refused: 409 ``weights_released``."""

    stamps: VersionStamps

    async def generate(
        self,
        prompt: list[int],
        *,
        request_id: str | None = None,
        sampling: Sampling | None = None,
        **fields: Any,
    ) -> Completion:
        """Generate after ``prompt`` (token ids) as ``sampling`` says, or a :class:`Sampling`
        built from ``fields`` (its field names: ``max_tokens``, ``temperature``, ``seed``…;
        greedy at temperature 0), stamped with the weight versions that produced the tokens.

        Raises ``InvalidRequest`` for an empty prompt, a request id already in flight, a
        sampling value out of range, and whatever else the engine refuses (see its
        ``_generate``); ``NotSupported`` for a sampling field the engine cannot honour."""
        s = sampling or Sampling(**fields)
        rid = self._admit(prompt, request_id)
        return await self._generate(list(prompt), s, rid)

    def stream(
        self,
        prompt: list[int],
        *,
        request_id: str | None = None,
        sampling: Sampling | None = None,
        **fields: Any,
    ) -> AsyncIterator[Chunk | Completion]:
        """As :meth:`generate`, token by token: :class:`Chunk` values as tokens are produced,
        then the :class:`Completion`.  Closing the iterator early aborts the request.  Every
        refusal of :meth:`generate` is raised by this call, before anything is generated."""
        s = sampling or Sampling(**fields)
        rid = self._admit(prompt, request_id)
        return self._stream(list(prompt), s, rid)

    def _admit(self, prompt: list[int], request_id: str | None) -> str:
        if self.stamps.weights_released:
            raise IllegalState(
                "the weights were discarded (memory released), so this worker holds no version's "
                "weights: load an update, restore the memory and resume first",
                code="weights_released",
            )
        if not prompt:
            raise InvalidRequest("prompt must not be empty", code="invalid_value", field="prompt")
        rid = request_id or self._new_request_id()
        if rid in self.in_flight():
            raise InvalidRequest(f"request id {rid!r} is in flight", code="invalid_value", field="request_id")
        return rid

    @abc.abstractmethod
    async def _generate(self, prompt: list[int], sampling: Sampling, request_id: str) -> Completion:
        """Generate for a non-empty prompt under ``request_id`` (not in flight)."""

    @abc.abstractmethod
    def _stream(
        self, prompt: list[int], sampling: Sampling, request_id: str
    ) -> AsyncIterator[Chunk | Completion]:
        """Stream for a non-empty prompt under ``request_id`` (not in flight); raise any
        refusal on the call, before the first item."""

    @abc.abstractmethod
    def _new_request_id(self) -> str:
        """A fresh id for a request the caller did not name."""

    @abc.abstractmethod
    def in_flight(self) -> list[str]:
        """Ids of the requests not yet finished."""
