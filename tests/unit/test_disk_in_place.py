"""When a load's hashes are of the served memory itself (``LoadStats.hashed_in_place``): the disk
channel read straight into the sink's tensors, over real safetensors files and a real sink."""

from __future__ import annotations

from pathlib import Path

import torch

from weightsync.core.errors import WeightSyncError
from weightsync.core.requests import UpdateRequest
from weightsync.core.sources import DiskSource
from weightsync.trainer import save_checkpoint, share_tensors
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


def test_targets_sharing_memory_are_never_hashed_in_place(tmp_path: Path) -> None:
    # Half of "b" lies inside "a": writing one after the other was hashed changes what it holds.
    flat = torch.zeros(64 * 32 + 32)
    overlapping = {"a": flat[: 64 * 32].view(64, 32), "b": flat[64 * 32 - 16 : 64 * 32 + 16]}
    # Readers on two cores may race on the shared bytes: a tensor's hash of what landed then
    # differs from the file's and the load is refused. Either way it is never hashed in place.
    try:
        claimed = load_disk(tmp_path, overlapping)[0]
    except WeightSyncError as exc:
        assert "manifest_mismatch" in (exc.code, getattr(exc.cause, "code", None)), exc
        claimed = False
    assert not claimed
    disjoint = {"a": flat[32:].view(64, 32), "b": flat[:32]}  # views of one storage, apart
    assert load_disk(tmp_path, disjoint, seed=2)[0]


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
