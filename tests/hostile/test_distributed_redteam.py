"""Red-team findings on the distributed transport, pinned against a real ``weightsync serve``
worker process, real TCPStores and real gloo groups: hostile names and sizes are 400s before
the store is touched, IPv6 rendezvous works, a trainer that never starts its stream is a 503
that leaves the worker untouched, and one group name cannot be joined twice at once."""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Iterator
from typing import Any

import attrs
import pytest
import torch
import torch.distributed as dist

from tests.helpers import TINY, WorkerProcess, paused_clients, perturbed, served_workers
from weightsync.core import errors
from weightsync.core.requests import InitGroupRequest, UpdateRequest
from weightsync.core.snapshot import TensorSpec
from weightsync.engines.reference import ReferenceEngine
from weightsync.trainer import Broadcaster, WorkerClient
from weightsync.transports.distributed import packed
from weightsync.transports.distributed.group import Group, create_group
from weightsync.transports.distributed.keys import manifest_key
from weightsync.transports.distributed.layout import manifest, plan_chunks
from weightsync.transports.distributed.worker import GroupRegistry
from weightsync.transports.hashing import tensor_hashes

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    with served_workers(1) as [proc]:
        yield proc


@pytest.fixture
def client(worker: WorkerProcess) -> Iterator[WorkerClient]:
    with paused_clients([worker], version="before") as [c]:
        yield c


def _store() -> Any:
    return dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)


def _join(client: WorkerClient, name: str, timeout_s: float) -> tuple[Any, Group]:
    """A real two-rank gloo group: this test is rank 0, the worker rank 1."""
    store = _store()
    mine: dict[str, Group] = {}

    def rank0() -> None:
        mine["g"] = create_group(
            name, master_address="127.0.0.1", master_port=store.port, rank=0, world_size=2,
            backend="gloo", timeout_s=timeout_s, store=store,
        )  # fmt: skip

    t = threading.Thread(target=rank0)
    t.start()
    client.init_weights_update_group("127.0.0.1", store.port, 1, 2, name, backend="gloo", timeout_s=timeout_s)
    t.join()
    return store, mine["g"]


def _first_tensor(client: WorkerClient) -> tuple[list[str], list[str], list[list[int]]]:
    info = client.weight_info()
    return info["names"][:1], info["dtypes"][:1], info["shapes"][:1]


# --------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    "bad",
    [
        {"world_size": 2**31},
        {"world_size": 2**63},
        {"world_size": 2**70},
        {"world_size": 65537},
        {"rank_offset": 2**40, "world_size": 2**41},
        {"group_name": "\ud800"},
        {"group_name": "g\x00h"},
        {"group_name": "g" * 200_000},
        {"group_name": "g" * 129},
        {"group_name": "a/b"},
    ],
)
def test_init_with_an_out_of_range_size_or_a_hostile_group_name_is_invalid_value(bad: dict[str, Any]) -> None:
    body = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2,
            "group_name": "g", "backend": "gloo", **bad}  # fmt: skip
    with pytest.raises(errors.InvalidRequest) as err:
        InitGroupRequest.from_body(body)
    assert err.value.code == "invalid_value"


@pytest.mark.parametrize(
    "packing, group",
    [
        ({"bucket_bytes": 1024, "stream_id": "x" * 9000}, "g"),
        ({"bucket_bytes": 1024, "stream_id": "a\x00"}, "g"),
        ({"bucket_bytes": 1024, "stream_id": "\udc80"}, "g"),
        ({"bucket_bytes": 1024, "stream_id": "s1"}, "g" * 9000),
    ],
)
def test_update_with_a_hostile_stream_id_or_group_name_is_invalid_value(packing: Any, group: str) -> None:
    body = {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "group_name": group, "packing": packing}
    with pytest.raises(errors.InvalidRequest) as err:
        UpdateRequest.from_distributed_body(body)
    assert err.value.code == "invalid_value"


def test_the_longest_allowed_names_still_parse() -> None:
    body = {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "G-1.x_" + "g" * 122,
            "packing": {"bucket_bytes": 1024, "stream_id": "s" * 128}}  # fmt: skip
    source = UpdateRequest.from_distributed_body(body).source
    assert source.stream_id == "s" * 128  # type: ignore[union-attr]


# --------------------------------------------------------------------------- real worker


def test_a_9000_character_stream_id_is_a_400_and_the_group_keeps_working(
    worker: WorkerProcess, client: WorkerClient
) -> None:
    names, dtypes, shapes = _first_tensor(client)
    with Broadcaster([worker.url], group_name="rt-long", timeout_s=10) as b:
        with pytest.raises(errors.InvalidRequest) as err:
            client.update_weights_from_distributed(
                names, dtypes, shapes, "rt-long", weight_version="evil",
                packing={"bucket_bytes": 1024, "stream_id": "x" * 9000},
            )  # fmt: skip
        assert err.value.code == "invalid_value"
        new = perturbed(ReferenceEngine(TINY).model.weights(), seed=41)
        b.push(new, version="after")  # the worker's store connection survived
    assert client.get_weight_version()["version"] == "after"
    assert client.engine_rpc("weight_hashes")["result"] == tensor_hashes(new.items())


def test_a_group_over_ipv6_loopback_joins_and_streams(worker: WorkerProcess, client: WorkerClient) -> None:
    new = perturbed(ReferenceEngine(TINY).model.weights(), seed=42)
    with Broadcaster([worker.url], group_name="rt-v6", master_address="::1", timeout_s=10) as b:
        b.push(new, version="v6")
    assert client.get_weight_version()["version"] == "v6"
    assert client.engine_rpc("weight_hashes")["result"] == tensor_hashes(new.items())


def _post_manifest(store: Any, stream_id: str, names: list[str], dtypes: list[str], shapes: Any) -> None:
    specs = [TensorSpec(n, d, s) for n, d, s in zip(names, dtypes, shapes, strict=True)]
    store.set(manifest_key(stream_id), manifest(plan_chunks(specs, 1024)))


def test_a_trainer_that_never_says_go_is_a_503_stream_aborted_and_nothing_changes(
    client: WorkerClient,
) -> None:
    names, dtypes, shapes = _first_tensor(client)
    before = client.engine_rpc("weight_hashes")["result"]
    store, mine = _join(client, "rt-nogo", timeout_s=2)
    try:
        _post_manifest(store, "s-nogo", names, dtypes, shapes)
        t0 = time.monotonic()
        with pytest.raises(errors.EngineUnavailable) as err:
            client.update_weights_from_distributed(
                names, dtypes, shapes, "rt-nogo", weight_version="nogo",
                packing={"bucket_bytes": 1024, "stream_id": "s-nogo"},
            )  # fmt: skip
        assert time.monotonic() - t0 < 2 + 3
        assert err.value.code == "stream_aborted"
        state = client.get_weight_version()
        assert state["version"] == "before" and not state["torn"]
        assert client.engine_rpc("weight_hashes")["result"] == before
    finally:
        client.destroy_weights_update_group("rt-nogo")  # still registered: nothing was received
        mine.close()


def test_a_trainer_whose_store_dies_before_the_go_is_a_503_and_nothing_changes(client: WorkerClient) -> None:
    names, dtypes, shapes = _first_tensor(client)
    store, mine = _join(client, "rt-dead", timeout_s=2)
    _post_manifest(store, "s-dead", names, dtypes, shapes)
    mine.close()
    del store, mine  # the trainer goes away: its store server with it
    with pytest.raises(errors.EngineUnavailable) as err:
        client.update_weights_from_distributed(
            names, dtypes, shapes, "rt-dead", weight_version="dead",
            packing={"bucket_bytes": 1024, "stream_id": "s-dead"},
        )  # fmt: skip
    assert err.value.code == "stream_aborted"
    state = client.get_weight_version()
    assert state["version"] == "before" and not state["torn"]
    client.destroy_weights_update_group("rt-dead")


# --------------------------------------------------------------------------- registry


def test_a_second_join_of_a_name_being_joined_waits_for_it_and_only_one_group_is_kept() -> None:
    """A second join of a name whose rendezvous is in progress waits for it (as joins queued
    behind each other before): once the first has joined, the second is ``group_exists``; one
    with a shorter ``timeout_s`` than the first's wait is ``group_exists`` at its own deadline."""
    registry = GroupRegistry()
    store = _store()
    req = InitGroupRequest("127.0.0.1", store.port, 1, 2, "rt-twice", backend="gloo", timeout_s=10)
    outcomes: dict[str, BaseException | None] = {}

    def join(key: str, request: InitGroupRequest) -> None:
        try:
            registry.join(request)
            outcomes[key] = None
        except BaseException as exc:  # reported below
            outcomes[key] = exc

    first = threading.Thread(target=join, args=("first", req))
    first.start()
    second = threading.Thread(target=join, args=("second", req))
    try:
        time.sleep(0.5)  # the first join is waiting in the rendezvous for rank 0
        t0 = time.monotonic()
        short = attrs.evolve(req, timeout_s=0.5)
        with pytest.raises(errors.IllegalState) as err:
            registry.join(short)
        waited = time.monotonic() - t0
        assert err.value.code == "group_exists" and "being joined" in str(err.value)
        assert 0.4 < waited < 3, waited
        second.start()
        time.sleep(0.3)
        assert "second" not in outcomes  # still waiting for the first
        rank0 = create_group("rt-twice", master_address="127.0.0.1", master_port=store.port, rank=0,
                             world_size=2, backend="gloo", timeout_s=10, store=store)  # fmt: skip
        first.join()
        second.join()
        assert outcomes["first"] is None and registry.names() == ["rt-twice"]
        refused = outcomes["second"]
        assert isinstance(refused, errors.IllegalState) and refused.code == "group_exists"
        rank0.close()
    finally:
        first.join()
        if second.is_alive():
            second.join()
        registry.close()
    assert registry.names() == []


def test_no_go_within_the_timeout_is_a_load_failure_that_wrote_nothing() -> None:
    store = _store()
    client_store = dist.TCPStore("127.0.0.1", store.port, None, False, datetime.timedelta(seconds=5))
    group = Group("rt-handshake", 1, 2, "gloo", 0.5, client_store, None, torch.device("cpu"))
    with pytest.raises(errors.LoadFailed) as err:
        packed.handshake(group, "s-handshake")
    assert err.value.wrote is False and err.value.code == "stream_aborted"
    assert err.value.reply_status == 503 and isinstance(err.value.cause, errors.EngineUnavailable)
