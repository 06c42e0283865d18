"""Logprob truth on the vLLM engine: for the same greedy request and the same weights, a
``weightsync serve --engine vllm`` worker returns exactly the token ids and logprobs (sampled
token and top-k) that vLLM's own OpenAI server returns (issue: "on the vLLM engine, greedy token
ids and logprobs equal what vLLM's own OpenAI server returns for the same request and
weights").  Both run the tiny Llama in float32 on the same CPU kernels; the stated tolerance
(1e-5 absolute) only absorbs a different batch composition, never a different distribution."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.vllm.servers import MEMORY, VllmProcess, vllm_server, vllm_worker
from tests.vllm.tiny_llama import TinyLlamas

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TOLERANCE = 1e-5
PROMPTS = [[1, 17, 42, 99, 7], [200, 3, 3, 3], [5]]


@pytest.fixture(scope="module")
def pair(tiny_llamas: TinyLlamas, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[VllmProcess]]:
    logs = tmp_path_factory.mktemp("truth")
    procs: list[VllmProcess] = []
    try:
        procs.append(
            vllm_server(tiny_llamas.a, "--gpu-memory-utilization", MEMORY, log=logs / "vllm-server.log")
        )
        procs.append(
            vllm_worker(
                tiny_llamas.a, tiny_llamas.root, log=logs / "worker.log",
                vllm_args=[f"gpu_memory_utilization={MEMORY}"],
            )
        )  # fmt: skip
        yield procs
    finally:
        for p in procs:
            p.stop()


def _complete(url: str, prompt: list[int]) -> dict[str, Any]:
    with httpx.Client(base_url=url, timeout=300) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        body = {
            "model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "logprobs": 3,
            "return_token_ids": True, "return_tokens_as_token_ids": True,
        }  # fmt: skip
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        (choice,) = r.json()["choices"]
        return choice  # type: ignore[no-any-return]


def _top(entry: dict[str, float] | None) -> dict[str, float]:
    return dict(entry or {})


def test_greedy_token_ids_and_logprobs_equal_vllms_own_server(pair: list[VllmProcess]) -> None:
    server, worker = pair
    for prompt in PROMPTS:
        theirs, ours = _complete(server.url, prompt), _complete(worker.url, prompt)
        assert ours["token_ids"] == theirs["token_ids"] and len(ours["token_ids"]) == 8, (ours, theirs)
        a, b = theirs["logprobs"], ours["logprobs"]
        assert b["tokens"] == a["tokens"] and all(t.startswith("token_id:") for t in b["tokens"])
        assert len(b["token_logprobs"]) == len(a["token_logprobs"]) == 8
        for x, y in zip(a["token_logprobs"], b["token_logprobs"], strict=True):
            assert abs(x - y) <= TOLERANCE, (a["token_logprobs"], b["token_logprobs"])
        for ta, tb in zip(a["top_logprobs"], b["top_logprobs"], strict=True):
            ta, tb = _top(ta), _top(tb)
            assert set(ta) == set(tb) and len(tb) >= 3, (ta, tb)
            assert all(abs(ta[k] - tb[k]) <= TOLERANCE for k in ta), (ta, tb)
        # Greedy: the sampled token is the top-1 of the distribution it was sampled from.
        for tok, lp, top in zip(b["tokens"], b["token_logprobs"], b["top_logprobs"], strict=True):
            assert abs(max(top.values()) - lp) <= TOLERANCE and top[tok] == lp
