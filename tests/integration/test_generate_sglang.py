"""SGLang's ``/generate`` on a loopback worker: SGLang's shapes (one object, or a list for a
batch or ``n`` > 1), logprobs as ``[logprob, token_id, null]``, the version in ``meta_info``,
cumulative streams ending with ``[DONE]``, and refusals with a code."""

from __future__ import annotations

import itertools
import json
from typing import Any

import httpx
import pytest

from tests.integration.test_generation import LOGPROB_TOL, direct_logprobs
from tests.workers import Worker


def generate(worker: Worker, **body: Any) -> Any:
    reply = httpx.post(f"{worker.url}/generate", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_generate_answers_sglang_shapes_with_logprobs_and_version(worker: Worker) -> None:
    out = generate(worker, text="slime", sampling_params={"max_new_tokens": 5, "temperature": 0})
    assert set(out) == {"text", "output_ids", "meta_info"} and len(out["output_ids"]) == 5
    assert out["meta_info"]["weight_version"] == "default"  # SGLang's word while undeclared
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    worker.client.set_weight_version("w2")
    prompt = list(b"input ids")
    out = generate(worker, input_ids=prompt, return_logprob=True, top_logprobs_num=2, logprob_start_len=0,
                   sampling_params={"max_new_tokens": 6, "temperature": 0.7, "sampling_seed": 1})  # fmt: skip
    meta = out["meta_info"]
    assert meta["weight_version"] == "w2" and meta["weight_version_spans"][0]["version"] == "w2"
    lp = direct_logprobs(worker, prompt + out["output_ids"])
    for i, (value, token, text) in enumerate(meta["output_token_logprobs"]):
        assert token == out["output_ids"][i] and text is None
        assert abs(value - float(lp[len(prompt) + i - 1, token])) < LOGPROB_TOL
        assert [t for _, t, _ in meta["output_top_logprobs"][i]] == lp[len(prompt) + i - 1].topk(
            2
        ).indices.tolist()
    inputs = meta["input_token_logprobs"]
    assert inputs[0] == [None, prompt[0], None] and len(inputs) == len(prompt)
    assert abs(inputs[1][0] - float(lp[0, prompt[1]])) < LOGPROB_TOL


def test_a_batch_or_n_answers_a_list_prompt_major(worker: Worker) -> None:
    out = generate(worker, text=["a", "b"], sampling_params={"max_new_tokens": 2, "n": 2, "sampling_seed": 5})
    assert isinstance(out, list) and len(out) == 4
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [1, 1, 1, 1]


def test_a_generate_stream_is_cumulative_and_ends_with_done(worker: Worker) -> None:
    body = {
        "input_ids": [1, 2, 3],
        "stream": True,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0},
    }
    seen: list[Any] = []
    with httpx.stream("POST", f"{worker.url}/generate", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                seen.append(data if data == "[DONE]" else json.loads(data))
    assert seen[-1] == "[DONE]"
    ids = [e["output_ids"] for e in seen[:-1]]
    assert all(a == b[: len(a)] for a, b in itertools.pairwise(ids))  # each extends the last
    assert seen[-2]["meta_info"]["finish_reason"]["type"] == "length" and len(ids[-1]) == 6
    assert (
        ids[-1]
        == generate(worker, input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 6, "temperature": 0})[
            "output_ids"
        ]
    )


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"text": "x", "input_ids": [1]}, 400, "invalid_value"),
        ({"text": "x", "sampling_params": {"max_tokens": 3}}, 400, "unknown_field"),
        ({"text": "x", "sampling_params": {"frequency_penalty": 0.3}}, 501, "not_supported"),
        ({"text": "x", "lora_path": "adapter"}, 501, "not_supported"),
        ({"text": "x", "sampling_params": {"top_p": 2}}, 400, "invalid_value"),
    ],
)
def test_generate_refuses_with_a_code(worker: Worker, body: dict[str, Any], status: int, code: str) -> None:
    reply = httpx.post(f"{worker.url}/generate", json=body, timeout=30)
    assert (reply.status_code, reply.json()["code"]) == (status, code)
