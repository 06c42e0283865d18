"""What the vLLM engine's generation answers when vLLM turns a request away: a request vLLM
refuses is 400, one its admission limits turn away is 503 (as on vLLM's own server), and
every sample of it is finished, so nothing waits on it.  ``generate`` here raises vLLM's own
exception classes where ``AsyncLLM.generate`` would."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from vllm.exceptions import MaxQueuedTokensError, QueueOverflowError, VLLMClientError

from weightsync.core.errors import EngineUnavailable, InvalidRequest, WeightSyncError
from weightsync.engines.sampling import Sampling
from weightsync.engines.stamps import VersionStamps
from weightsync.engines.vllm.generation import Sample, run

pytestmark = pytest.mark.unit


def _refused(exc: Exception) -> tuple[WeightSyncError, list[Sample]]:
    async def generate(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise exc
        yield  # an async generator, as AsyncLLM.generate is

    samples = [Sample(f"r-{i}", "ws-1", i, 2, 3, 0) for i in range(2)]

    async def drain() -> None:
        s = Sampling(max_tokens=4, temperature=1.0, seed=1)
        async for _ in run(generate, VersionStamps(), [1, 2, 3], s, samples, "salt", False):
            pass

    with pytest.raises(WeightSyncError) as caught:
        asyncio.run(drain())
    return caught.value, samples


@pytest.mark.parametrize("exc", [QueueOverflowError(), MaxQueuedTokensError()])
def test_a_request_vllms_admission_limits_turn_away_is_503_engine_busy(exc: Exception) -> None:
    error, samples = _refused(exc)
    assert isinstance(error, EngineUnavailable) and (error.http_status, error.code) == (503, "engine_busy")
    assert all(s.done for s in samples)


def test_a_request_vllm_refuses_is_400_invalid_value() -> None:
    error, samples = _refused(VLLMClientError("prompt longer than max_model_len"))
    assert isinstance(error, InvalidRequest) and (error.http_status, error.code) == (400, "invalid_value")
    assert all(s.done for s in samples)


class _Llm:
    """``AsyncLLM``'s two calls ``InFlight`` makes: ``generate`` (held until released, then
    ending without output) and ``abort``; each records the vLLM request id it was given."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.generated: list[str] = []
        self.aborted: list[str] = []

    async def generate(self, inputs: Any, params: Any, request_id: str) -> AsyncIterator[Any]:
        self.generated.append(request_id)
        await self.release.wait()
        return
        yield

    async def abort(self, request_id: str, internal: bool = False) -> None:
        self.aborted.append(request_id)


def test_a_second_request_under_an_id_in_flight_is_refused_and_the_first_runs_on() -> None:
    """Two requests admitted under one id before either ran: the second is refused at its
    first step, and the first keeps its id (it used to be popped by the second's end, and an
    abort of either reached both)."""
    from weightsync.engines.vllm.generation import InFlight

    async def scene() -> None:
        llm = _Llm()
        inflight = InFlight(llm, VersionStamps(), lambda epoch, user: f"salt-{epoch}")
        s = Sampling(max_tokens=4, temperature=1.0, seed=1)
        first = inflight.run(llm.generate, [1, 2], s, ["mine"], False)
        second = inflight.run(llm.generate, [1, 2], s, ["mine"], False)
        task = asyncio.ensure_future(first.__anext__())
        await asyncio.sleep(0)
        while not llm.generated:
            await asyncio.sleep(0.01)
        with pytest.raises(InvalidRequest) as refused:
            await second.__anext__()
        assert refused.value.code == "invalid_value"
        assert inflight.ids() == ["mine"] and len(llm.generated) == 1 and llm.aborted == []
        llm.release.set()
        index, item = await task  # the first ends (no output: its sample is aborted)
        assert index == 0 and item.finish_reason == "abort"
        await first.aclose()
        assert inflight.ids() == []

    asyncio.run(scene())


def test_vllm_is_given_a_request_id_of_its_own_never_the_clients() -> None:
    """vLLM lets external ids repeat and aborts every request under one: a client naming its
    request after another's vLLM id must not reach it, so no client id is ever vLLM's."""
    from weightsync.engines.vllm.generation import InFlight

    async def scene() -> list[str]:
        llm = _Llm()
        llm.release.set()
        inflight = InFlight(llm, VersionStamps(), lambda epoch, user: f"salt-{epoch}")
        s = Sampling(max_tokens=4, temperature=1.0, seed=1)
        for rids in (["ws-0"], ["a", "b"], ["ws-0"]):
            async for _ in inflight.run(llm.generate, [1, 2], s, rids, False):
                pass
        return llm.generated

    ids = asyncio.run(scene())
    assert len(set(ids)) == 3 and not {"ws-0", "a", "b"} & set(ids)
