"""Red-team findings, pinned on real loopback servers, real files and real shared memory:
each hostile request is a 4xx with a precise code, changes nothing, and the worker stays
untorn and answering."""

from __future__ import annotations

import http.client
import json
import os
import secrets
from typing import Any

import httpx
import pytest
import torch

from tests.helpers import TINY, hashes, perturbed
from tests.workers import Worker
from weightsync.core import errors
from weightsync.core.snapshot import TensorSpec
from weightsync.core.sources import DistributedSource, TensorHandle, TensorSource
from weightsync.engines.reference import ReferenceEngine
from weightsync.trainer import save_checkpoint, share_tensors
from weightsync.transports.distributed.worker import GroupRegistry, StreamReader
from weightsync.transports.sink import weight_info
from weightsync.transports.tensor.shm import SharedReader

INDEX = "model.safetensors.index.json"
MANIFEST = "weightsync-manifest.json"


@pytest.fixture
def new_weights() -> dict[str, torch.Tensor]:
    return perturbed(ReferenceEngine(TINY).model.weights())


def post(worker: Worker, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{worker.url}/engine/{route}", json=body, timeout=30)


def paused_at_v0(worker: Worker) -> dict[str, str]:
    """Declare v0 and pause; return the engine's tensor hashes."""
    assert post(worker, "set_weight_version", {"weight_version": "v0"}).status_code == 200
    assert post(worker, "pause_generation", {}).status_code == 200
    return hashes(worker.engine)


def assert_refused_unchanged(
    worker: Worker, reply: httpx.Response, code: str, before: dict[str, str]
) -> None:
    assert reply.status_code == 400 and reply.json()["code"] == code, reply.text
    state = post(worker, "get_weight_version", {}).json()
    assert state["version"] == "v0" and not state["torn"] and not state["update_in_flight"], state
    assert hashes(worker.engine) == before, "a refused update changed the weights"


# ------------------------------------------------ 2: wrong per-tensor hashes in a manifest


@pytest.mark.parametrize("dry_run", [False, True], ids=["update", "dry_run"])
def test_manifest_with_wrong_tensor_hashes_is_refused_before_the_first_write(
    worker: Worker, new_weights: dict[str, torch.Tensor], dry_run: bool
) -> None:
    # The files (sizes, xxh3-128) are intact; only one tensor's hash in the manifest lies.
    ckpt = save_checkpoint(new_weights, worker.root / "c", version="v1", shard_bytes=60_000)
    manifest = json.loads((ckpt / MANIFEST).read_text())
    last = sorted(manifest["tensors"])[-1]
    manifest["tensors"][last] = "0" * 16
    (ckpt / MANIFEST).write_text(json.dumps(manifest))
    before = paused_at_v0(worker)
    reply = post(
        worker,
        "update_weights_from_disk",
        {"model_path": str(ckpt), "weight_version": "v1", "dry_run": dry_run},
    )
    assert_refused_unchanged(worker, reply, "manifest_mismatch", before)
    assert last in reply.json()["message"]
    fine = save_checkpoint(new_weights, worker.root / "fine", version="v1", shard_bytes=60_000)
    assert post(worker, "update_weights_from_disk", {"model_path": str(fine)}).status_code == 200


# ------------------------------------------------ 6: dangling symlinks as index or manifest


@pytest.mark.parametrize(
    ("name", "code"), [(MANIFEST, "manifest_mismatch"), (INDEX, "bad_index")], ids=["manifest", "index"]
)
@pytest.mark.parametrize("link", ["dangling", "loop"])
def test_index_or_manifest_that_is_a_broken_symlink_is_refused_not_ignored(
    worker: Worker, new_weights: dict[str, torch.Tensor], name: str, code: str, link: str
) -> None:
    ckpt = save_checkpoint(new_weights, worker.root / "c", version="v1", shard_bytes=60_000)
    (ckpt / name).unlink()
    (ckpt / name).symlink_to(ckpt / "nowhere.json" if link == "dangling" else ckpt / name)
    before = paused_at_v0(worker)
    want = "symlink_loop" if link == "loop" else code  # a loop says what it is
    for dry_run in (True, False):
        reply = post(worker, "update_weights_from_disk", {"model_path": str(ckpt), "dry_run": dry_run})
        assert_refused_unchanged(worker, reply, want, before)


# ------------------------------------------------ 3: the same tensor named twice


def test_tensor_handles_naming_one_tensor_twice_are_refused_before_any_write(worker: Worker) -> None:
    before = paused_at_v0(worker)
    with (
        share_tensors({"model.norm.weight": torch.ones(64)}) as a,
        share_tensors({"model.norm.weight": torch.zeros(64)}) as b,
    ):
        body = {"tensors": a.tensors + b.tensors, "weight_version": "dup"}
        for dry_run in (True, False):
            reply = post(worker, "update_weights_from_tensor", {**body, "dry_run": dry_run})
            assert_refused_unchanged(worker, reply, "duplicate_tensor", before)
            assert reply.json()["details"]["field"] == "tensors"
        reply = post(worker, "update_weights_from_tensor", {"tensors": a.tensors, "weight_version": "one"})
        assert reply.status_code == 200 and reply.json()["digest"] is not None, reply.text


def test_distributed_names_naming_one_tensor_twice_are_a_duplicate_tensor(worker: Worker) -> None:
    before = paused_at_v0(worker)
    body = {
        "names": ["model.norm.weight"] * 2,
        "dtypes": ["float32"] * 2,
        "shapes": [[64]] * 2,
        "group_name": "g",
    }
    reply = post(worker, "update_weights_from_distributed", body)
    assert_refused_unchanged(worker, reply, "duplicate_tensor", before)
    assert reply.json()["details"]["field"] == "names"


def test_readers_refuse_a_wire_source_naming_one_tensor_twice(worker: Worker) -> None:
    # A source rebuilt from its wire form (the vLLM worker's path) never met the body parser.
    specs = weight_info(worker.engine.model.weights().items()).by_name()
    spec = TensorSpec("model.norm.weight", "float32", (64,))
    with share_tensors({"model.norm.weight": torch.ones(64)}) as a:
        handle = a.tensors[0]["handle"]
        shared = SharedReader(TensorSource([TensorHandle(spec, handle), TensorHandle(spec, handle)]))
        with pytest.raises(errors.InvalidRequest) as shm_err:
            shared.validate(specs)
    assert shm_err.value.code == "duplicate_tensor"
    stream = StreamReader(GroupRegistry(), DistributedSource("g", [spec, spec]))
    with pytest.raises(errors.InvalidRequest) as dist_err:
        stream.validate(specs)
    assert dist_err.value.code == "duplicate_tensor"


# ------------------------------------------------ 7, 8: repeated headers, Host names that only look loopback


def raw_request(
    worker: Worker, method: str, path: str, headers: list[tuple[str, str]], body: bytes = b""
) -> tuple[int, Any]:
    """Send exactly these header lines (repeats included); return status and JSON reply."""
    conn = http.client.HTTPConnection("127.0.0.1", worker.server.port, timeout=30)
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        for name, value in headers:
            conn.putheader(name, value)
        if method == "POST":
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body or None)
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read())
    finally:
        conn.close()


def own_headers(worker: Worker) -> dict[str, tuple[str, str]]:
    return {
        "host": ("Host", f"127.0.0.1:{worker.server.port}"),
        "origin": ("Origin", worker.url),
        "content-type": ("Content-Type", "application/json"),
    }


REPEATS = {
    "host": [("Host", "evil.example"), ("Host", "{own}")],
    "host_same_twice": [("Host", "{own}"), ("Host", "{own}")],
    "origin": [("Origin", "http://evil.example"), ("Origin", "{url}")],
    "content-type": [("Content-Type", "text/plain"), ("Content-Type", "application/json")],
}


@pytest.mark.parametrize("repeat", REPEATS.values(), ids=REPEATS.keys())
def test_a_repeated_host_origin_or_content_type_is_refused(
    worker: Worker, repeat: list[tuple[str, str]]
) -> None:
    own = own_headers(worker)
    lines = [(n, v.format(own=own["host"][1], url=worker.url)) for n, v in repeat]
    repeated = {n.lower() for n, _ in lines}
    headers = [h for name, h in own.items() if name not in repeated] + lines
    status, reply = raw_request(worker, "POST", "/engine/pause_generation", headers, b'{"mode": "abort"}')
    assert (status, reply["code"]) == (400, "repeated_header"), reply
    assert reply["details"]["header"] in repeated
    if "host" in repeated:  # a GET too: the Host rule guards it
        status, reply = raw_request(worker, "GET", "/health", lines)
        assert (status, reply["code"]) == (400, "repeated_header"), reply
    assert worker.client.get_weight_version()["paused"] is False
    status, _ = raw_request(worker, "POST", "/engine/pause_generation", list(own.values()), b"{}")
    assert status == 200


@pytest.mark.parametrize(
    "host",
    ["[::1].evil.com", "[::1]evil.com", "localhost:evil.com", "[::1]:evil.com", "127.0.0.1:80:evil.com"],
)
def test_a_host_that_only_starts_like_a_loopback_name_is_forbidden(worker: Worker, host: str) -> None:
    status, reply = raw_request(worker, "GET", "/health", [("Host", host)])
    assert (status, reply["code"]) == (403, "forbidden_host"), reply
    headers = [("Host", host), ("Content-Type", "application/json")]
    status, reply = raw_request(worker, "POST", "/engine/pause_generation", headers, b"{}")
    assert (status, reply["code"]) == (403, "forbidden_host"), reply
    assert worker.client.get_weight_version()["paused"] is False


# ------------------------------------------------ 9: duplicate keys in a request body

DUPLICATE_KEY_BODIES = {
    "top_level": ("/engine/set_weight_version", b'{"weight_version": 1, "weight_version": 2}'),
    "nested": ("/engine/set_weight_version", b'{"weight_version": {"a": 1, "a": 2}}'),
    "pause": ("/engine/pause_generation", b'{"mode": "keep", "mode": "abort"}'),
    "completion": ("/v1/completions", b'{"prompt": "x", "max_tokens": 1, "max_tokens": 2}'),
}


@pytest.mark.parametrize(("path", "body"), DUPLICATE_KEY_BODIES.values(), ids=DUPLICATE_KEY_BODIES.keys())
def test_a_body_repeating_a_key_is_invalid_json_and_changes_nothing(
    worker: Worker, path: str, body: bytes
) -> None:
    worker.client.set_weight_version("v0")
    reply = httpx.post(
        f"{worker.url}{path}", content=body, headers={"content-type": "application/json"}, timeout=30
    )
    assert reply.status_code == 400 and reply.json()["code"] == "invalid_json", reply.text
    assert "duplicate key" in reply.json()["message"]
    state = worker.client.get_weight_version()
    assert state["version"] == "v0" and not state["paused"]


# ------------------------------------------------ 10: a hard link dressed as a weightsync segment


def test_a_weightsync_name_hard_linked_to_another_segment_is_an_invalid_segment(worker: Worker) -> None:
    tag = secrets.token_hex(6)
    other, alias = f"/dev/shm/not-weightsync-{tag}", f"/dev/shm/weightsync_hl_{tag}"
    with open(other, "wb") as f:
        f.write(torch.ones(64).numpy().tobytes())
    try:
        os.link(other, alias)
        before = paused_at_v0(worker)
        handle = {"shm": os.path.basename(alias), "offset": 0}
        tensors = [{"name": "model.norm.weight", "dtype": "float32", "shape": [64], "handle": handle}]
        for dry_run in (True, False):
            reply = post(worker, "update_weights_from_tensor", {"tensors": tensors, "dry_run": dry_run})
            assert_refused_unchanged(worker, reply, "invalid_segment", before)
        os.unlink(other)  # the alias is now the segment's only name: an ordinary segment
        reply = post(worker, "update_weights_from_tensor", {"tensors": tensors, "weight_version": "ones"})
        assert reply.status_code == 200, reply.text
    finally:
        for path in (other, alias):
            if os.path.lexists(path):
                os.unlink(path)
