"""TRL's own ``VLLMClient`` (the installed trl package, ``trl/generation/vllm_client.py``)
generating from a real ``weightsync serve`` worker, and a slime-style ``/generate`` call.

``VLLMClient.__init__`` checks ``/health`` and reads the model id from ``/v1/models``;
``generate`` posts ``/v1/completions`` with ``n``, ``repetition_penalty``, ``temperature``,
``top_p``, ``top_k``, ``min_p``, ``max_tokens``, ``logprobs``, ``return_token_ids`` and
``return_tokens_as_token_ids``, and reads back ``prompt_token_ids``, ``token_ids`` and the
logprobs spelled ``"token_id:N"``.  The logprobs it parses are checked against a direct
forward of the same seeded weights (the worker serves ``--model-config tiny`` unchanged).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import requests
import torch

from tests.helpers import TINY, WorkerProcess
from weightsync.engines.reference.model import CausalLM

LOGPROB_TOL = 1e-4

pytestmark = pytest.mark.slow


def vllm_client(base_url: str) -> Any:
    """TRL's ``VLLMClient(base_url=...)``, constructed as TRL constructs it."""
    with warnings.catch_warnings():  # trl warns (on import and construction) that vLLM is newer than it knows
        warnings.simplefilter("ignore")
        from trl.generation.vllm_client import VLLMClient

        return VLLMClient(base_url=base_url)


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    proc = WorkerProcess("--model-config", "tiny").wait_ready()
    try:
        yield proc
    finally:
        proc.stop()


def direct_logprobs(tokens: list[int]) -> torch.Tensor:
    """``log_softmax`` of a forward of ``tokens`` by the seeded tiny weights: [T, V]."""
    with torch.no_grad():
        return torch.log_softmax(CausalLM(TINY, slots=1).forward_full(torch.tensor([tokens]))[0].float(), -1)


def test_trl_vllm_client_generates_with_logprobs_from_a_worker(worker: WorkerProcess) -> None:
    client = vllm_client(worker.url)
    assert client.model == "reference"
    prompts = ["GRPO wants", "several samples"]
    out = client.generate(prompts, n=3, temperature=1.0, top_p=0.95, top_k=50, max_tokens=6, logprobs=2,
                          generation_kwargs={"seed": 7})  # fmt: skip
    assert out["prompt_ids"] == [list(p.encode()) for p in prompts]
    assert len(out["completion_ids"]) == 6 and all(len(c) == 6 for c in out["completion_ids"])
    assert len({tuple(c) for c in out["completion_ids"][:3]}) > 1  # n samples of one prompt differ
    for k, completion in enumerate(out["completion_ids"]):
        lp = direct_logprobs(out["prompt_ids"][k // 3] + completion)
        start = len(out["prompt_ids"][k // 3])
        for i, token in enumerate(completion):
            ids, values = out["logprob_token_ids"][k][i], out["logprobs"][k][i]
            assert token in ids and len(ids) in (2, 3)  # the sampled token, with the top 2
            for t, v in zip(ids, values, strict=True):
                assert abs(v - float(lp[start + i - 1, t])) < LOGPROB_TOL


def test_slime_style_generate_returns_logprobs_and_the_version(worker: WorkerProcess) -> None:
    requests.post(f"{worker.url}/engine/set_weight_version", json={"weight_version": "step-3"}, timeout=30)
    prompt = list(b"slime rolls out")
    reply = requests.post(f"{worker.url}/generate", timeout=60, json={
        "input_ids": prompt, "return_logprob": True,
        "sampling_params": {"temperature": 1.0, "max_new_tokens": 8, "top_p": 1.0, "sampling_seed": 3},
    })  # fmt: skip
    assert reply.status_code == 200, reply.text
    body = reply.json()
    meta = body["meta_info"]
    assert meta["weight_version"] == "step-3" and meta["finish_reason"]["type"] == "length"
    assert [t for _, t, _ in meta["output_token_logprobs"]] == body["output_ids"]
    lp = direct_logprobs(prompt + body["output_ids"])
    for i, (value, token, _) in enumerate(meta["output_token_logprobs"]):
        assert abs(value - float(lp[len(prompt) + i - 1, token])) < LOGPROB_TOL


def test_trl_sequence_logprobs_need_max_logprobs_as_on_vllm_and_equal_a_direct_forward() -> None:
    """TRL 1.16's ``VLLMClient.get_sequence_logprobs`` (teacher logprobs for distillation) asks
    for ``prompt_logprobs`` of its default ``top_logprobs=100``: a worker caps at 20 as vLLM does
    (400 ``invalid_value``, nothing generated) unless served with ``--max-logprobs``, vLLM's flag;
    then TRL's parsed top-100 and actual-token logprobs are those of a direct forward."""
    capped = WorkerProcess("--model-config", "tiny").wait_ready()
    try:
        with pytest.raises(Exception, match="Request failed: 400") as refused:  # TRL's _post raises so
            vllm_client(capped.url).get_sequence_logprobs([[5, 6, 7, 8]], [2])
        assert '"code":"invalid_value"' in str(refused.value) and "--max-logprobs" in str(refused.value)
    finally:
        capped.stop()
    roomy = WorkerProcess("--model-config", "tiny", "--max-logprobs", "100").wait_ready()
    try:
        sequence = [72, 105, 33, 9, 50, 51]
        out = vllm_client(roomy.url).get_sequence_logprobs([sequence], [2], temperature=1.0)
    finally:
        roomy.stop()
    lp = direct_logprobs(sequence)
    assert len(out["logprobs"][0]) == len(sequence) - 2
    for i, position in enumerate(range(2, len(sequence))):
        top = lp[position - 1].topk(100)
        assert out["logprob_token_ids"][0][i] == top.indices.tolist()
        assert (
            max(abs(a - b) for a, b in zip(out["logprobs"][0][i], top.values.tolist(), strict=True))
            < LOGPROB_TOL
        )
        actual = float(lp[position - 1, sequence[position]])
        assert abs(out["actual_logprobs"][0][i][0] - actual) < LOGPROB_TOL
