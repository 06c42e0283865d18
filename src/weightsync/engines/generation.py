"""The ``generate`` and ``stream`` entry points every engine shares: one signature and the
checks that do not depend on the engine, then the engine's own :meth:`Generating._generate`
and :meth:`Generating._stream` (with a LoRA adapter, :meth:`Generating._generate_with` and
:meth:`Generating._stream_with`, which an engine serving adapters provides)."""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from typing import Any

from weightsync.core.errors import IllegalState, InvalidRequest, NotSupported
from weightsync.engines.sampling import Sampling
from weightsync.engines.stamps import Chunk, Completion, VersionStamps


class Generating(abc.ABC):
    """Base of the engines that generate (the generation routes call :meth:`generate` and
    :meth:`stream`).  An engine honours every field of :class:`Sampling` or refuses the
    request with ``NotSupported`` before generating: a field is never silently ignored.
    While the committed state says the weights were discarded (``stamps`` learns every
    commit), every request is refused: 409 ``weights_released``."""

    name: str
    stamps: VersionStamps

    async def generate(
        self,
        prompt: list[int],
        *,
        request_id: str | None = None,
        sampling: Sampling | None = None,
        lora: str | None = None,
        **fields: Any,
    ) -> Completion:
        """Generate after ``prompt`` (token ids) as ``sampling`` says, or a :class:`Sampling`
        built from ``fields`` (its field names: ``max_tokens``, ``temperature``, ``seed``…;
        greedy at temperature 0), with the LoRA adapter loaded as ``lora`` (none: the base
        alone), stamped with the weight versions (and adapter version) that produced the tokens.

        Raises ``InvalidRequest`` for an empty prompt, a request id already in flight, a
        sampling value out of range, and whatever else the engine refuses (see its
        ``_generate``); ``NotSupported`` for a sampling field the engine cannot honour, or an
        adapter on an engine that serves none; ``NotFound`` (``adapter_not_found``) for an
        adapter that is not loaded."""
        s = sampling or Sampling(**fields)
        rid = self._admit(prompt, request_id)
        if lora is not None:
            return await self._generate_with(list(prompt), s, rid, lora)
        return await self._generate(list(prompt), s, rid)

    def stream(
        self,
        prompt: list[int],
        *,
        request_id: str | None = None,
        sampling: Sampling | None = None,
        lora: str | None = None,
        **fields: Any,
    ) -> AsyncIterator[Chunk | Completion]:
        """As :meth:`generate`, token by token: :class:`Chunk` values as tokens are produced,
        then the :class:`Completion`.  Closing the iterator early aborts the request.  Every
        refusal of :meth:`generate` is raised by this call, before anything is generated."""
        s = sampling or Sampling(**fields)
        rid = self._admit(prompt, request_id)
        if lora is not None:
            return self._stream_with(list(prompt), s, rid, lora)
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

    async def _generate_with(
        self, prompt: list[int], sampling: Sampling, request_id: str, lora: str
    ) -> Completion:
        """As :meth:`_generate`, with the adapter loaded as ``lora``; ``NotSupported`` here."""
        raise self._no_adapters()

    def _stream_with(
        self, prompt: list[int], sampling: Sampling, request_id: str, lora: str
    ) -> AsyncIterator[Chunk | Completion]:
        """As :meth:`_stream`, with the adapter loaded as ``lora``; ``NotSupported`` here."""
        raise self._no_adapters()

    def _no_adapters(self) -> NotSupported:
        return NotSupported(
            f"engine {self.name!r} serves no LoRA adapters", code="not_supported", field="model"
        )

    @abc.abstractmethod
    def _new_request_id(self) -> str:
        """A fresh id for a request the caller did not name."""

    @abc.abstractmethod
    def in_flight(self) -> list[str]:
        """Ids of the requests not yet finished."""
