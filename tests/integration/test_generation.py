"""Rollout-grade generation on a loopback worker over the reference engine: logprobs that are
the model's, sampling fields that each change what they should (and nothing else), chat,
batches, and streams that carry the version stamps and free their request when the client
leaves.

Distribution tests draw with fixed seeds (not flaky) and enough samples for the stated
tolerance: 256 draws, total-variation distance to the expected distribution below 0.15 (the
expected distance at that size is about 0.05).
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import torch

from tests.integration.test_http import PACED, checkpoint, wait_until
from tests.workers import Worker

LOGPROB_TOL = 1e-4
"""Logprobs served vs a direct forward: float32 through a KV cache vs without one."""
PROMPT = "Rollouts need logprobs:"


def complete(worker: Worker, path: str = "/v1/completions", **body: Any) -> dict[str, Any]:
    reply = httpx.post(f"{worker.url}{path}", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def events(worker: Worker, into: list[Any] | None = None, **body: Any) -> list[Any]:
    """Every ``data:`` event of a stream, ``[DONE]`` as the string (appended to ``into`` as
    they arrive)."""
    out: list[Any] = [] if into is None else into
    with httpx.stream("POST", f"{worker.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


def direct_logprobs(worker: Worker, tokens: list[int]) -> torch.Tensor:
    """``log_softmax`` of a forward of ``tokens`` without the cache, by the served weights: [T, V]."""
    with torch.no_grad():
        return torch.log_softmax(worker.engine.model.forward_full(torch.tensor([tokens]))[0].float(), -1)


def first_token_probs(worker: Worker, temperature: float) -> torch.Tensor:
    lp = direct_logprobs(worker, list(PROMPT.encode()))[-1].double()
    return torch.softmax(lp / temperature, -1)


def draws(worker: Worker, **body: Any) -> list[int]:
    """256 first tokens sampled after ``PROMPT`` (two requests of n=128, fixed seeds)."""
    out = []
    for seed in (1, 1000):
        reply = complete(worker, prompt=PROMPT, max_tokens=1, n=128, seed=seed, **body)
        out += [c["token_ids"][0] for c in reply["choices"]]
    return out


def total_variation(sample: list[int], expected: torch.Tensor) -> float:
    counts = Counter(sample)
    return 0.5 * sum(abs(counts.get(t, 0) / len(sample) - float(p)) for t, p in enumerate(expected))


# ----------------------------------------------------------------------------- logprobs


def test_every_returned_logprob_is_log_softmax_of_a_direct_forward(worker: Worker) -> None:
    prompt = list(PROMPT.encode())
    reply = complete(worker, prompt=prompt, max_tokens=12, temperature=1.0, seed=3, logprobs=3, prompt_logprobs=2,
                     return_tokens_as_token_ids=True)  # fmt: skip
    choice = reply["choices"][0]
    out = choice["token_ids"]
    lp = direct_logprobs(worker, prompt + out)
    got = choice["logprobs"]
    assert got["tokens"] == [f"token_id:{t}" for t in out]
    for i, t in enumerate(out):
        row = lp[len(prompt) + i - 1]
        assert abs(got["token_logprobs"][i] - float(row[t])) < LOGPROB_TOL
        top = {int(k.removeprefix("token_id:")): v for k, v in got["top_logprobs"][i].items()}
        best = torch.topk(row, 3).indices.tolist()
        assert set(best) | {t} == set(top)
        for token, value in top.items():
            assert abs(value - float(row[token])) < LOGPROB_TOL
    prompt_lps = choice["prompt_logprobs"]
    assert prompt_lps[0] is None and len(prompt_lps) == len(prompt)
    for i in range(1, len(prompt)):
        mine = prompt_lps[i][str(prompt[i])]
        assert abs(mine["logprob"] - float(lp[i - 1, prompt[i]])) < LOGPROB_TOL
        assert mine["rank"] == 1 + int((lp[i - 1] > lp[i - 1, prompt[i]]).sum())


def test_logprobs_zero_reports_the_sampled_token_only(worker: Worker) -> None:
    choice = complete(worker, prompt=PROMPT, max_tokens=4, logprobs=0)["choices"][0]
    assert [len(t) for t in choice["logprobs"]["top_logprobs"]] == [1, 1, 1, 1]
    assert complete(worker, prompt=PROMPT, max_tokens=4)["choices"][0]["logprobs"] is None


# ----------------------------------------------------------------------------- sampling fields


def test_top_k_draws_only_from_the_k_most_likely_in_proportion(worker: Worker) -> None:
    p = first_token_probs(worker, 1.0)
    top = torch.topk(p, 3).indices
    expected = torch.zeros_like(p)
    expected[top] = p[top] / p[top].sum()
    sample = draws(worker, temperature=1.0, top_k=3)
    assert set(sample) <= set(top.tolist())
    assert total_variation(sample, expected) < 0.15
    assert draws(worker, temperature=1.0, top_k=256) == draws(
        worker, temperature=1.0
    )  # no cut: nothing changes


def test_top_p_draws_only_from_the_nucleus_in_proportion(worker: Worker) -> None:
    p = first_token_probs(worker, 0.05)
    ordered, order = torch.sort(p, descending=True)
    keep = order[(torch.cumsum(ordered, 0) - ordered) < 0.5]
    expected = torch.zeros_like(p)
    expected[keep] = p[keep] / p[keep].sum()
    sample = draws(worker, temperature=0.05, top_p=0.5)
    assert set(sample) <= set(keep.tolist())
    assert total_variation(sample, expected) < 0.15
    assert not set(draws(worker, temperature=0.05)) <= set(keep.tolist())  # without it, others come


def test_min_p_one_and_top_k_one_are_greedy(worker: Worker) -> None:
    greedy = complete(worker, prompt=PROMPT, max_tokens=10)["choices"][0]["token_ids"]
    for cut in ({"min_p": 1.0}, {"top_k": 1}):
        out = complete(worker, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=5, **cut)
        assert out["choices"][0]["token_ids"] == greedy, cut


def test_seed_reproduces_and_n_seeds_each_sample_apart(worker: Worker) -> None:
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 1.0}
    many = [c["token_ids"] for c in complete(worker, n=4, seed=11, **body)["choices"]]
    assert len(many) == 4 and len({tuple(t) for t in many}) == 4
    for j, tokens in enumerate(many):  # the j-th of n samples is the seed + j sample
        assert complete(worker, seed=11 + j, **body)["choices"][0]["token_ids"] == tokens
    assert complete(worker, seed=12, **body)["choices"][0]["token_ids"] != many[0]


def test_a_batch_of_prompts_answers_prompt_major_choices(worker: Worker) -> None:
    reply = complete(worker, prompt=["first", [1, 2, 3]], n=2, max_tokens=3, return_token_ids=True)
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2, 3]
    assert [c["prompt_token_ids"] for c in reply["choices"]] == [list(b"first")] * 2 + [[1, 2, 3]] * 2
    assert reply["usage"]["prompt_tokens"] == 8 and reply["usage"]["completion_tokens"] == 12


SEEDED = {"prompt": [10, 20, 30], "max_tokens": 20, "temperature": 1.0, "seed": 2}


def test_stop_strings_and_stop_token_ids_end_generation_where_they_should(worker: Worker) -> None:
    tokens = complete(worker, **SEEDED)["choices"][0]["token_ids"]
    at = next(i for i in range(3, 20) if tokens[i] < 128 and tokens[i] not in tokens[:i])
    stopped = complete(worker, **SEEDED, stop_token_ids=[tokens[at]])["choices"][0]
    assert stopped["token_ids"] == tokens[: at + 1]
    assert (stopped["finish_reason"], stopped["stop_reason"]) == ("stop", tokens[at])
    stop = chr(tokens[at])
    text = complete(worker, **SEEDED, stop=[stop])["choices"][0]
    assert text["token_ids"] == tokens[: at + 1] and text["stop_reason"] == stop
    assert text["text"] == bytes(tokens[:at]).decode("utf-8", errors="replace")  # the stop string left out


def test_repetition_penalty_steers_away_from_seen_tokens(worker: Worker) -> None:
    prompt = [10, 20, 30]
    plain = complete(worker, prompt=prompt, max_tokens=30)["choices"][0]["token_ids"]
    assert len(set(plain)) < len(plain)  # the tiny model repeats itself greedily
    out = complete(worker, prompt=prompt, max_tokens=30, repetition_penalty=50.0)["choices"][0]["token_ids"]
    assert len(set(out)) == len(out) and not set(out) & set(prompt)


# ----------------------------------------------------------------------------- chat and refusals


def test_chat_renders_the_template_and_answers_a_message(worker: Worker) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    reply = complete(worker, "/v1/chat/completions", messages=messages, max_tokens=5, logprobs=True,
                     top_logprobs=2, return_token_ids=True)  # fmt: skip
    choice = reply["choices"][0]
    template = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert choice["prompt_token_ids"] == list(template.encode())
    assert reply["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
    assert [len(e["top_logprobs"]) for e in choice["logprobs"]["content"]] == [2] * 5
    same = complete(worker, prompt=template, max_tokens=5)["choices"][0]
    assert choice["token_ids"] == same["token_ids"]


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"prompt": "x", "best_of_all": 2}, 400, "unknown_field"),
        ({"prompt": "x", "echo": True}, 501, "not_supported"),
        ({"prompt": "x", "frequency_penalty": 0.5}, 501, "not_supported"),
        ({"prompt": "x", "top_p": 0}, 400, "invalid_value"),
        ({"prompt": "x", "logprobs": 21}, 400, "invalid_value"),
        ({"prompt": "x", "stream_options": {"continuous_usage_stats": True}}, 501, "not_supported"),
    ],
)
def test_fields_refused_with_a_code(worker: Worker, body: dict[str, Any], status: int, code: str) -> None:
    reply = httpx.post(f"{worker.url}/v1/completions", json=body, timeout=30)
    assert (reply.status_code, reply.json()["code"]) == (status, code)
    assert complete(worker, prompt="x", echo=False, frequency_penalty=0, max_tokens=1)  # neutral values pass


# ----------------------------------------------------------------------------- streams


def test_a_stream_ends_with_done_and_stamps_every_event(worker: Worker) -> None:
    worker.client.set_weight_version("v1")
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": 4, "logprobs": 1}
    got = events(worker, **body, stream_options={"include_usage": True})
    assert got[-1] == "[DONE]"
    chunks = got[:-1]
    assert all(c["weight_version"] == "v1" and c["weight_version_current"] is True for c in chunks)
    finishing = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finishing) == 1 and finishing[0]["choices"][0]["weight_version_spans"] == [
        {"version": "v1", "version_declared": True, "first_token": 0, "last_token": 11, "version_current": True,
         "digest": worker.client.get_weight_version()["digest"], "epoch": None}  # no fleet: no epoch
    ]  # fmt: skip
    whole = complete(worker, **body)["choices"][0]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole["text"]
    streamed_lps = [v for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                    for v in c["choices"][0]["logprobs"]["token_logprobs"]]  # fmt: skip
    # (the second run reuses the prompt's cached K/V: equal within float32 noise)
    assert streamed_lps == pytest.approx(whole["logprobs"]["token_logprobs"], abs=LOGPROB_TOL)
    assert chunks[-1]["usage"]["completion_tokens"] == 12


def test_a_stream_never_shows_its_stop_string(worker: Worker) -> None:
    tokens = complete(worker, **SEEDED)["choices"][0]["token_ids"]
    at = next(i for i in range(3, 19) if tokens[i] < 128 and tokens[i + 1] < 128 and bytes(tokens[i : i + 2])
              not in bytes(tokens[: i + 1]))  # fmt: skip
    stop = bytes(tokens[at : at + 2]).decode()
    got = events(worker, **SEEDED, stop=stop)
    text = "".join(c["choices"][0]["text"] for c in got[:-1] if c["choices"])
    assert text == bytes(tokens[:at]).decode("utf-8", errors="replace")


def test_a_stream_across_an_unpaused_update_carries_two_spans_covering_it(
    make_worker: Callable[..., Worker],
) -> None:
    worker = make_worker(PACED)
    worker.client.set_weight_version("old")
    ckpt = checkpoint(worker, "new")
    got: list[Any] = []
    reader = threading.Thread(
        target=events, args=(worker, got), kwargs={"prompt": "async rl", "max_tokens": 150}
    )
    reader.start()
    wait_until(lambda: len(got) > 10)
    worker.client.update_weights_from_disk(str(ckpt), weight_version="new", allow_unpaused=True)
    reader.join(60)
    assert got[-1] == "[DONE]"
    chunks = [c for c in got[:-1] if c["choices"]]
    assert all(c["weight_version"] == "old" for c in chunks)  # the completion's version: its first token's
    spans = chunks[-1]["choices"][0]["weight_version_spans"]
    assert [s["version"] for s in spans] == ["old", "new"]
    assert spans[0]["first_token"] == 0 and spans[1]["first_token"] == spans[0]["last_token"] + 1
    assert spans[1]["last_token"] == 149


def test_a_client_leaving_a_stream_frees_its_request(worker: Worker) -> None:
    worker.client.pause_generation("keep")  # no token will be written: only the disconnect can free it
    with httpx.stream("POST", f"{worker.url}/v1/completions", timeout=30,
                      json={"prompt": "leaving", "max_tokens": 50, "stream": True}) as r:  # fmt: skip
        assert r.status_code == 200
        wait_until(lambda: len(worker.engine.in_flight()) == 1)
    wait_until(lambda: not worker.engine.in_flight(), timeout=5)
    worker.client.resume_generation()
