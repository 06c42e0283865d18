"""vLLM's own HTTP tests of its RL routes (vLLM 0.32), replayed against a weightsync worker.

Each test names the vLLM test it replays: its requests (through vLLM's conftest helpers, in
``tests/peers/vllm_calls.py``) and its assertions, unchanged unless the docstring says how
weightsync differs and why.  The worker is a reference engine served with ``--dialect vllm``
(vLLM's keys only: vLLM's tests compare ``/weight_info`` exactly) and, for the
weight-transfer protocol, ``--auto-pause-updates`` (vLLM starts an update on a serving
engine).  The pause modes' effect on running requests and ``clear_cache`` (vLLM's
``state_transitions/test_pause_resume.py`` checks them streaming with ``ignore_eos`` and
reading logprobs and ``usage.prompt_tokens_details.cached_tokens``) are re-expressed here with
this project's helpers below, on a worker large enough that a request stays in flight.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests

from tests.peers.vllm_calls import (
    finish_weight_update,
    gen,
    get_world_size,
    health,
    is_paused,
    make_vllm_worker,
    ok,
    pause,
    resume,
    start_weight_update,
    update_weight_version_response,
    weight_checker,
    weight_info_response,
)
from weightsync.engines.reference import ModelConfig

__all__ = ["make_vllm_worker"]

Make = Callable[..., str]

# ---------------------------------------------------------------- info_retrieval/test_weight_info.py


def test_a_fresh_worker_reports_vllms_default_weight_info(make_vllm_worker: Make) -> None:
    """vLLM ``tests/entrypoints/serve/dev/rlhf/info_retrieval/test_weight_info.py``,
    ``TestWeightInfoEndpoint.test_initial_schema``."""
    url = make_vllm_worker(dialect="vllm")
    assert weight_info_response(url).json() == {"weight_version": "default"}


def test_version_reads_and_updates_do_not_change_generation(make_vllm_worker: Make) -> None:
    """The same file, ``TestWeightInfoEndpoint.test_does_not_affect_generation``."""
    url = make_vllm_worker(dialect="vllm")
    before = gen(url)
    assert ok(before)
    update_weight_version_response(url, "generation-check").raise_for_status()
    info = weight_info_response(url)
    info.raise_for_status()
    assert info.json() == {"weight_version": "generation-check"}
    after = gen(url)
    assert ok(after)
    assert after["choices"][0]["text"] == before["choices"][0]["text"]


def test_an_updated_version_is_visible_at_once(make_vllm_worker: Make) -> None:
    """The same file, ``TestUpdateWeightVersion.test_update_is_visible``."""
    url = make_vllm_worker(dialect="vllm")
    response = update_weight_version_response(url, "step-42")
    assert response.status_code == 200
    assert response.json() == {"success": True, "new_version": "step-42"}
    info_response = weight_info_response(url)
    assert info_response.status_code == 200
    assert info_response.json() == {"weight_version": "step-42"}


def test_a_later_version_overwrites_the_earlier(make_vllm_worker: Make) -> None:
    """The same file, ``TestUpdateWeightVersion.test_version_can_be_overwritten``."""
    url = make_vllm_worker(dialect="vllm")
    for version in ("step-1", "checkpoint/final"):
        response = update_weight_version_response(url, version)
        assert response.status_code == 200
        assert response.json() == {"success": True, "new_version": version}
    assert weight_info_response(url).json() == {"weight_version": "checkpoint/final"}


@pytest.mark.parametrize("dialect", ["vllm", None])
@pytest.mark.parametrize(
    "payload",
    [
        pytest.param({}, id="missing-version"),
        pytest.param({"weight_version": "wrong-field"}, id="wrong-field"),
        pytest.param({"new_version": ["not", "a", "string"]}, id="wrong-type"),
    ],
)
def test_an_invalid_version_update_is_400_at_body_new_version_and_changes_nothing(
    make_vllm_worker: Make, payload: dict[str, Any], dialect: str | None
) -> None:
    """The same file, ``TestUpdateWeightVersion.test_invalid_update_preserves_state``; on the
    default worker too (both dialects), where ``/weight_info`` adds weightsync's fields."""
    url = make_vllm_worker(dialect=dialect)
    update_weight_version_response(url, "stable").raise_for_status()
    response = requests.post(f"{url}/update_weight_version", json=payload, timeout=5)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "body.new_version"
    assert weight_info_response(url).json()["weight_version"] == "stable"
    if dialect == "vllm":
        assert weight_info_response(url).json() == {"weight_version": "stable"}


# ---------------------------------------------------------------- state_transitions/test_pause_resume.py


def test_pause_and_resume_are_idempotent_in_every_mode(make_vllm_worker: Make) -> None:
    """vLLM ``tests/entrypoints/serve/dev/rlhf/state_transitions/test_pause_resume.py`` (and
    ``tests/entrypoints/rl/state_transitions/test_pause_resume.py``),
    ``TestPauseResume.test_state_and_idempotency_across_cycles``."""
    url = make_vllm_worker(dialect="vllm")
    assert not is_paused(url)
    assert resume(url) == 200
    assert resume(url) == 200
    assert not is_paused(url)
    for _ in range(2):
        for mode in ("abort", "wait", "keep"):
            assert pause(url, mode=mode) == 200
            assert pause(url, mode=mode) == 200
            assert is_paused(url)
            assert resume(url) == 200
            assert resume(url) == 200
            assert not is_paused(url)


def test_an_invalid_pause_mode_is_400_at_query_mode_and_keeps_the_state(make_vllm_worker: Make) -> None:
    """The same files, ``TestPauseResume.test_invalid_mode_preserves_state``."""
    url = make_vllm_worker()
    for paused in (False, True):
        if paused:
            assert pause(url) == 200
        assert is_paused(url) is paused
        response = requests.post(f"{url}/pause", params={"mode": "invalid"}, timeout=10)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "query.mode"
        assert is_paused(url) is paused
        assert resume(url) == 200


# ---------------------------------------------------------------- the same file: modes and clear_cache

PACED = ModelConfig()  # the default size: ~100 tokens/s per request here, so a stream stays in flight
PROMPT = "Pause me mid-rollout, then let me go on."
LOGPROB_TOL = 1e-4


class Stream:
    """A greedy streamed completion with ``ignore_eos``, its logprobs and token ids, read event
    by event (``stream_options.include_usage``: the last event before ``[DONE]`` has usage)."""

    def __init__(self, url: str, max_tokens: int, prompt: str = PROMPT) -> None:
        body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "logprobs": 1, "return_token_ids": True, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        self.response = requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=60)
        assert self.response.status_code == 200, self.response.text
        self._lines: Iterator[bytes] = self.response.iter_lines()
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.done = False

    def read(self, tokens: int | None = None) -> Stream:
        """Read events until at least ``tokens`` tokens came (all of them, to ``[DONE]``, when
        ``None``)."""
        while not self.done and (tokens is None or len(self.token_ids) < tokens):
            line = next(self._lines)
            if not line:
                continue
            assert line.startswith(b"data: "), line
            if line == b"data: [DONE]":
                self.done = True
                break
            event = json.loads(line[6:])
            assert "error" not in event, event
            if event.get("usage"):
                self.usage = event["usage"]
            for choice in event["choices"]:
                self.token_ids += choice.get("token_ids") or []
                if choice["logprobs"] is not None:
                    self.logprobs += choice["logprobs"]["token_logprobs"]
                self.finish_reason = choice["finish_reason"] or self.finish_reason
        return self


def finished(url: str, reason: str) -> float:
    """How many completions the worker finished with ``reason`` (its ``/metrics``)."""
    text = requests.get(f"{url}/metrics", timeout=5).text
    found = re.search(rf'^weightsync_completions_total{{finish_reason="{reason}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def cached_tokens(url: str, prompt: str) -> int:
    """``usage.prompt_tokens_details.cached_tokens`` of a short greedy completion of ``prompt``."""
    response = requests.post(
        f"{url}/v1/completions",
        json={"model": "m", "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True},
        timeout=30,
    )
    response.raise_for_status()
    return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_pause_abort_ends_a_running_stream_with_abort(make_vllm_worker: Make) -> None:
    """vLLM's ``test_pause_resume.py`` mode lifecycle, ``abort``: a running request ends at
    once with ``finish_reason: "abort"`` (its tokens so far, each with its logprob), the worker
    is paused until resumed, and then serves again."""
    url = make_vllm_worker(dialect="vllm", config=PACED)
    stream = Stream(url, max_tokens=200).read(tokens=3)
    assert pause(url, mode="abort") == 200
    assert is_paused(url)
    stream.read()
    assert stream.finish_reason == "abort"
    assert 3 <= len(stream.token_ids) < 200 and len(stream.logprobs) == len(stream.token_ids)
    assert stream.usage is not None and stream.usage["completion_tokens"] == len(stream.token_ids)
    assert resume(url) == 200
    assert not is_paused(url)
    assert ok(gen(url))


def test_pause_wait_lets_a_running_stream_finish(make_vllm_worker: Make) -> None:
    """The same file, ``wait``: the pause answers once the running request finished, which it
    does normally (every token, ``finish_reason: "length"``), then the worker is paused."""
    url = make_vllm_worker(dialect="vllm", config=PACED)
    stream = Stream(url, max_tokens=60).read(tokens=3)
    assert pause(url, mode="wait") == 200
    assert is_paused(url)
    stream.read()
    assert stream.finish_reason == "length"
    assert len(stream.token_ids) == len(stream.logprobs) == 60
    assert resume(url) == 200
    assert ok(gen(url))


def test_pause_keep_holds_a_running_stream_and_resume_finishes_it_unchanged(make_vllm_worker: Make) -> None:
    """The same file, ``keep``: the running request is held, neither finished nor aborted,
    while the worker is paused, and after ``resume`` it finishes as if never paused: the same
    greedy tokens, with the same logprobs, as an uninterrupted run of the same request."""
    url = make_vllm_worker(dialect="vllm", config=PACED)
    stream = Stream(url, max_tokens=200).read(tokens=3)
    assert pause(url, mode="keep") == 200
    assert is_paused(url)
    assert finished(url, "length") == 0 and finished(url, "abort") == 0, "keep did not hold the request"
    assert resume(url) == 200
    stream.read()
    assert stream.finish_reason == "length" and len(stream.token_ids) == 200
    straight = Stream(url, max_tokens=200).read()
    assert straight.token_ids == stream.token_ids
    assert all(
        math.isfinite(a) and abs(a - b) < LOGPROB_TOL
        for a, b in zip(stream.logprobs, straight.logprobs, strict=True)
    )


@pytest.mark.parametrize("mode", ["abort", "wait"])
def test_vllm_0_33_pause_refuses_new_requests_with_503_until_resume(
    make_vllm_worker: Make, mode: str
) -> None:
    """vLLM 0.33's ``POST /pause`` (``vllm/entrypoints/rl/online/api_router.py``): "In abort
    and wait modes new requests are rejected with HTTP 503 until /resume"
    (``EngineCore._reject_add_while_paused``, a ``RetryableRequestError``); nothing reaches the
    engine, and after ``/resume`` the same request is served."""
    url = make_vllm_worker(dialect="vllm")
    assert pause(url, mode=mode) == 200
    refused = requests.post(
        f"{url}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2}, timeout=30
    )
    assert refused.status_code == 503 and refused.json()["code"] == "engine_paused"
    assert "retry" in refused.json()["message"]
    chat = requests.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": [{"role": "user",
                         "content": "hi"}], "max_tokens": 2}, timeout=30)  # fmt: skip
    assert chat.status_code == 503
    assert finished(url, "length") == 0 and finished(url, "abort") == 0  # nothing reached the engine
    assert is_paused(url)
    assert resume(url) == 200
    assert ok(gen(url))


def test_vllm_0_33_pause_keep_still_queues_and_0_32_queues_in_every_mode(make_vllm_worker: Make) -> None:
    """``keep`` still accepts and queues new requests on 0.33; ``serve --vllm-version 0.32``
    mirrors 0.32, where every mode queues them until ``/resume``."""
    for url, mode in ((make_vllm_worker(dialect="vllm"), "keep"),
                      (make_vllm_worker(dialect="vllm", vllm_version="0.32"), "abort")):  # fmt: skip
        assert pause(url, mode=mode) == 200
        with ThreadPoolExecutor(1) as pool:
            queued = pool.submit(gen, url)
            time.sleep(0.5)
            assert not queued.done(), mode  # held while paused
            assert resume(url) == 200
            assert ok(queued.result(timeout=60))


def test_clear_cache_on_pause_empties_the_prefix_cache_and_keep_ignores_it(make_vllm_worker: Make) -> None:
    """The same file, ``clear_cache``: a repeated prompt is served from the prefix cache
    (``usage.prompt_tokens_details.cached_tokens`` > 0, streamed or not) until a pause with
    ``clear_cache=true`` (vLLM's default) empties it; ``clear_cache=false`` keeps it, and so
    does mode ``keep``, where vLLM ignores ``clear_cache`` (kept requests hold the cache)."""
    url = make_vllm_worker(dialect="vllm")
    prompt = "A prompt long enough to fill two blocks of the prefix cache."
    assert cached_tokens(url, prompt) == 0
    warm = cached_tokens(url, prompt)
    assert warm > 0
    streamed = Stream(url, max_tokens=2, prompt=prompt).read()
    assert streamed.usage is not None and streamed.usage["prompt_tokens_details"]["cached_tokens"] == warm
    for mode, clear, left in (
        ("wait", False, warm),
        ("keep", True, warm),
        ("abort", True, 0),
        ("wait", True, 0),
    ):
        cached_tokens(url, prompt)  # cached again, whatever the last round left
        assert pause(url, mode=mode, clear_cache=clear) == 200
        assert resume(url) == 200
        assert cached_tokens(url, prompt) == left, (mode, clear)


# ---------------------------------------------------------------- test_weight_update.py


@pytest.fixture
def protocol_url(make_vllm_worker: Make) -> str:
    """vLLM's module server, with its ``restore_unpaused_state`` (resume before each test)."""
    url = make_vllm_worker(dialect="vllm", auto_pause_updates=True)
    assert resume(url) == 200
    return url


def test_start_and_finish_without_tensors_leave_a_serving_worker(protocol_url: str) -> None:
    """vLLM ``tests/entrypoints/serve/dev/rlhf/test_weight_update.py``,
    ``TestWeightTransferProtocol.test_start_finish_no_tensors_engine_survives``: with a transfer
    engine configured (a worker always has one) the start succeeds, here on a serving worker
    that pauses for it and serves again after the finish."""
    url = protocol_url
    response = start_weight_update(url)
    assert response.status_code in (200, 500), response.text
    assert response.status_code == 200 and is_paused(url)  # paused for the update
    response = finish_weight_update(url)
    assert response.status_code == 200, response.text
    assert not is_paused(url)
    assert health(url) == 200
    assert ok(gen(url))


def test_the_world_size_is_a_positive_integer(protocol_url: str) -> None:
    """The same file, ``TestWeightTransferProtocol.test_get_world_size_positive``."""
    response = get_world_size(protocol_url)
    assert response.status_code == 200
    world_size = response.json()["world_size"]
    assert isinstance(world_size, int) and world_size >= 1


def test_a_finish_without_a_start_is_refused_and_the_worker_serves_on(protocol_url: str) -> None:
    """The same file, ``TestWeightTransferProtocol.test_finish_without_start_handled`` and
    ``TestWeightUpdateProtocolErrors.test_finish_without_start_returns_error_and_engine_survives``
    (409 ``no_session``)."""
    response = finish_weight_update(protocol_url)
    assert response.status_code in (400, 409, 500), response.text
    assert response.json()["error"]["type"] == "no_session"
    assert health(protocol_url) == 200
    assert ok(gen(protocol_url))


def test_generation_works_after_a_finish(protocol_url: str) -> None:
    """The same file, ``TestWeightTransferProtocol.test_prefix_cache_flushed_after_finish``."""
    prompt = "The capital of France is"
    assert ok(gen(protocol_url, prompt=prompt))
    start_weight_update(protocol_url)
    finish_weight_update(protocol_url)
    assert ok(gen(protocol_url, prompt=prompt))


def test_update_weights_without_a_start_is_refused(protocol_url: str) -> None:
    """The same file, ``TestWeightUpdateProtocolErrors.test_update_weights_without_start_returns_error``
    (vLLM's body, its ``name``/``dtype``/``shape`` fields included: 400 ``unknown_field``)."""
    response = requests.post(
        f"{protocol_url}/update_weights",
        json={"update_info": {"name": "dummy", "dtype": "float32", "shape": [1]}},
        timeout=10,
    )
    assert response.status_code in (400, 409, 500)
    assert health(protocol_url) == 200
    assert ok(gen(protocol_url))


def test_a_start_on_a_serving_worker_without_auto_pause_is_409_and_changes_nothing(
    make_vllm_worker: Make,
) -> None:
    """The same file, ``TestWeightUpdateProtocolErrors.test_start_without_init_returns_error_and_engine_survives``:
    the status and the survival as vLLM's test checks them; the reason differs.  vLLM refuses
    a start when no transfer engine is configured (its message names the configuration); a
    worker always has one, and refuses a start on a serving worker (``not_paused``), naming
    ``--auto-pause-updates``."""
    url = make_vllm_worker(dialect="vllm")
    response = start_weight_update(url)
    assert response.status_code in (400, 409, 500)
    error = response.json()["error"]
    assert error["type"] == "not_paused" and "--auto-pause-updates" in error["message"]
    assert not is_paused(url)
    assert health(url) == 200
    assert ok(gen(url))


# ---------------------------------------------------------------- rl/state_transitions/test_weight_checker.py


@pytest.mark.parametrize("payload", [{}, {"action": "frobnicate"}, {"action": "compare"}, [], None])
def test_an_invalid_weight_checker_request_is_400(make_vllm_worker: Make, payload: Any) -> None:
    """vLLM ``tests/entrypoints/rl/state_transitions/test_weight_checker.py``,
    ``TestSingleGPU.test_invalid_request_returns_400``."""
    url = make_vllm_worker()
    response = requests.post(f"{url}/weight_checker", json=payload, timeout=10)
    assert response.status_code == 400, response.text
    assert health(url) == 200


def test_checksums_are_stable_and_compare_names_the_changed_and_the_missing(make_vllm_worker: Make) -> None:
    """The same file, ``TestSingleGPU.test_checksum_is_stable_and_compare_reports_differences``.
    One difference: a checksum is weightsync's xxh3-64 of the tensor (16 hex digits, what the
    digest is built from), where vLLM's test expects 64."""
    url = make_vllm_worker()
    baseline = weight_checker(url, "checksum").json()["checksums"]
    assert all(len(digest) == 16 and int(digest, 16) >= 0 for digest in baseline.values())
    assert weight_checker(url, "checksum").json()["checksums"] == baseline
    changed, missing, *_ = baseline
    altered = {**baseline, changed: "0" * 16}
    del altered[missing]
    assert weight_checker(url, "compare", altered).json() == {
        "match": False,
        "mismatches": sorted([changed, missing]),
    }


def test_a_weight_reset_is_refused(make_vllm_worker: Make) -> None:
    """The same file, ``TestSingleGPU.test_reset_changes_weights_and_reload_restores_them``:
    refused by design (501 ``not_supported``), since weights changed outside an update would
    leave the version label and digest describing other weights; nothing changes."""
    url = make_vllm_worker()
    baseline = weight_checker(url, "checksum").json()["checksums"]
    response = weight_checker(url, "reset")
    assert response.status_code == 501 and response.json()["error"]["type"] == "not_supported"
    assert weight_checker(url, "compare", baseline).json() == {"match": True, "mismatches": []}
