"""The ``generate`` entry point every engine shares: one signature and the checks that do not
depend on the engine, then the engine's own :meth:`Generating._generate`."""

from __future__ import annotations

import abc

from weightsync.core.errors import InvalidRequest
from weightsync.engines.stamps import Completion


class Generating(abc.ABC):
    """Base of the engines that generate (the completion route calls :meth:`generate`)."""

    async def generate(
        self,
        prompt: list[int],
        *,
        max_tokens: int = 16,
        temperature: float = 0.0,
        seed: int | None = None,
        request_id: str | None = None,
    ) -> Completion:
        """Generate up to ``max_tokens`` tokens after ``prompt`` (token ids), greedily at
        temperature 0, stamped with the weight versions that produced them.

        Raises ``InvalidRequest`` for an empty prompt, a request id already in flight, and
        whatever else the engine refuses (see its ``_generate``)."""
        if not prompt:
            raise InvalidRequest("prompt must not be empty", code="invalid_value", field="prompt")
        rid = request_id or self._new_request_id()
        if rid in self.in_flight():
            raise InvalidRequest(f"request id {rid!r} is in flight", code="invalid_value", field="request_id")
        return await self._generate(list(prompt), max_tokens, temperature, seed, rid)

    @abc.abstractmethod
    async def _generate(
        self, prompt: list[int], max_tokens: int, temperature: float, seed: int | None, request_id: str
    ) -> Completion:
        """Generate for a non-empty prompt under ``request_id`` (not in flight)."""

    @abc.abstractmethod
    def _new_request_id(self) -> str:
        """A fresh id for a request the caller did not name."""

    @abc.abstractmethod
    def in_flight(self) -> list[str]:
        """Ids of the requests not yet finished."""
