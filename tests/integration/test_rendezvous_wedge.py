"""A trainer that never answers cannot wedge a worker: a join to a store that accepts the
connection and stays silent gives up within its ``timeout_s``, runs outside the command queue
(pause, declare, resume answer meanwhile), and is cancelled by ``destroy_weights_update_group``;
a ``master_address`` that is no host is refused before any connection.  Real loopback workers
and a real listening socket that never writes a byte."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.workers import Worker
from weightsync.core import errors


@pytest.fixture
def silent_store() -> Iterator[int]:
    """A port that accepts every connection and never reads or writes: a trainer stopped
    after binding its store."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            accepted.append(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    stop.set()
    thread.join()
    for conn in accepted:
        conn.close()
    listener.close()


def test_a_join_to_a_silent_store_gives_up_within_its_timeout(worker: Worker, silent_store: int) -> None:
    t0 = time.monotonic()
    with pytest.raises(errors.EngineUnavailable) as err:
        worker.client.init_weights_update_group(
            "127.0.0.1", silent_store, 1, 2, "silent", backend="gloo", timeout_s=2
        )
    assert err.value.code == "rendezvous_failed"
    assert time.monotonic() - t0 < 2 + 4
    assert worker.client.liveness_probe()["alive"]
    with pytest.raises(errors.NotFound):  # nothing was kept under the name
        worker.client.destroy_weights_update_group("silent")


def test_commands_answer_while_a_join_waits_on_a_silent_store(worker: Worker, silent_store: int) -> None:
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(
            worker.client.init_weights_update_group,
            "127.0.0.1", silent_store, 1, 2, "pending", backend="gloo", timeout_s=20,
        )  # fmt: skip
        time.sleep(0.5)  # the join is waiting on the store
        assert not pending.done()
        t0 = time.monotonic()
        worker.client.pause_generation()
        worker.client.set_weight_version("during-join")
        assert worker.client.get_weight_version()["version"] == "during-join"
        worker.client.resume_generation()
        worker.client.pause_generation()
        assert time.monotonic() - t0 < 2.0, "commands waited behind the join"
        with pytest.raises(errors.IllegalState) as exists:  # the name stays reserved meanwhile
            worker.client.init_weights_update_group(
                "127.0.0.1", silent_store, 1, 2, "pending", backend="gloo", timeout_s=1
            )
        assert exists.value.code == "group_exists"
        assert not pending.done()
        t0 = time.monotonic()
        worker.client.destroy_weights_update_group("pending")  # cancels it
        with pytest.raises(errors.IllegalState) as cancelled:
            pending.result(timeout=5)
        assert cancelled.value.code == "join_cancelled"
        assert time.monotonic() - t0 < 3.0
    with pytest.raises(errors.NotFound):
        worker.client.destroy_weights_update_group("pending")
    worker.client.resume_generation()


@pytest.mark.parametrize(
    "address",
    ["localhost\n", "127.0.0.1:80", "tcp://127.0.0.1", "http://host", "a b", "[127.0.0.1]", "300.1.1.1"],
)
def test_a_master_address_that_is_no_host_is_refused_before_connecting(worker: Worker, address: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(errors.InvalidRequest) as err:
        worker.client.init_weights_update_group(address, 29500, 1, 2, "bad", backend="gloo", timeout_s=30)
    assert err.value.code == "invalid_value"
    assert err.value.details["field"] == "master_address"
    assert time.monotonic() - t0 < 2.0


@pytest.mark.parametrize("address", ["[::1]", "::1"])
def test_ipv6_is_taken_bare_or_in_brackets(worker: Worker, address: str) -> None:
    """An IPv6 loopback is tried as an address (and times out here, nothing listening), never
    refused as malformed."""
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
        try:
            s.bind(("::1", 0))
        except OSError:
            pytest.skip("this machine has no IPv6 loopback")
        port = s.getsockname()[1]
    with pytest.raises(errors.EngineUnavailable) as err:
        worker.client.init_weights_update_group(address, port, 1, 2, "v6", backend="gloo", timeout_s=1)
    assert err.value.code == "rendezvous_failed"
