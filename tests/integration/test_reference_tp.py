"""Tensor parallelism in the reference engine, on real processes over gloo: two ranks give
the one-process engine's greedy outputs and digest on the same weights, before and after
every kind of update, each rank keeps only its slice, and a dead rank is an engine failure
(5xx, at once), never a hang."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

from tests.helpers import TINY, perturbed
from weightsync.core import Controller, errors
from weightsync.engines.reference import CausalLM, ReferenceEngine, build_engine
from weightsync.engines.reference.tp_layout import FULL
from weightsync.engines.reference.tp_runner import TPRunner
from weightsync.serve import ServerThread, create_app
from weightsync.trainer import WorkerClient, save_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.integration]

PROMPTS = [list(b"weights move honestly"), list(range(1, 40)), list(b"tensor parallel ranks agree")]


@attrs.define
class Pair:
    """The same model served by one process and by two tensor-parallel ranks."""

    one: WorkerClient
    two: WorkerClient
    engine: ReferenceEngine  # the tensor-parallel one
    root: Path

    def outputs(self, client: WorkerClient, max_tokens: int = 10) -> list[list[int]]:
        return [client.complete(p, max_tokens=max_tokens)["choices"][0]["token_ids"] for p in PROMPTS]

    def both(self, route: str, **body: Any) -> tuple[Any, Any]:
        return getattr(self.one, route)(**body), getattr(self.two, route)(**body)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    root = tmp_path_factory.mktemp("tp")
    servers = []
    clients = []
    engines = [
        build_engine(TINY, allowed_weight_dirs=[root]),
        build_engine(TINY, tensor_parallel_size=2, allowed_weight_dirs=[root]),
    ]
    for engine in engines:
        servers.append(ServerThread(create_app(Controller(engine))).start())
        clients.append(WorkerClient(servers[-1].url, timeout=60))
    yield Pair(clients[0], clients[1], engines[1], root)
    for client, server in zip(clients, servers, strict=True):
        client.close()
        server.stop()


def test_two_ranks_give_the_one_process_engines_greedy_outputs_and_digest(pair: Pair) -> None:
    one, two = pair.outputs(pair.one), pair.outputs(pair.two)
    assert one == two
    assert pair.outputs(pair.two) == one  # again, now from the prefix cache (keyed per rank)
    assert pair.two.engine_rpc("prefix_cache_stats")["result"]["hits"] >= 1
    together: list[Any] = [None] * len(PROMPTS)

    def complete(i: int) -> None:
        together[i] = pair.two.complete(PROMPTS[i], max_tokens=10)["choices"][0]["token_ids"]

    threads = [threading.Thread(target=complete, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert together == one  # batched decode steps across the ranks
    v1, v2 = pair.both("get_weight_version")
    assert v1["digest"] is not None and v1["digest"] == v2["digest"]
    assert pair.one.engine_rpc("weight_hashes")["result"] == pair.two.engine_rpc("weight_hashes")["result"]


def test_each_rank_keeps_only_its_slice(pair: Pair) -> None:
    runner = pair.engine.runner
    assert isinstance(runner, TPRunner)
    held = runner.shard_info()
    full = {
        n: tuple(s) for n, s in zip(*(pair.two.weight_info()[k] for k in ("names", "shapes")), strict=True)
    }
    for rank, parts in enumerate(pair.engine.tp_layout()):
        for name, part in parts.items():
            want = list(full[name])
            if part != FULL:
                want[part[0]] = part[2]
            assert held[rank][name] == ("float32", tuple(want)), (rank, name)
    assert held[1]["model.layers.0.mlp.gate_proj.weight"][1] == (64, 64)  # half of 128 features
    planned = pair.engine.worker_layout("tp").served(1)  # what a transfer plan sends rank 1
    assert all(planned[n].shape == held[1][n][1] for n in held[1])


def test_after_paused_and_unpaused_updates_the_ranks_still_match_one_process(pair: Pair) -> None:
    new = perturbed(CausalLM(TINY).weights(), seed=7)
    path = str(save_checkpoint(new, pair.root / "step-1"))
    pair.both("pause_generation")
    r1, r2 = pair.both("update_weights_from_disk", model_path=path, weight_version="step-1")
    assert r1["digest"] == r2["digest"] and r2["version"] == "step-1"
    pair.both("resume_generation")
    assert pair.outputs(pair.two) == pair.outputs(pair.one)
    # running, with a completion in flight: staged on every rank, swapped between two steps
    newer = perturbed(new, seed=8)
    path = str(save_checkpoint(newer, pair.root / "step-2"))
    long = threading.Thread(target=lambda: pair.two.complete(PROMPTS[0], max_tokens=60))
    long.start()
    r1, r2 = pair.both(
        "update_weights_from_disk", model_path=path, weight_version="step-2", allow_unpaused=True
    )
    long.join(60)
    assert r2["stats"].get("staged") is True and r1["digest"] == r2["digest"]
    assert pair.outputs(pair.two) == pair.outputs(pair.one)
    v1, v2 = pair.both("verify_weights")
    assert v2["match"] and v1["digest"] == v2["digest"]
    pair.both("pause_generation", mode="abort")
    assert pair.two.flush_cache()["flushed"] is True
    pair.both("resume_generation")


def test_a_dead_rank_is_an_engine_failure_at_once_never_a_hang(tmp_path: Path) -> None:
    engine = build_engine(TINY, tensor_parallel_size=2, allowed_weight_dirs=[tmp_path], timeout_s=30)
    runner = engine.runner
    assert isinstance(runner, TPRunner)
    server = ServerThread(create_app(Controller(engine))).start()
    try:
        with WorkerClient(server.url, timeout=30) as client:
            assert client.complete(PROMPTS[0], max_tokens=3)["choices"][0]["token_ids"]
            rank1 = runner.ranks.ranks[0].process
            rank1.kill()
            rank1.join(10)
            t0 = time.monotonic()
            with pytest.raises(errors.WeightSyncError) as err:
                client.complete(PROMPTS[1], max_tokens=3)
            assert err.value.http_status >= 500 and "rank 1" in err.value.message
            assert client.liveness_probe()["alive"] is False
            client.pause_generation()
            path = str(save_checkpoint(perturbed(CausalLM(TINY).weights(), seed=9), tmp_path / "after"))
            with pytest.raises(errors.WeightSyncError) as err:
                client.update_weights_from_disk(model_path=path)
            assert err.value.http_status >= 500
            with pytest.raises(errors.WeightSyncError) as err:
                client.verify_weights()
            assert err.value.http_status >= 500
            with pytest.raises(errors.WeightSyncError) as err:
                client.flush_cache()
            assert err.value.http_status >= 500
            assert time.monotonic() - t0 < 20  # answered, not waited out
    finally:
        t0 = time.monotonic()
        server.stop()
        assert time.monotonic() - t0 < 15
    assert not any(r.process.is_alive() for r in runner.ranks.ranks)
