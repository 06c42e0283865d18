"""weightsync's admin routes inside vLLM's own OpenAI-compatible server (``--middleware``), and
its version stamps on vLLM's own completions.

The server serves tiny Llama ``a`` with a byte-level tokenizer and a chat template beside it
(a copy of ``a`` in the directory updates load from), so vLLM's chat route works too.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from safetensors.torch import load_file

from tests.vllm.servers import vllm_server
from tests.vllm.tiny_llama import TinyLlamas, add_byte_tokenizer
from weightsync.core.held import weights_digest
from weightsync.trainer import WorkerClient
from weightsync.transports.hashing import tensor_hashes

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def server(tiny_llamas: TinyLlamas) -> Iterator[tuple[str, Path, Path]]:
    root = tiny_llamas.root
    served = root / "a-chat"  # the same weights as a, with a tokenizer
    if not served.exists():
        shutil.copytree(tiny_llamas.a, served)
        add_byte_tokenizer(served)
    proc = vllm_server(
        served,
        "--worker-extension-cls", "weightsync.engines.vllm.worker.WeightSyncExtension",
        "--middleware", "weightsync.engines.vllm.middleware.WeightSyncMiddleware",
        log=root / "middleware-server.log", env={"WEIGHTSYNC_ALLOWED_WEIGHT_DIRS": str(root)}, tokenizer=True,
    )  # fmt: skip
    try:
        yield proc.url, tiny_llamas.a, tiny_llamas.b
    finally:
        proc.stop()


def vllm_completion(url: str, prompt: list[int] | None = None, **options: object) -> list[int]:
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    reply = httpx.post(
        f"{url}/v1/completions",
        json={
            "model": model,
            "prompt": prompt or [1, 2, 3, 4, 5],
            "max_tokens": 12,
            "temperature": 0,
            "return_token_ids": True,
            **options,
        },
        timeout=60,
    )
    reply.raise_for_status()
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    return choice["token_ids"] or []


def digest_of(model: Path) -> str:
    return weights_digest(tensor_hashes(load_file(str(model / "model.safetensors")).items()))


def test_admin_routes_drive_vllms_own_server(server: tuple[str, Path, Path]) -> None:
    url, a, b = server
    models = httpx.get(f"{url}/v1/models").json()
    assert models["data"]  # vLLM's own API is untouched
    before = vllm_completion(url)
    with WorkerClient(url) as c:
        fresh = c.get_weight_version()
        assert fresh["version_declared"] is False and fresh["digest"] == digest_of(a)
        assert "model.embed_tokens.weight" in c.weight_info()["names"]
        c.pause_generation("wait")
        dry = c.update_weights_from_disk(str(b), weight_version="b", dry_run=True)
        # an HF checkpoint declares no hashes: the dry run reads its bytes and says what a load holds
        assert dry["dry_run"] is True and dry["digest"] == digest_of(b)
        after_dry = c.get_weight_version()
        assert (after_dry["version_declared"], after_dry["digest"], after_dry["torn"]) == (
            False,
            fresh["digest"],
            False,
        )
        reply = c.update_weights_from_disk(str(b), weight_version="b")
        assert reply["version"] == "b" and reply["prefix_cache_reset"] is True
        assert reply["digest"] == digest_of(b)
        c.resume_generation()
        state = c.get_weight_version()
        assert state["version"] == "b" and not state["paused"] and state["digest"] == digest_of(b)
        verified = c.verify_weights()
        assert verified["match"] is True and verified["scope"] == "loaded_hashes"
        reply = httpx.post(f"{url}/engine/no_such_route", json={})
        assert reply.status_code == 404 and reply.json()["code"] == "unknown_route"
    after = vllm_completion(url)
    assert after != before


LONG_PROMPT = list(range(100, 400))  # two full 128-token cache blocks on CPU


def test_completions_through_vllms_server_never_reuse_kv_of_other_weights(
    server: tuple[str, Path, Path],
) -> None:
    url, a, _ = server
    old = vllm_completion(url, LONG_PROMPT)  # caches KV of the weights served now
    with WorkerClient(url) as c:
        reply = c.update_weights_from_disk(
            str(a), weight_version="a-unpaused", allow_unpaused=True, reset_prefix_cache=False
        )
        assert reply["prefix_cache_reset"] is False
        new = vllm_completion(url, LONG_PROMPT)
        c.flush_cache()  # nothing cached at all: what these weights compute from scratch
        clean = vllm_completion(url, LONG_PROMPT)
    assert new == clean and new != old
    # A caller's own salt still partitions the cache, and a salt vLLM refuses is still refused.
    assert vllm_completion(url, LONG_PROMPT, cache_salt="tenant-1") == clean
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    bad = httpx.post(
        f"{url}/v1/completions", json={"model": model, "prompt": [1, 2], "cache_salt": "a/b"}, timeout=60
    )
    assert bad.status_code == 400 and "cache_salt" in bad.text


# ---------------------------------------------------------------- stamps on vLLM's own completions

HEADER = "x-weightsync-weight-version"


def span(version: Any, first: int, last: int) -> dict[str, Any]:
    """A span as the worker stamps it outside a fleet: no fleet epoch."""
    return {
        "version": version,
        "version_declared": True,
        "first_token": first,
        "last_token": last,
        "epoch": None,
    }


def without_digest(spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Spans as :func:`span` writes them: the digest (checked apart) and ``version_current`` left out."""
    return [{k: v for k, v in s.items() if k not in ("digest", "version_current")} for s in spans]


def stamped(body: dict[str, Any], version: Any) -> bool:
    return (body["weight_version"], body["weight_version_declared"], body["weight_version_current"]) == (
        version,
        True,
        True,
    )


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    reply = httpx.post(f"{url}{path}", json={"model": model, **body}, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply


def wait_running(url: str, count: int, timeout: float = 60) -> None:
    """Wait until vLLM's scheduler runs ``count`` requests (its ``/metrics``)."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(f"{url}/metrics", timeout=5).text
        running = [float(x) for x in re.findall(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.M)]
        if running and sum(running) >= count:
            return
        assert time.monotonic() < deadline, "the request never ran"
        time.sleep(0.05)


class Events:
    """A streamed reply of vLLM's, read event by event (``data: {...}`` up to ``[DONE]``)."""

    def __init__(self, url: str, path: str, body: dict[str, Any]) -> None:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        self._cm = httpx.stream(
            "POST", f"{url}{path}", json={"model": model, "stream": True, **body}, timeout=120
        )
        self.response = self._cm.__enter__()
        assert self.response.status_code == 200, self.response.read()
        self._lines = self.response.iter_lines()
        self.events: list[dict[str, Any]] = []
        self.tokens: dict[int, int] = {}  # choice index -> tokens so far (their token ids)

    def read(self, tokens: int | None = None) -> Events:
        """Events until choice 0 has ``tokens`` tokens (to ``[DONE]`` when ``None``)."""
        for line in self._lines:
            if not line:
                continue
            if line == "data: [DONE]":
                self._cm.__exit__(None, None, None)
                return self
            event = json.loads(line.removeprefix("data: "))
            assert "error" not in event, event
            self.events.append(event)
            for choice in event["choices"]:
                self.tokens[choice["index"]] = self.tokens.get(choice["index"], 0) + len(
                    choice.get("token_ids") or []
                )
            if tokens is not None and self.tokens.get(0, 0) >= tokens:
                return self
        raise AssertionError("the stream ended without [DONE]")

    def close(self) -> None:
        """Leave the stream (the connection closes)."""
        self._cm.__exit__(None, None, None)

    def finishing(self, index: int) -> dict[str, Any]:
        (choice,) = [
            c for e in self.events for c in e["choices"] if c["index"] == index and c.get("finish_reason")
        ]
        return choice


COMPLETION = {"prompt": [7, 8, 9, 10], "max_tokens": 8, "temperature": 1.0, "seed": 3, "n": 2, "logprobs": 1,
              "ignore_eos": True, "return_token_ids": True}  # fmt: skip
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "temperature": 1.0, "seed": 3,
        "n": 2, "logprobs": True, "top_logprobs": 1, "ignore_eos": True, "return_token_ids": True}  # fmt: skip


def test_vllms_completions_and_chat_carry_the_worker_stamps_whole_and_streamed(
    server: tuple[str, Path, Path],
) -> None:
    url, _, _ = server
    with WorkerClient(url) as c:
        c.set_weight_version({"step": 7})
        assert c.get_weight_version()["version_current"] is True
    version = {"step": 7}
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        reply = post(url, path, body)
        assert reply.headers[HEADER] == '{"step":7}'
        whole = reply.json()
        assert len(whole["choices"]) == 2 and stamped(whole, version), whole
        assert whole["weight_version_spans"] == whole["choices"][0]["weight_version_spans"]
        for choice in whole["choices"]:
            count = len(choice["token_ids"])
            assert count == 8 and stamped(choice, version)
            assert without_digest(choice["weight_version_spans"]) == [span(version, 0, count - 1)]

        stream = Events(url, path, {**body, "stream_options": {"include_usage": True}}).read()
        assert stream.response.headers[HEADER] == '{"step":7}'
        assert all(stamped(e, version) for e in stream.events), stream.events  # every event
        for index in (0, 1):
            assert stream.tokens[index] == 8
            assert without_digest(stream.finishing(index)["weight_version_spans"]) == [span(version, 0, 7)]
        usage = stream.events[-1]
        assert usage["choices"] == [] and without_digest(usage["weight_version_spans"]) == [
            span(version, 0, 7)
        ]


def test_an_update_under_a_kept_request_splits_its_spans_whole_and_streamed(
    server: tuple[str, Path, Path],
) -> None:
    """A request kept by a pause, updated under and resumed: the tokens before the pause came
    from the old version, the rest from the new, as vLLM's engine core labelled its steps;
    for a reply that came whole too, where no output showed the server where the update fell."""
    url, _, b = server
    long = {
        "prompt": [11, 12, 13],
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    whole: dict[str, Any] = {}
    with WorkerClient(url) as c:
        c.set_weight_version("old")
        thread = threading.Thread(target=lambda: whole.update(post(url, "/v1/completions", long).json()))
        thread.start()
        wait_running(url, 1)  # the whole one runs before the stream starts
        stream = Events(url, "/v1/completions", long).read(tokens=3)  # both are running now
        c.pause_generation("keep")
        c.update_weights_from_disk(str(b), weight_version="new")
        c.resume_generation()
        stream.read()
        thread.join(120)
    assert not thread.is_alive()
    spans = stream.finishing(0)["weight_version_spans"]
    assert [s["version"] for s in spans] == ["old", "new"], spans
    assert spans[0]["first_token"] == 0 and spans[0]["last_token"] >= 2
    assert without_digest(spans[1:]) == [span("new", spans[0]["last_token"] + 1, 399)]
    assert all(e["weight_version"] == "old" for e in stream.events)  # the first token's version
    (choice,) = whole["choices"]
    assert len(choice["token_ids"]) == 400
    assert [s["version"] for s in choice["weight_version_spans"]] == ["old", "new"], choice
    assert choice["weight_version_spans"][1]["last_token"] == 399
    assert whole["weight_version"] == "old" and whole["weight_version_current"] is True
