"""The shipped conformance state machine, over real HTTP, against the reference engine."""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import zlib
from collections.abc import Hashable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save_file

from tests.helpers import TINY, perturbed
from weightsync.core import Controller
from weightsync.core.engine import PrefixCacheProbe
from weightsync.engines.reference import ReferenceEngine
from weightsync.serve import ServerThread, create_app
from weightsync.testing import Harness, run_state_machine
from weightsync.trainer import save_checkpoint
from weightsync.transports.disk import checks, copy_loop
from weightsync.transports.hashing import tensor_hashes
from weightsync.transports.sink import Target

POISONED: set[Path] = set()


@pytest.fixture(autouse=True)
def fail_reads_of_poisoned_checkpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkpoints in POISONED fail once their first shard was written (a dying disk).

    Every disk load, push or pull, copies through ``DiskCheckpoint.copy_into`` (the one
    reader's stream), which hands each tensor to the target before it steps: failing after
    the first shard's steps follows real writes into the engine."""
    copy_into = checks.DiskCheckpoint.copy_into

    def poisoned_copy_into(
        self: checks.DiskCheckpoint,
        target: Target,
        meter: copy_loop.ReadMeter | None = None,
        expected: Any = None,
    ) -> Iterator[None]:
        first = self.shards[0]
        for copied, step in enumerate(copy_into(self, target, meter, expected), start=1):
            yield step
            if self.root in POISONED and copied == len(first.tensors):
                raise OSError(f"injected read failure after {first.path.name}")

    monkeypatch.setattr(checks.DiskCheckpoint, "copy_into", poisoned_copy_into)


class HttpHarness(Harness):
    invalid_code = "shape_mismatch"
    # The reference engine stages an update while running: a read failure then discards the
    # staging copy (a 500, nothing changed) instead of tearing.
    unpaused_tear_code = "read_failed"
    observes_prefix_cache = True
    engine_class: type[ReferenceEngine] = ReferenceEngine

    def __init__(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="ws-stateful-"))
        self.engine = self.engine_class(TINY, allowed_weight_dirs=[self.tmp])
        self.base = {n: t.clone() for n, t in self.engine.model.weights().items()}
        self.server = ServerThread(create_app(Controller(self.engine))).start()
        self.http = httpx.Client(base_url=self.server.url, timeout=30)
        self.expected: dict[str, Hashable] = {"init": self._key(tensor_hashes(self.base.items()))}
        bad = {**self.base, "model.norm.weight": torch.ones(5)}
        (self.tmp / "invalid").mkdir()
        save_file(bad, str(self.tmp / "invalid" / "model.safetensors"))
        tear = save_checkpoint(perturbed(self.base, seed=99), self.tmp / "tear", shard_bytes=40_000)
        POISONED.add(tear.resolve())

    @staticmethod
    def _key(h: dict[str, str]) -> Hashable:
        return tuple(sorted(h.items()))

    def call(self, route: str, body: Any) -> tuple[int, dict[str, Any]]:
        # json= would send no body at all for None; a JSON null must be sent as "null"
        r = self.http.post(
            f"/engine/{route}", content=json.dumps(body), headers={"content-type": "application/json"}
        )
        return r.status_code, r.json()

    @staticmethod
    def _long(prompt: str) -> str:
        """The kit's prompt, long enough to fill cache blocks (the engine caches 16-token blocks)."""
        return f"{prompt} " * 10

    def warm_cache(self, prompt: str) -> None:
        body = {"prompt": self._long(prompt), "max_tokens": 1}
        reply = self.http.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text

    def prefix_cached(self, prompt: str) -> bool:
        # the probe runs on the server's loop, where the engine lives
        assert self.server.loop is not None
        probe = asyncio.run_coroutine_threadsafe(
            self.engine.prefix_cached(self._long(prompt)), self.server.loop
        )
        return probe.result(30)

    def update_request(self, kind: str, tag: str) -> tuple[str, dict[str, Any]]:
        if kind == "ok":
            weights = perturbed(self.base, seed=zlib.crc32(tag.encode()))
            path = save_checkpoint(weights, self.tmp / tag)
            self.expected[tag] = self._key(tensor_hashes(weights.items()))
        else:
            path = self.tmp / kind
        return "update_weights_from_disk", {"model_path": str(path)}

    def fingerprint(self) -> Hashable:
        status, reply = self.call("engine_rpc", {"method": "weight_hashes"})
        assert status == 200
        return self._key(reply["result"])

    def fingerprint_for(self, tag: str) -> Hashable | None:
        return self.expected.get(tag)

    def close(self) -> None:
        self.http.close()
        self.server.stop()
        POISONED.discard((self.tmp / "tear").resolve())
        shutil.rmtree(self.tmp, ignore_errors=True)


def test_reference_engine_over_http_conforms_to_the_pure_model() -> None:
    run_state_machine(HttpHarness, max_examples=20, stateful_step_count=15)


def test_the_http_harness_observes_the_reference_engines_prefix_cache() -> None:
    harness = HttpHarness()
    try:
        assert isinstance(harness.engine, PrefixCacheProbe)
        assert not harness.prefix_cached("alpha")
        harness.warm_cache("alpha")
        assert harness.prefix_cached("alpha") and not harness.prefix_cached("beta")
        assert harness.call("flush_cache", {}) == (200, {"status": "ok", "flushed": True})
        assert not harness.prefix_cached("alpha")
    finally:
        harness.close()


class LyingCacheEngine(ReferenceEngine):
    """Says it reset the prefix cache and keeps every block."""

    async def reset_prefix_cache(self, reset_requests: bool = True) -> None:
        return None


class LyingHttpHarness(HttpHarness):
    engine_class = LyingCacheEngine


def test_the_kit_over_http_fails_a_reference_engine_whose_cache_reset_lies() -> None:
    with pytest.raises(AssertionError) as err:
        run_state_machine(LyingHttpHarness, max_examples=100, stateful_step_count=15, shrink=False)
    message = str(err.value)
    assert "rule broken: " in message and "no prompt is served from the prefix cache" in message
    assert "prompts still cached: [" in message
