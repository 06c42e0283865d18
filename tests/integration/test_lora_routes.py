"""vLLM's LoRA routes on a real worker (``serve --max-loras``): loads and unloads in vLLM's
reply shapes, ``model`` choosing an adapter (a name no adapter has is refused, never served
by the base), replies and spans naming the adapter's version, the cap, and a version in use
kept to the end of its requests."""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.helpers import TINY
from tests.workers import Worker
from weightsync.engines.reference import ReferenceEngine
from weightsync.lora.names import tensor_name
from weightsync.trainer import adapter_digest, save_adapter

TARGETS = ["q_proj", "v_proj", "down_proj"]
CONFIG: dict[str, Any] = {"r": 4, "lora_alpha": 8, "target_modules": TARGETS}
PROMPT = [5, 6, 7, 8, 9, 10]


def lora_tensors(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for module, (fan_in, fan_out) in ReferenceEngine(TINY).model.linear_modules().items():
        if module.rsplit(".", 1)[-1] in TARGETS:
            out[tensor_name(module, "A")] = torch.randn(4, fan_in, generator=gen) / math.sqrt(fan_in)
            out[tensor_name(module, "B")] = torch.randn(fan_out, 4, generator=gen)
    return out


def adapter(worker: Worker, name: str, seed: int, version: Any = None) -> str:
    return str(save_adapter(lora_tensors(seed), CONFIG, worker.root / name, version=version))


def load(worker: Worker, **body: Any) -> httpx.Response:
    return httpx.post(f"{worker.url}/v1/load_lora_adapter", json=body, timeout=60)


def unload(worker: Worker, name: str) -> httpx.Response:
    return httpx.post(f"{worker.url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)


def complete(worker: Worker, model: str | None = None, **extra: Any) -> httpx.Response:
    body = {
        "prompt": PROMPT,
        "max_tokens": 8,
        "temperature": 0,
        **({"model": model} if model else {}),
        **extra,
    }
    return httpx.post(f"{worker.url}/v1/completions", json=body, timeout=60)


def vllm_error(reply: httpx.Response, status: int, kind: str) -> dict[str, Any]:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["type"] == kind and error["code"] == status, error
    return dict(error)


@pytest.fixture
def lora_worker(make_worker: Callable[..., Worker]) -> Worker:
    return make_worker(max_loras=2)


def test_a_loaded_adapter_is_listed_chosen_by_model_and_named_in_every_stamp(lora_worker: Worker) -> None:
    w = lora_worker
    base_state = w.client.get_weight_version()
    path = adapter(w, "policy", seed=1, version={"step": 3})
    reply = load(w, lora_name="policy", lora_path=path)
    assert reply.status_code == 200 and reply.text == "Success: LoRA adapter 'policy' added successfully."
    cards = httpx.get(f"{w.url}/v1/models").json()["data"]
    assert [c["id"] for c in cards] == ["reference", "policy"]
    assert cards[1]["root"] == path and cards[1]["parent"] == "reference"
    digest = adapter_digest(lora_tensors(1), CONFIG)
    assert cards[1]["lora"]["version"] == {"step": 3} and cards[1]["lora"]["digest"] == digest
    state = w.client.get_weight_version()
    assert state["max_loras"] == 2 and [a["name"] for a in state["adapters"]] == ["policy"]

    def base_part(reply: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in reply.items() if k not in ("adapters", "max_loras")}

    assert base_state["adapters"] == [] and base_part(state) == base_part(base_state)
    base, lora = complete(w).json(), complete(w, "policy").json()
    assert "adapter" not in base and "adapter" not in base["weight_version_spans"][0]
    stamp = {
        "name": "policy",
        "version": {"step": 3},
        "version_declared": True,
        "version_current": True,
        "digest": digest,
    }
    assert lora["adapter"] == stamp and lora["choices"][0]["adapter"] == stamp and lora["model"] == "policy"
    assert all(span["adapter"] == stamp for span in lora["weight_version_spans"])
    assert lora["choices"][0]["text"] != base["choices"][0]["text"]
    assert complete(w, "reference").json()["choices"][0]["text"] == base["choices"][0]["text"]
    with httpx.stream(
        "POST",
        f"{w.url}/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 4, "model": "policy", "stream": True},
        timeout=60,
    ) as stream:
        events = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    assert events and all(e["adapter"] == stamp for e in events)


def test_a_model_naming_no_adapter_is_refused_never_served_by_the_base(lora_worker: Worker) -> None:
    w = lora_worker
    assert load(w, lora_name="mylora-v3", lora_path=adapter(w, "v3", seed=1)).status_code == 200
    assert complete(w, "mylora-v3").json()["adapter"]["name"] == "mylora-v3"  # TRL's names, unchanged
    for model in ("mylora-v4", "mylora", "Qwen/Qwen2.5-0.5B"):
        reply = complete(w, model)
        assert reply.status_code == 404 and reply.json()["code"] == "model_not_found", reply.text
    chat = httpx.post(
        f"{w.url}/v1/chat/completions",
        json={"model": "mylora-v4", "messages": [{"role": "user", "content": "hi"}]},
        timeout=60,
    )
    assert chat.status_code == 404 and chat.json()["code"] == "model_not_found"


def test_without_max_loras_there_are_no_adapter_routes_and_model_is_metadata(worker: Worker) -> None:
    assert httpx.post(f"{worker.url}/v1/load_lora_adapter", json={}).status_code == 404
    assert complete(worker, "m").status_code == 200
    assert len(httpx.get(f"{worker.url}/v1/models").json()["data"]) == 1
    assert "adapters" not in worker.client.get_weight_version()


def test_vllms_refusals_and_weightsyncs_stricter_ones(lora_worker: Worker) -> None:
    w = lora_worker
    one, two, three = (adapter(w, f"a{i}", seed=i) for i in (1, 2, 3))
    assert load(w, lora_name="a", lora_path=one).status_code == 200
    vllm_error(load(w, lora_name="a", lora_path=two), 400, "adapter_exists")
    vllm_error(load(w, lora_name="reference", lora_path=two), 400, "reserved_name")
    vllm_error(load(w, lora_name="b"), 400, "missing_field")
    vllm_error(load(w, lora_name="b", lora_path=two, lora_scale=2), 400, "unknown_field")
    vllm_error(unload(w, "nobody"), 404, "adapter_not_found")
    assert load(w, lora_name="b", lora_path=two).status_code == 200
    error = vllm_error(load(w, lora_name="c", lora_path=three), 409, "adapter_slots_full")
    assert "--max-loras" in error["message"]
    gone = str(w.root / "missing")
    missing = vllm_error(load(w, lora_name="a", lora_path=gone, load_inplace=True), 404, "path_not_found")
    assert missing["param"] == "body.lora_path"
    reply = unload(w, "b")
    assert reply.status_code == 200 and reply.text == "Success: LoRA adapter 'b' removed successfully."
    assert load(w, lora_name="c", lora_path=three).status_code == 200  # the slot is free again
    assert complete(w, "b").status_code == 404


def test_a_refused_replacement_leaves_the_served_version_in_place(lora_worker: Worker) -> None:
    w = lora_worker
    assert load(w, lora_name="a", lora_path=adapter(w, "v1", seed=1, version=1)).status_code == 200
    before = complete(w, "a").json()
    bad = lora_tensors(2)
    bad[next(iter(bad))][0, 0] = float("inf")
    broken = w.root / "broken"
    broken.mkdir()
    from safetensors.torch import save_file

    save_file(bad, str(broken / "adapter_model.safetensors"))
    (broken / "adapter_config.json").write_text(json.dumps(CONFIG))
    vllm_error(load(w, lora_name="a", lora_path=str(broken), load_inplace=True), 400, "non_finite_adapter")
    mismatch = adapter(w, "v2", seed=2, version=2)
    vllm_error(
        load(w, lora_name="a", lora_path=mismatch, load_inplace=True, weight_version=3),
        409,
        "version_mismatch",
    )
    after = complete(w, "a").json()
    assert after["adapter"]["version"] == 1 and after["choices"][0]["text"] == before["choices"][0]["text"]
    assert load(w, lora_name="a", lora_path=mismatch, load_inplace=True, weight_version=2).status_code == 200
    assert complete(w, "a").json()["adapter"]["version"] == 2
    # a load naming no version takes none from a PEFT directory without a manifest: the label stays, not current
    (w.root / "v2" / "weightsync-manifest.json").unlink()
    assert load(w, lora_name="a", lora_path=adapter(w, "v4", seed=4), load_inplace=True).status_code == 200
    stamp = complete(w, "a").json()["adapter"]
    assert stamp["version"] == 2 and stamp["version_current"] is False


def test_replacing_or_unloading_keeps_the_version_a_running_request_started_with(lora_worker: Worker) -> None:
    w = lora_worker
    assert load(w, lora_name="a", lora_path=adapter(w, "v1", seed=1, version=1)).status_code == 200
    expected = complete(w, "a", max_tokens=120).json()["choices"][0]["text"]
    first_chunk = threading.Event()
    done: dict[str, Any] = {}

    def stream() -> None:
        body = {"prompt": PROMPT, "max_tokens": 120, "temperature": 0, "model": "a", "stream": True}
        with httpx.stream("POST", f"{w.url}/v1/completions", json=body, timeout=120) as reply:
            events = []
            for line in reply.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    first_chunk.set()
            done["events"] = events

    reader = threading.Thread(target=stream)
    reader.start()
    assert first_chunk.wait(60)
    assert (
        load(w, lora_name="a", lora_path=adapter(w, "v2", seed=2, version=2), load_inplace=True).status_code
        == 200
    )
    assert unload(w, "a").status_code == 200
    reader.join(120)
    events = done["events"]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == expected
    assert all(e["adapter"]["version"] == 1 for e in events)
    assert complete(w, "a").status_code == 404


def test_every_route_of_a_lora_worker_is_documented_in_api_md(lora_worker: Worker) -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    paths = set(httpx.get(f"{lora_worker.url}/openapi.json").json()["paths"])
    assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= paths
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        section = doc.split(f"### {path}\n", 1)[1].split("\n### ", 1)[0]
        assert "```" in section, path
