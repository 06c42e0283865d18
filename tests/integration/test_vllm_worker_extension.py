"""The vLLM worker extension's error paths and the watchdog, without starting vLLM.

The extension is driven as vLLM drives it: ``reload_weights`` consumes the tensor stream the
extension hands over (here into a dict, as vLLM's in-place reload copies into parameters),
over a real checkpoint on disk.  The watchdog runs in a real process tree.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from weightsync.core import errors
from weightsync.core.requests import InitGroupRequest
from weightsync.core.snapshot import TensorSpec
from weightsync.core.sources import DiskSource
from weightsync.engines.vllm import feed as feed_module
from weightsync.engines.vllm.engine import _raise_for
from weightsync.engines.vllm.worker import WeightSyncExtension
from weightsync.trainer import save_checkpoint
from weightsync.transports.disk import DiskCheckpoint
from weightsync.transports.disk import reader as disk_reader
from weightsync.transports.disk.facts import FactsStore
from weightsync.transports.hashing import tensor_hashes
from weightsync.transports.sink import Target

WEIGHTS = {"a.weight": torch.ones(4, 4), "b.weight": torch.zeros(8)}


class Worker(WeightSyncExtension):
    """What the extension is mixed into: a worker with a config and a model runner."""

    def __init__(self, model: Path, fail_in_vllm: bool = False) -> None:
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(model=str(model)))
        self.model_runner = self
        self.loaded: dict[str, torch.Tensor] = {}
        self.fail_in_vllm = fail_in_vllm

    def reload_weights(self, weights_iterator: Iterator[tuple[str, torch.Tensor]], **_: Any) -> None:
        if self.fail_in_vllm:
            raise RuntimeError("vLLM broke before taking a tensor")
        for name, tensor in weights_iterator:
            self.loaded[name] = tensor.clone()


@pytest.fixture
def worker(tmp_path: Path) -> Worker:
    return Worker(save_checkpoint(WEIGHTS, tmp_path / "served"))


class Raising:
    """A channel reader whose stream hands over ``after`` tensors, then raises ``exc``."""

    kind = "disk"

    def __init__(self, exc: BaseException | None, after: int = 0) -> None:
        self.exc, self.after = exc, after

    def validate(self, specs: Mapping[str, TensorSpec]) -> None:
        """Passes: what is under test is the stream and vLLM's reload."""

    def stream(self, target: Target) -> Iterator[None]:
        for name, t in list(WEIGHTS.items())[: self.after]:
            target.accept(TensorSpec(name, "float32", tuple(t.shape)), t.clone(), None)
            yield
        if self.exc is not None:
            raise self.exc

    def close(self) -> None:
        pass


def raising(exc: BaseException | None, after: int = 0) -> Any:
    return Raising(exc, after)


def as_load_error(reply: dict[str, Any]) -> errors.LoadFailed:
    with pytest.raises(errors.LoadFailed) as err:
        _raise_for(reply, loading=True)
    return err.value


BUILTIN_FAILURES = [
    OverflowError("cannot convert float infinity to integer"),
    RecursionError("maximum recursion depth exceeded"),
    KeyError("alias"),
    AttributeError("'str' object has no attribute 'get'"),
    ValueError("embedded null byte"),
    OSError(36, "File name too long"),
    TypeError("unhashable type"),
]


@pytest.mark.parametrize("exc", BUILTIN_FAILURES, ids=lambda e: type(e).__name__)
def test_a_source_failing_before_its_first_tensor_is_a_400_refusal(worker: Worker, exc: Exception) -> None:
    reply = worker._ws_reload(raising(exc))
    assert reply["error"]["wrote"] is False and reply["error"]["http_status"] == 400
    assert reply["error"]["code"] == "invalid_source"
    assert reply["error"]["details"]["exception"] == type(exc).__name__
    assert worker.loaded == {}
    failed = as_load_error(reply)
    assert failed.wrote is False and isinstance(failed.cause, errors.InvalidRequest)


def test_a_family_refusal_from_the_source_keeps_its_code(worker: Worker) -> None:
    reply = worker._ws_reload(raising(errors.InvalidRequest("bad dtype", code="dtype_mismatch")))
    failed = as_load_error(reply)
    assert not failed.wrote and failed.cause is not None and failed.cause.code == "dtype_mismatch"


def test_a_source_failing_after_a_tensor_reached_vllm_reports_written(worker: Worker) -> None:
    failed = as_load_error(worker._ws_reload(raising(OSError("short read"), after=1)))
    assert failed.wrote is True and list(worker.loaded) == ["a.weight"]


def test_vllm_failing_before_it_took_a_tensor_is_an_engine_failure_without_writes(tmp_path: Path) -> None:
    w = Worker(save_checkpoint(WEIGHTS, tmp_path / "served"), fail_in_vllm=True)
    failed = as_load_error(w._ws_reload(raising(None, after=2)))
    assert failed.wrote is False and isinstance(failed.cause, errors.EngineFailure)


@pytest.mark.parametrize("exc", BUILTIN_FAILURES[:3], ids=lambda e: type(e).__name__)
def test_disk_validation_failures_of_any_type_are_refusals(
    worker: Worker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exc: Exception
) -> None:
    new = save_checkpoint({n: t + 1 for n, t in WEIGHTS.items()}, tmp_path / "new")

    def broken_check(*args: Any, **kwargs: Any) -> None:
        raise exc

    monkeypatch.setattr(disk_reader, "check_metadata", broken_check)
    reply = worker.weightsync_load(DiskSource(str(new)).to_wire(), [str(tmp_path)])
    assert reply["error"]["code"] == "invalid_source" and reply["error"]["wrote"] is False
    assert worker.loaded == {}


def test_disk_load_through_the_extension_loads_and_hashes(worker: Worker, tmp_path: Path) -> None:
    new = save_checkpoint({n: t + 1 for n, t in WEIGHTS.items()}, tmp_path / "new")
    reply = worker.weightsync_load(DiskSource(str(new)).to_wire(), [str(tmp_path)])
    assert reply["tensors"] == 2 and reply["files"] == 1
    assert torch.equal(worker.loaded["a.weight"], WEIGHTS["a.weight"] + 1)


def test_what_any_channels_reader_reports_reaches_the_reply(worker: Worker) -> None:
    # The reply is the shared load's stats: a reader with figures of its own (a broadcast's
    # ``verified``) is heard on vLLM as on the reference engine, not only the disk reader.
    class Reporting(Raising):
        def extra(self) -> dict[str, Any]:
            return {"verified": False}

    reply = worker._ws_reload(Reporting(None, after=2))
    assert reply["tensors"] == 2 and reply["files"] == 0 and reply["extra"] == {"verified": False}


def test_a_fresh_worker_records_the_hashes_of_its_checkpoint(worker: Worker) -> None:
    assert worker.weightsync_weight_hashes() == {"hashes": tensor_hashes(WEIGHTS.items())}


def test_a_load_reports_and_records_the_hashes_of_what_it_handed_over(worker: Worker, tmp_path: Path) -> None:
    new = {"a.weight": WEIGHTS["a.weight"] + 1}
    path = save_checkpoint(new, tmp_path / "partial")
    reply = worker.weightsync_load(DiskSource(str(path), allow_partial=True).to_wire(), [str(tmp_path)])
    assert reply["hashes"] == tensor_hashes(new.items())
    # The tensor not in the partial checkpoint keeps the served checkpoint's hash.
    assert worker.weightsync_weight_hashes()["hashes"] == tensor_hashes({**WEIGHTS, **new}.items())


def test_a_dry_run_validates_writes_nothing_and_returns_the_manifest_hashes(
    worker: Worker, tmp_path: Path
) -> None:
    new = {n: t + 1 for n, t in WEIGHTS.items()}
    path = save_checkpoint(new, tmp_path / "new")
    assert worker.weightsync_check(DiskSource(str(path)).to_wire(), [str(tmp_path)]) == {
        "hashes": tensor_hashes(new.items())
    }
    assert worker.loaded == {}
    assert worker.weightsync_weight_hashes()["hashes"] == tensor_hashes(WEIGHTS.items())


def test_a_load_prepared_by_a_dry_run_copies_once_and_a_rewrite_after_it_tears(
    worker: Worker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    new = {n: t + 1 for n, t in WEIGHTS.items()}
    wire, roots = DiskSource(str(save_checkpoint(new, tmp_path / "new"))).to_wire(), [str(tmp_path)]
    assert "error" not in worker.weightsync_check(wire, roots)
    passes: list[Path] = []
    verify = DiskCheckpoint.verify_checksums
    monkeypatch.setattr(
        DiskCheckpoint, "verify_checksums", lambda self: passes.append(self.root) or verify(self)
    )
    reply = worker.weightsync_load(wire, roots)
    assert reply["extra"]["prepared"] is True and passes == []  # one copy, no checksum pass
    assert reply["hashes"] == tensor_hashes(new.items())
    assert all(torch.equal(worker.loaded[n], t) for n, t in new.items())
    # Prepared again, then the file is rewritten in place after the copy reopened it and
    # checked its identity: only the per-tensor hash can see it, once vLLM took tensors.
    assert "error" not in worker.weightsync_check(wire, roots)
    recall = FactsStore.recall_unchanged
    recalled: list[Any] = []

    def recall_checked(self: FactsStore, *args: Any) -> Any:
        facts = recall(self, *args)
        recalled.append(facts)
        return facts

    reopen = DiskCheckpoint.reopen

    rewritten: list[Path] = []

    def reopen_then_rewrite(self: DiskCheckpoint, shard: Any) -> Any:
        f = reopen(self, shard)
        if rewritten:  # once (a shard may be reopened by more than one reader)
            return f
        rewritten.append(shard.path)
        data = bytearray(shard.path.read_bytes())
        data[-1] ^= 0xFF
        with shard.path.open("r+b") as w:
            w.write(bytes(data))
        return f

    monkeypatch.setattr(FactsStore, "recall_unchanged", recall_checked)
    monkeypatch.setattr(DiskCheckpoint, "reopen", reopen_then_rewrite)
    torn = as_load_error(worker.weightsync_load(wire, roots))
    assert recalled and recalled[0] is not None, "the dry run's facts should still apply here"
    assert torn.wrote and torn.code == "manifest_mismatch"
    assert "error" in worker.weightsync_weight_hashes()  # what vLLM holds is unknown now


class Retaining(Worker):
    """A vLLM that keeps what it is handed (as its in-place reload keeps a layer's weights
    until the layer is complete, or a loader that makes a tensor its parameter): whole
    tensors, or only views of them."""

    def __init__(self, model: Path, views: bool) -> None:
        super().__init__(model)
        self.views = views
        self.kept: list[tuple[str, torch.Tensor]] = []

    def reload_weights(self, weights_iterator: Iterator[tuple[str, torch.Tensor]], **_: Any) -> None:
        for name, tensor in weights_iterator:
            self.kept.append((name, tensor.narrow(0, 0, 1) if self.views else tensor))


@pytest.mark.parametrize("views", [False, True], ids=["tensors", "views"])
def test_memory_vllm_still_holds_is_never_read_into_by_a_later_load(tmp_path: Path, views: bool) -> None:
    w = Retaining(save_checkpoint(WEIGHTS, tmp_path / "served"), views)
    roots = [str(tmp_path)]
    first = {n: t + 1 for n, t in WEIGHTS.items()}
    for i, weights in enumerate([first, {n: t + 2 for n, t in WEIGHTS.items()}]):
        path = save_checkpoint(weights, tmp_path / f"c{i}")
        assert "error" not in w.weightsync_load(DiskSource(str(path)).to_wire(), roots)
    for name, kept in w.kept[: len(WEIGHTS)]:
        assert torch.equal(kept, first[name][: 1 if views else None])


def test_memory_vllm_copied_out_is_reused_by_the_next_load(worker: Worker, tmp_path: Path) -> None:
    roots, sizes = [str(tmp_path)], []
    for i in range(3):
        path = save_checkpoint({n: t + i for n, t in WEIGHTS.items()}, tmp_path / f"c{i}")
        assert "error" not in worker.weightsync_load(DiskSource(str(path)).to_wire(), roots)
        assert worker._ws_scratch is not None
        sizes.append(worker._ws_scratch.nbytes)
        assert all(torch.equal(worker.loaded[n], t + i) for n, t in WEIGHTS.items())
    assert sizes[0] > 0 and sizes[1:] == sizes[:1] * 2


def test_a_checkpoint_read_ahead_has_stopped_reading_when_vllm_fails_part_way(tmp_path: Path) -> None:
    class FailsAfterOne(Worker):
        def reload_weights(self, weights_iterator: Iterator[tuple[str, torch.Tensor]], **_: Any) -> None:
            for name, tensor in weights_iterator:
                self.loaded[name] = tensor.clone()
                raise RuntimeError("vLLM broke after one tensor")

    many = {f"w{i}": torch.full((256, 256), float(i)) for i in range(8)}
    w = FailsAfterOne(save_checkpoint(many, tmp_path / "served"))
    path = save_checkpoint({n: t + 1 for n, t in many.items()}, tmp_path / "new")
    reply = w.weightsync_load(DiskSource(str(path)).to_wire(), [str(tmp_path)])
    assert as_load_error(reply).wrote is True
    assert [t for t in threading.enumerate() if t.name == "weightsync-feed"] == []


class Swallowing(Worker):
    """A vLLM that stops pulling after ``take`` tensors, swallowing what the stream raised, and
    returns normally."""

    take = 1

    def reload_weights(self, weights_iterator: Iterator[tuple[str, torch.Tensor]], **_: Any) -> None:
        with contextlib.suppress(Exception):
            for name, tensor in weights_iterator:
                self.loaded[name] = tensor.clone()
                if len(self.loaded) == self.take:
                    return


@pytest.mark.parametrize("channel", ["disk", "pull"])
def test_a_reload_that_returns_before_the_stream_ended_is_torn(tmp_path: Path, channel: str) -> None:
    w = Swallowing(save_checkpoint(WEIGHTS, tmp_path / "served"))
    if channel == "disk":
        path = save_checkpoint({n: t + 1 for n, t in WEIGHTS.items()}, tmp_path / "new")
        reply = w.weightsync_load(DiskSource(str(path)).to_wire(), [str(tmp_path)])
    else:
        reply = w._ws_reload(raising(None, after=2))
    failed = as_load_error(reply)
    assert failed.wrote is True  # the controller marks the worker torn
    with pytest.raises(errors.IllegalState):
        _raise_for(w.weightsync_weight_hashes())


def test_a_reload_that_swallows_the_streams_failure_is_torn(tmp_path: Path) -> None:
    w = Swallowing(save_checkpoint(WEIGHTS, tmp_path / "served"))
    w.take = len(WEIGHTS) + 1  # it would take everything: the stream fails first
    failed = as_load_error(w._ws_reload(raising(OSError("short read"), after=1)))
    assert failed.wrote is True and "short read" in str(failed)
    with pytest.raises(errors.IllegalState):
        _raise_for(w.weightsync_weight_hashes())


@pytest.mark.timeout(60)
def test_a_read_ahead_thread_failing_before_it_reads_ends_the_load(
    worker: Worker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken() -> None:
        raise RuntimeError("no cores")

    monkeypatch.setattr(feed_module, "_any_core", broken)
    path = save_checkpoint({n: t + 1 for n, t in WEIGHTS.items()}, tmp_path / "new")
    reply = worker.weightsync_load(DiskSource(str(path)).to_wire(), [str(tmp_path)])
    assert reply["error"]["wrote"] is False and worker.loaded == {}


def answer(worker: Worker, ticket: int, timeout: float = 30.0) -> dict[str, Any]:
    """The answer of the dry run started under ``ticket``, polled as the adapter does."""
    deadline = time.monotonic() + timeout
    while (reply := worker.weightsync_check_result(ticket)).get("pending"):
        assert time.monotonic() < deadline, "the dry run never ended"
        time.sleep(0.01)
    return reply


@pytest.mark.timeout(60)
def test_a_dry_run_in_a_thread_answers_pending_until_done_then_as_the_inline_one(
    worker: Worker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from weightsync.engines.vllm import worker as worker_module

    new = {n: t + 1 for n, t in WEIGHTS.items()}
    wire, roots = DiskSource(str(save_checkpoint(new, tmp_path / "new"))).to_wire(), [str(tmp_path)]
    inline = worker.weightsync_check(wire, roots)
    release = threading.Event()
    check = worker_module.check_source

    def held_up(*args: Any) -> Any:
        assert release.wait(30)
        return check(*args)

    monkeypatch.setattr(worker_module, "check_source", held_up)
    assert worker.weightsync_check_start(7, wire, roots) == {}  # answered while the check waits
    assert worker.weightsync_check_result(7) == {"pending": True}
    release.set()
    assert answer(worker, 7) == inline == {"hashes": tensor_hashes(new.items())}
    with pytest.raises(errors.NotFound) as err:  # answered once
        _raise_for(worker.weightsync_check_result(7))
    assert err.value.code == "unknown_check"
    assert worker.loaded == {}


def test_a_dry_run_in_a_thread_refuses_as_the_load_would_and_prepares_the_load(
    worker: Worker, tmp_path: Path
) -> None:
    bad = DiskSource(str(save_checkpoint({**WEIGHTS, "a.weight": torch.ones(3, 3)}, tmp_path / "bad")))
    assert worker.weightsync_check_start(1, bad.to_wire(), [str(tmp_path)]) == {}
    reply = answer(worker, 1)
    with pytest.raises(errors.InvalidRequest) as err:
        _raise_for(reply)
    assert err.value.code == "shape_mismatch"
    new = {n: t + 1 for n, t in WEIGHTS.items()}
    wire, roots = DiskSource(str(save_checkpoint(new, tmp_path / "new"))).to_wire(), [str(tmp_path)]
    assert worker.weightsync_check_start(2, wire, roots) == {}
    assert "error" not in answer(worker, 2)
    reply = worker.weightsync_load(wire, roots)
    assert reply["extra"]["prepared"] is True  # what the thread verified stayed with the worker
    assert reply["hashes"] == tensor_hashes(new.items())


@pytest.mark.parametrize("case", ["shape", "outside-roots", "malformed"])
def test_a_dry_run_refuses_as_the_load_would_with_a_4xx(worker: Worker, tmp_path: Path, case: str) -> None:
    if case == "malformed":
        wire: dict[str, Any] = {"kind": "disk", "model_path": 5}
    else:
        path = save_checkpoint({**WEIGHTS, "a.weight": torch.ones(3, 3)}, tmp_path / "shape")
        wire = DiskSource(str(path)).to_wire()
    roots = [str(tmp_path / "elsewhere")] if case == "outside-roots" else [str(tmp_path)]
    reply = worker.weightsync_check(wire, roots)
    with pytest.raises(errors.WeightSyncError) as err:
        _raise_for(reply)
    assert not isinstance(err.value, errors.LoadFailed) and 400 <= err.value.http_status < 500
    assert worker.loaded == {}


def test_after_a_torn_load_the_recorded_hashes_are_unknown_until_a_complete_load(
    worker: Worker, tmp_path: Path
) -> None:
    as_load_error(worker._ws_reload(raising(OSError("short read"), after=1)))
    with pytest.raises(errors.IllegalState) as err:
        _raise_for(worker.weightsync_weight_hashes())
    assert err.value.code == "weights_unknown"
    new = {n: t + 2 for n, t in WEIGHTS.items()}
    path = save_checkpoint(new, tmp_path / "whole")
    assert "error" not in worker.weightsync_load(DiskSource(str(path)).to_wire(), [str(tmp_path)])
    assert worker.weightsync_weight_hashes() == {"hashes": tensor_hashes(new.items())}


@pytest.mark.parametrize(
    "fields",
    [{}, {"group_name": "g", "tensors": [["x"]]}, {"group_name": "g", "tensors": 5}],
    ids=["empty", "short-tensor", "not-a-list"],
)
def test_malformed_receive_fields_are_refused_not_raised(worker: Worker, fields: dict[str, Any]) -> None:
    reply = worker.weightsync_load({"kind": "distributed", **fields})
    assert reply["error"]["wrote"] is False and reply["error"]["http_status"] == 400


def test_non_load_methods_answer_errors_instead_of_raising(tmp_path: Path) -> None:
    w = Worker(tmp_path / "missing")
    assert "error" in w.weightsync_weight_info()
    assert "error" in w.weightsync_weight_hashes()
    refused = w.weightsync_init_group({"no": "such field"})["error"]
    assert (refused["http_status"], refused["code"]) == (400, "unknown_field")


def test_a_group_request_is_checked_again_where_it_arrives(tmp_path: Path) -> None:
    # The wire form is parsed as a request body is: a name the edge refuses is refused here
    # too, before the worker touches any store.
    w = Worker(tmp_path / "missing")
    wire = InitGroupRequest("127.0.0.1", 1, 1, 2, "a b/../c", "gloo", 1.0).to_wire()
    refused = w.weightsync_init_group(wire)["error"]
    assert (refused["http_status"], refused["code"], refused["details"]["field"]) == (
        400,
        "invalid_value",
        "group_name",
    )


# ---------------------------------------------------------------------- watchdog


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in os.listdir(f"/proc/{parent}/task"):
            try:
                kids = [int(c) for c in Path(f"/proc/{parent}/task/{task}/children").read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


SERVER = """
import os, subprocess, sys, time
os.environ["WEIGHTSYNC_SERVER_PID"] = str(os.getpid())
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
time.sleep(600)
"""
ENGINE_CORE = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "from weightsync.engines.vllm import watchdog; import pathlib, sys, time; "
                  "assert watchdog.start(); pathlib.Path(sys.argv[1]).touch(); time.sleep(600)", sys.argv[1]])
time.sleep(600)
"""


def test_watchdog_ends_the_processes_between_it_and_a_killed_server(tmp_path: Path) -> None:
    ready = tmp_path / "watching"
    server = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(SERVER), textwrap.dedent(ENGINE_CORE), str(ready)]
    )
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert time.monotonic() < deadline and server.poll() is None, "the watchdog never started"
            time.sleep(0.05)
        pids = descendants(server.pid)
        assert len(pids) == 2
    finally:
        os.kill(server.pid, signal.SIGKILL)
        server.wait()
    deadline = time.monotonic() + 15
    try:
        while any(running(p) for p in pids):
            assert time.monotonic() < deadline, "processes outlived their server"
            time.sleep(0.1)
    finally:
        for p in pids:
            if running(p):
                os.kill(p, signal.SIGKILL)


def test_watchdog_does_nothing_outside_a_servers_vllm_processes() -> None:
    from weightsync.engines.vllm import watchdog

    assert watchdog.find_server() is None  # this test process was not started by a server
