"""Chat and ``n`` samples on the vLLM engine, against vLLM's own OpenAI server.

A ``weightsync serve --engine vllm`` worker runs beside vLLM's own server on the same tiny
Llama (float32), both with a byte-level tokenizer and a chat template (a copy of ``a`` under
a name of this module's, in the shared checkpoint root).  For the same request and weights the
worker's chat renders the same prompt, and greedy chat gives the same token ids, text and
logprobs; seeded samples are vLLM's own (``seed + j`` for the ``j``-th), and a prompt's ``n``
samples are one vLLM request, seen in vLLM's own ``vllm:request_params_n`` histogram.
"""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.vllm.servers import MEMORY, VllmProcess, vllm_server, vllm_worker
from tests.vllm.test_server_middleware import Events
from tests.vllm.test_vllm import LONG, Background
from tests.vllm.tiny_llama import TinyLlamas, add_byte_tokenizer
from weightsync.core import errors
from weightsync.trainer import WorkerClient

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TOLERANCE = 1e-5  # as the logprob truth test: a different batch, never a different distribution
VERSION = "chat-v1"
CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count: 1 2 3"}],
]


@pytest.fixture(scope="module")
def pair(tiny_llamas: TinyLlamas, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[VllmProcess]]:
    served = tiny_llamas.root / "a-with-chat-for-samples"  # a's weights, a tokenizer and a template
    if not served.exists():
        shutil.copytree(tiny_llamas.a, served)
        add_byte_tokenizer(served)
    logs = tmp_path_factory.mktemp("chat")
    procs: list[VllmProcess] = []
    try:
        procs.append(
            vllm_server(
                served, "--gpu-memory-utilization", MEMORY, log=logs / "vllm-server.log", tokenizer=True
            )
        )
        procs.append(
            vllm_worker(
                served, tiny_llamas.root, "--initial-version", f'"{VERSION}"', log=logs / "worker.log",
                vllm_args=[f"gpu_memory_utilization={MEMORY}", "skip_tokenizer_init=false"],
            )
        )  # fmt: skip
        yield procs
    finally:
        for p in procs:
            p.stop()


def post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    r = httpx.post(f"{url}{path}", json={"model": model, **body}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def chat(url: str, messages: list[dict[str, str]], **options: Any) -> dict[str, Any]:
    body = {"messages": messages, "max_tokens": 12, "temperature": 0.0, "return_token_ids": True, **options}
    return post(url, "/v1/chat/completions", body)


def same_logprobs(theirs: list[dict[str, Any]], ours: list[dict[str, Any]]) -> None:
    assert [e["token"] for e in ours] == [e["token"] for e in theirs]
    assert [e["bytes"] for e in ours] == [e["bytes"] for e in theirs]
    for a, b in zip(theirs, ours, strict=True):
        assert abs(a["logprob"] - b["logprob"]) <= TOLERANCE, (a, b)
        assert [t["token"] for t in b["top_logprobs"]] == [t["token"] for t in a["top_logprobs"]], (a, b)
        for x, y in zip(a["top_logprobs"], b["top_logprobs"], strict=True):
            assert abs(x["logprob"] - y["logprob"]) <= TOLERANCE, (a, b)


def test_greedy_chat_equals_vllms_own_server(pair: list[VllmProcess]) -> None:
    server, worker = pair
    for messages in CONVERSATIONS:
        for spelled in (False, True):
            options = {"logprobs": True, "top_logprobs": 3, "return_tokens_as_token_ids": spelled}
            theirs, ours = chat(server.url, messages, **options), chat(worker.url, messages, **options)
            (a,), (b,) = theirs["choices"], ours["choices"]
            # the same prompt: the model's template, rendered and tokenized as vLLM's chat route does
            assert ours["prompt_token_ids"] == theirs["prompt_token_ids"]
            assert ours["usage"]["prompt_tokens"] == theirs["usage"]["prompt_tokens"]
            assert b["token_ids"] == a["token_ids"] and b["token_ids"], (a, b)
            assert b["message"] == {"role": "assistant", "content": a["message"]["content"]}
            assert (b["finish_reason"], b["stop_reason"]) == (a["finish_reason"], a["stop_reason"])
            same_logprobs(a["logprobs"]["content"], b["logprobs"]["content"])


def test_chat_replies_carry_the_weight_version_of_every_token(pair: list[VllmProcess]) -> None:
    _, worker = pair
    reply = chat(worker.url, CONVERSATIONS[0], n=2, temperature=1.0, seed=3)
    assert len(reply["choices"]) == 2
    for body in (reply, *reply["choices"]):
        assert (body["weight_version"], body["weight_version_declared"], body["weight_version_current"]) == (
            VERSION, True, True,
        )  # fmt: skip
    for choice in reply["choices"]:
        last = len(choice["token_ids"]) - 1
        assert [{k: v for k, v in s.items() if k != "digest"} for s in choice["weight_version_spans"]] == [
            {
                "version": VERSION,
                "version_declared": True,
                "first_token": 0,
                "last_token": last,
                "version_current": True,
                "epoch": None,  # no fleet: no fleet epoch
            }
        ]


def test_a_streamed_chat_is_the_whole_reply_in_pieces_and_ends_with_done(pair: list[VllmProcess]) -> None:
    _, worker = pair
    whole = chat(worker.url, CONVERSATIONS[1])["choices"][0]
    body = {"messages": CONVERSATIONS[1], "max_tokens": 12, "temperature": 0.0, "return_token_ids": True}
    events = Events(worker.url, "/v1/chat/completions", body).read().events  # read() ends at [DONE]
    assert all(e["object"] == "chat.completion.chunk" and e["weight_version"] == VERSION for e in events)
    deltas = [e["choices"][0] for e in events]
    assert deltas[0]["delta"]["role"] == "assistant"
    assert "".join(d["delta"].get("content", "") for d in deltas) == whole["message"]["content"]
    assert [t for d in deltas for t in d.get("token_ids") or []] == whole["token_ids"]
    assert deltas[-1]["finish_reason"] == whole["finish_reason"]
    assert deltas[-1]["weight_version_spans"] == whole["weight_version_spans"]


def test_seeded_chat_samples_are_vllms_own_and_reproduce(pair: list[VllmProcess]) -> None:
    server, worker = pair
    options = {"n": 3, "temperature": 1.0, "seed": 1234, "max_tokens": 16}
    theirs = [c["token_ids"] for c in chat(server.url, CONVERSATIONS[0], **options)["choices"]]
    ours = [c["token_ids"] for c in chat(worker.url, CONVERSATIONS[0], **options)["choices"]]
    again = [c["token_ids"] for c in chat(worker.url, CONVERSATIONS[0], **options)["choices"]]
    assert ours == theirs == again
    assert len({tuple(t) for t in ours}) == 3  # each sample its own seed


def test_seeded_completion_samples_are_vllms_own_and_reproduce(pair: list[VllmProcess]) -> None:
    server, worker = pair
    body = {"prompt": [1, 17, 42, 99, 7], "n": 4, "temperature": 1.0, "seed": 7, "max_tokens": 16, "logprobs": 1,
            "return_token_ids": True, "return_tokens_as_token_ids": True}  # fmt: skip
    theirs, ours = post(server.url, "/v1/completions", body), post(worker.url, "/v1/completions", body)
    assert [c["token_ids"] for c in ours["choices"]] == [c["token_ids"] for c in theirs["choices"]]
    for a, b in zip(theirs["choices"], ours["choices"], strict=True):
        for x, y in zip(a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"], strict=True):
            assert abs(x - y) <= TOLERANCE
    again = post(worker.url, "/v1/completions", body)
    assert [c["token_ids"] for c in again["choices"]] == [c["token_ids"] for c in ours["choices"]]


def series(url: str, name: str) -> float:
    """The sum of a series' samples on ``url``'s ``/metrics`` (0 when absent)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


def test_n_samples_are_one_vllm_request(pair: list[VllmProcess]) -> None:
    """vLLM observes ``n`` once per request it was given (``vllm:request_params_n``): n samples
    submitted as n requests would be n observations of 1."""
    _, worker = pair
    count, total = (
        series(worker.url, "vllm:request_params_n_count"),
        series(worker.url, "vllm:request_params_n_sum"),
    )
    reply = post(
        worker.url, "/v1/completions", {"prompt": [5, 6, 7], "n": 5, "temperature": 1.0, "max_tokens": 8}
    )
    assert len(reply["choices"]) == 5
    deadline = time.monotonic() + 30  # vLLM records its stats right after the outputs
    while series(worker.url, "vllm:request_params_n_count") == count:
        assert time.monotonic() < deadline, "vLLM never recorded the request"
        time.sleep(0.05)
    assert series(worker.url, "vllm:request_params_n_count") == count + 1
    assert series(worker.url, "vllm:request_params_n_sum") == total + 5


def test_greedy_samples_are_the_greedy_sequence(pair: list[VllmProcess]) -> None:
    """vLLM refuses ``n > 1`` greedy; the worker answers it, every sample the greedy sequence."""
    _, worker = pair
    body = {"prompt": [3, 1, 4, 1, 5], "max_tokens": 12, "temperature": 0.0, "logprobs": 1}
    (one,) = post(worker.url, "/v1/completions", body)["choices"]
    three = post(worker.url, "/v1/completions", {**body, "n": 3})["choices"]
    assert [c["token_ids"] for c in three] == [one["token_ids"]] * 3
    assert all(c["logprobs"]["token_logprobs"] == one["logprobs"]["token_logprobs"] for c in three)


@pytest.mark.parametrize("temperature", [1.0, 0.0], ids=["sampled", "greedy"])
def test_one_sample_aborts_alone(pair: list[VllmProcess], temperature: float) -> None:
    _, worker = pair
    with WorkerClient(worker.url) as client:
        job = Background(
            client, [9, 9, 9], LONG, n=2, temperature=temperature, ignore_eos=True, request_id="pair"
        )
        client.abort_request("pair-0")
        out = job.join()
        first, second = out["choices"]
        assert first["finish_reason"] == "abort" and len(first["token_ids"]) < LONG
        assert second["finish_reason"] == "length" and len(second["token_ids"]) == LONG
        with pytest.raises(errors.NotFound):
            client.abort_request("pair-0")


def test_a_prompt_vllm_refuses_is_a_bad_request(pair: list[VllmProcess]) -> None:
    _, worker = pair
    model = httpx.get(f"{worker.url}/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": [5] * 600, "max_tokens": 4, "n": 2, "temperature": 1.0}
    r = httpx.post(f"{worker.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["code"] == "invalid_value", r.text


def test_a_reader_leaving_a_stream_frees_every_sample(pair: list[VllmProcess]) -> None:
    _, worker = pair
    body = {"prompt": [4, 4, 4], "n": 3, "temperature": 1.0, "ignore_eos": True, "max_tokens": LONG,
            "return_token_ids": True}  # fmt: skip
    stream = Events(worker.url, "/v1/completions", body).read(tokens=2)
    deadline = time.monotonic() + 30
    while series(worker.url, "vllm:num_requests_running") != 3:  # the three samples run
        assert time.monotonic() < deadline, "the samples never ran together"
        time.sleep(0.05)
    stream.close()  # the reader leaves
    while (
        series(worker.url, "vllm:num_requests_running")
        or httpx.get(f"{worker.url}/health").json()["in_flight"]
    ):
        assert time.monotonic() < deadline, "samples kept running after their reader left"
        time.sleep(0.05)


def test_stop_strings_end_the_text_as_on_vllms_own_server(pair: list[VllmProcess]) -> None:
    server = pair[0]
    text = chat(server.url, CONVERSATIONS[0], max_tokens=24)["choices"][0]["message"]["content"]
    pieces = (text[i : i + 2] for i in range(2, len(text) - 2))
    stop = next((p for p in pieces if p.isascii() and p.isprintable()), None)
    assert stop is not None, f"no stop string to take from {text!r}"
    theirs, ours = (chat(p.url, CONVERSATIONS[0], max_tokens=24, stop=[stop])["choices"][0] for p in pair)
    assert ours["message"]["content"] == theirs["message"]["content"] != text
    assert (
        (ours["finish_reason"], ours["stop_reason"])
        == ("stop", stop)
        == (theirs["finish_reason"], theirs["stop_reason"])
    )


def test_a_text_completion_equals_vllms_own_server(pair: list[VllmProcess]) -> None:
    server, worker = pair
    body = {
        "prompt": "Once upon",
        "max_tokens": 10,
        "temperature": 0.0,
        "logprobs": 2,
        "return_token_ids": True,
    }
    (a,), (b,) = (
        post(server.url, "/v1/completions", body)["choices"],
        post(worker.url, "/v1/completions", body)["choices"],
    )
    assert (b["prompt_token_ids"], b["token_ids"], b["text"]) == (
        a["prompt_token_ids"],
        a["token_ids"],
        a["text"],
    )
    x, y = a["logprobs"], b["logprobs"]
    assert (y["tokens"], y["text_offset"]) == (x["tokens"], x["text_offset"])
    assert all(abs(p - q) <= TOLERANCE for p, q in zip(x["token_logprobs"], y["token_logprobs"], strict=True))
