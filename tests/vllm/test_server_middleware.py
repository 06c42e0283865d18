"""weightsync's admin routes inside vLLM's own OpenAI-compatible server (``--middleware``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file

from tests.vllm.servers import vllm_server
from tests.vllm.tiny_llama import TinyLlamas
from weightsync.core.held import weights_digest
from weightsync.trainer import WorkerClient
from weightsync.transports.hashing import tensor_hashes

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def server(tiny_llamas: TinyLlamas) -> Iterator[tuple[str, Path, Path]]:
    root = tiny_llamas.root
    proc = vllm_server(
        tiny_llamas.a,
        "--worker-extension-cls", "weightsync.engines.vllm.worker.WeightSyncExtension",
        "--middleware", "weightsync.engines.vllm.middleware.WeightSyncMiddleware",
        log=root / "middleware-server.log", env={"WEIGHTSYNC_ALLOWED_WEIGHT_DIRS": str(root)},
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
        assert dry["dry_run"] is True and dry["digest"] is None  # an HF checkpoint declares no hashes
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
