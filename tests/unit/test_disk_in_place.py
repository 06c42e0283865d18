"""When a load's hashes are of the served memory itself (``LoadStats.hashed_in_place``): the disk
channel read straight into the sink's tensors, over real safetensors files and a real sink."""

from __future__ import annotations

import io
import threading
import time
from pathlib import Path

import pytest
import torch

from weightsync.core.requests import UpdateRequest
from weightsync.core.sources import DiskSource
from weightsync.trainer import save_checkpoint, share_tensors
from weightsync.transports.disk import copy_loop
from weightsync.transports.disk.checks import DiskCheckpoint
from weightsync.transports.disk.format import ShardHeader, TensorEntry
from weightsync.transports.disk.reader import DiskReader
from weightsync.transports.hashing import tensor_hash, tensor_hashes
from weightsync.transports.loading import LoadContext, load, load_sync
from weightsync.transports.sink import TensorSink


def weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(64, 32, generator=gen), "b": torch.randn(32, generator=gen)}


def load_disk(tmp_path: Path, targets: dict[str, torch.Tensor], seed: int = 1) -> tuple[bool, dict[str, str]]:
    path = save_checkpoint(weights(seed), tmp_path / f"ckpt-{seed}")
    stats = load(DiskReader(DiskSource(str(path))), TensorSink(targets))
    assert stats.hashes is not None
    return stats.hashed_in_place, stats.hashes


def test_a_disk_load_into_the_engines_tensors_is_hashed_in_place(tmp_path: Path) -> None:
    targets = {n: torch.zeros_like(t) for n, t in weights(0).items()}
    in_place, hashes = load_disk(tmp_path, targets)
    assert in_place and hashes == tensor_hashes(targets.items()) == tensor_hashes(weights(1).items())


def straddling() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One storage, and targets "a" and "b" over it: the first half of "b" is the end of "a"."""
    flat = torch.zeros(64 * 32 + 32)
    return flat, {"a": flat[: 64 * 32].view(64, 32), "b": flat[64 * 32 - 16 : 64 * 32 + 16]}


def test_targets_sharing_memory_load_as_one_reader_would_and_are_never_hashed_in_place(
    tmp_path: Path,
) -> None:
    # Writing "b" after "a" was hashed changes what "a" holds: the load succeeds, "a" then
    # holds its file bytes except where "b" (read after it, in file order) lies, and the
    # hashes are not of the served memory.
    flat, overlapping = straddling()
    claimed, hashes = load_disk(tmp_path, overlapping)
    assert not claimed and hashes == tensor_hashes(weights(1).items())
    written = weights(1)
    assert torch.equal(overlapping["b"], written["b"])
    assert torch.equal(flat[: 64 * 32 - 16], written["a"].reshape(-1)[:-16])
    disjoint = {"a": flat[32:].view(64, 32), "b": flat[:32]}  # views of one storage, apart
    assert load_disk(tmp_path, disjoint, seed=2)[0]


@pytest.mark.parametrize("readers", [1, 2, 4])
def test_parallel_readers_never_write_memory_a_pending_tensor_shares(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, readers: int
) -> None:
    """Each read is held open long enough for another reader to start: two reads into
    overlapping memory must never be under way at once, while reads into memory apart do
    run side by side (so this test could see a race)."""
    real_read = copy_loop._read_tensor
    lock = threading.Lock()
    running: dict[str, tuple[int, int]] = {}
    clashes: list[tuple[str, str]] = []
    most = 0

    def held_read(
        f: io.FileIO, shard: ShardHeader, entry: TensorEntry, dst: torch.Tensor
    ) -> tuple[str, float]:
        nonlocal most
        span = (dst.data_ptr(), dst.data_ptr() + dst.numel() * dst.element_size())
        with lock:
            clashes.extend(
                (n, entry.spec.name) for n, s in running.items() if s[0] < span[1] and span[0] < s[1]
            )
            running[entry.spec.name] = span
            most = max(most, len(running))
        time.sleep(0.1)
        try:
            return real_read(f, shard, entry, dst)
        finally:
            with lock:
                del running[entry.spec.name]

    monkeypatch.setattr(copy_loop, "_read_tensor", held_read)
    _, targets = straddling()
    tied = torch.zeros(64, 32)
    targets |= {"c": tied, "d": tied, "e": torch.zeros(32)}  # "c" and "d": tied weights
    written = weights(1) | {"c": weights(2)["a"], "d": weights(3)["a"], "e": weights(2)["b"]}
    ckpt = DiskCheckpoint.open(str(save_checkpoint(written, tmp_path / "ckpt")))
    sink, meter = TensorSink(targets), copy_loop.ReadMeter()
    for _ in copy_loop.copy_into(ckpt, sink, meter, readers=readers):
        pass
    assert clashes == []
    assert most == min(readers, 2)  # "b" beside "c", then "d" beside "e": never more is free to run
    assert sink.written_hashes() == tensor_hashes(written.items())
    assert torch.equal(targets["b"], written["b"]) and torch.equal(tied, written["d"])
    assert not sink.hashed_in_place(meter.in_target)


def test_shared_memory_groups_every_target_whose_bytes_another_shares() -> None:
    flat = torch.zeros(100)
    tied = torch.zeros(4)
    targets = {
        "chain0": flat[0:10], "chain1": flat[8:20], "chain2": flat[19:30],  # 0 and 2 meet through 1
        "apart": flat[30:40], "empty": flat[10:10],
        "tied0": tied, "tied1": tied,
        "strided": torch.zeros(8, 8).t(), "alone": torch.zeros(3),
        "meta0": torch.empty(4, device="meta"), "meta1": torch.empty(4, device="meta"),
    }  # fmt: skip
    wide = torch.zeros(8, 8)
    targets |= {"column": wide[:, 0], "row": wide[7]}  # a strided view counts as its whole storage
    groups = copy_loop.shared_memory(targets)
    assert set(groups) == {"chain0", "chain1", "chain2", "tied0", "tied1", "column", "row"}
    assert groups["chain0"] == groups["chain1"] == groups["chain2"]
    assert groups["tied0"] == groups["tied1"] != groups["chain0"]
    assert groups["column"] == groups["row"] not in (groups["chain0"], groups["tied0"])


def test_a_target_the_sink_cannot_lend_is_not_hashed_in_place(tmp_path: Path) -> None:
    # A transposed (non-contiguous) target cannot take the bytes as they are: they are read
    # into scratch, hashed there, and copied in.
    a = torch.zeros(32, 64).t()
    in_place, hashes = load_disk(tmp_path, {"a": a, "b": torch.zeros(32)})
    assert not in_place and hashes["a"] == tensor_hash(weights(1)["a"])


def test_a_load_through_shared_memory_is_not_hashed_in_place() -> None:
    targets = {n: torch.zeros_like(t) for n, t in weights(0).items()}
    with share_tensors(weights(1)) as shared:
        request = UpdateRequest.from_tensor_body({"tensors": shared.tensors})
        stats = load_sync(request.source, TensorSink(targets), LoadContext())
    assert stats.hashes == tensor_hashes(targets.items()) and not stats.hashed_in_place


def test_an_empty_sink_is_not_hashed_in_place() -> None:
    assert not TensorSink({"a": torch.zeros(2)}).hashed_in_place({"a"})
