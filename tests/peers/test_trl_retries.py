"""TRL's retried POSTs against a worker: TRL 1.16's ``VLLMClient`` session retries every POST
three times on 500, 502 and 503 (``trl/generation/vllm_client.py``: urllib3 ``Retry`` with
``status_forcelist=[500, 502, 503]``, ``allowed_methods=["POST", "GET"]``).  An update whose
outcome was a 5xx must not be applied twice or wait a second time in a collective the trainer
feeds once: the retry lands on a 4xx at once."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import requests
import torch

from tests.peers.torch_trainer import PlainTrainer
from tests.peers.vllm_calls import make_vllm_worker

__all__ = ["make_vllm_worker"]


def trl_session(base_url: str) -> requests.Session:
    """TRL's own ``VLLMClient.session`` (its retrying adapter), built as TRL builds it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl.generation.vllm_client import VLLMClient

        return VLLMClient(base_url=base_url).session


def joined(session: requests.Session, url: str, timeout_s: float) -> PlainTrainer:
    trainer = PlainTrainer(2)
    info = {"master_address": "127.0.0.1", "master_port": trainer.port, "rank_offset": 1, "world_size": 2,
            "backend": "gloo", "timeout_s": timeout_s}  # fmt: skip
    with ThreadPoolExecutor(1) as pool:
        joining = pool.submit(session.post, f"{url}/init_weight_transfer_engine", json={"init_info": info})
        trainer.joined()
        assert joining.result(timeout=120).status_code == 200
    return trainer


def test_an_update_the_trainer_never_fed_is_retried_onto_a_4xx(make_vllm_worker: Callable[..., str]) -> None:
    url = make_vllm_worker(dialect="vllm", auto_pause_updates=True)
    session = trl_session(url)
    trainer = joined(session, url, timeout_s=3)
    try:
        assert session.post(f"{url}/start_weight_update", json={}).status_code == 200
        names = {"model.embed_tokens.weight": torch.zeros(1)}
        info = {"names": list(names), "dtype_names": ["float32"], "shapes": [[256, 64]]}
        before = requests.post(f"{url}/engine/get_weight_version", json={}, timeout=30).json()
        t0 = time.monotonic()
        reply = session.post(f"{url}/update_weights", json={"update_info": info})  # no broadcast comes
        took = time.monotonic() - t0
        history: Any = reply.raw.retries.history if reply.raw.retries else ()
        # the first try waited its 3 s for the broadcast and failed (5xx: TRL retries); the group,
        # out of step, was dropped, so the retry is refused at once instead of waiting again
        assert [h.status for h in history] == [500]
        assert reply.status_code == 404 and reply.json()["error"]["type"] == "unknown_group"
        assert took < 3 + 2 + 2 + 10  # one wait for the broadcast, TRL's first back-off (2 s), no second wait
        after = requests.post(f"{url}/engine/get_weight_version", json={}, timeout=30).json()
        assert (after["version"], after["epoch"], after["digest"]) == (
            before["version"],
            before["epoch"],
            before["digest"],
        )
        assert not after[
            "torn"
        ]  # nothing was written: the session stays open, as any refused update leaves it
        done = session.post(f"{url}/finish_weight_update", json={})  # nothing to commit but the same weights
        assert done.status_code == 200 and not (done.raw.retries and done.raw.retries.history)
        assert (
            requests.post(f"{url}/engine/get_weight_version", json={}, timeout=30).json()["digest"]
            == before["digest"]
        )
    finally:
        trainer.close()
