"""Disk transport on real safetensors files: validation before any write, streaming, torn."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from safetensors.torch import save_file

from tests.helpers import TINY, PeakAnonMemory, hashes, perturbed, run
from weightsync.core import (
    Controller,
    Declared,
    DiskSource,
    InvalidRequest,
    NotFound,
    PauseRequest,
    UpdateRequest,
    WeightsTorn,
    WeightSyncError,
)
from weightsync.engines.reference import ModelConfig, ReferenceEngine
from weightsync.trainer import checkpoint as writer_mod
from weightsync.trainer import save_checkpoint
from weightsync.transports.disk import DiskCheckpoint


def update_on_fresh_engine(
    path: Path | str, roots: list[Path] | None, config: ModelConfig = TINY, **flags: Any
) -> tuple[ReferenceEngine, Controller, dict[str, str], Any]:
    """Pause a fresh engine, run one update; return engine, controller, hashes before, outcome or error."""

    async def main() -> tuple[ReferenceEngine, Controller, dict[str, str], Any]:
        engine = ReferenceEngine(config, allowed_weight_dirs=roots)
        c = Controller(engine, version=Declared("v0"))
        await c.pause(PauseRequest())
        before = hashes(engine)
        try:
            out: Any = await c.update(UpdateRequest(DiskSource(str(path), **flags), Declared("v1")))
        except WeightSyncError as exc:
            out = exc
        await engine.close()
        return engine, c, before, out

    return run(main())


@pytest.fixture
def new_weights() -> dict[str, torch.Tensor]:
    return perturbed(ReferenceEngine(TINY).model.weights())


def assert_refused(result: Any, cls: type[WeightSyncError], code: str) -> None:
    engine, c, before, out = result
    assert isinstance(out, cls), out
    assert out.code == code, out
    assert hashes(engine) == before, "a refused update changed the weights"
    snap = c.snapshot()
    assert snap.version == Declared("v0") and not snap.torn


def assert_loaded(result: Any, weights: dict[str, torch.Tensor]) -> Any:
    engine, c, before, out = result
    assert not isinstance(out, Exception), out
    from weightsync.transports.hashing import tensor_hashes

    assert hashes(engine) == tensor_hashes(weights.items()) != before
    assert c.snapshot().version == Declared("v1")
    return out


def test_single_file_fp32(tmp_path: Path, new_weights: dict[str, torch.Tensor]) -> None:
    save_file(new_weights, str(tmp_path / "model.safetensors"))
    out = assert_loaded(update_on_fresh_engine(tmp_path / "model.safetensors", [tmp_path]), new_weights)
    assert out.stats.files == 1 and out.stats.tensors == len(new_weights)
    assert out.prefix_cache_reset


def test_sharded_directory_with_manifest(tmp_path: Path, new_weights: dict[str, torch.Tensor]) -> None:
    ckpt = save_checkpoint(new_weights, tmp_path / "step-1", version="step-1", shard_bytes=60_000)
    assert len(list(ckpt.glob("*.safetensors"))) > 2
    out = assert_loaded(update_on_fresh_engine(ckpt, [tmp_path]), new_weights)
    assert out.stats.files > 2 and out.stats.extra["manifest_version"] == "step-1"


def test_bf16_checkpoint_into_bf16_engine(tmp_path: Path) -> None:
    config = attrs.evolve(TINY, dtype="bfloat16")
    weights = perturbed(ReferenceEngine(config).model.weights())
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    ckpt = save_checkpoint(weights, tmp_path / "bf16", shard_bytes=40_000)
    assert_loaded(update_on_fresh_engine(ckpt, [tmp_path], config), weights)


def test_nonexistent_path(tmp_path: Path) -> None:
    assert_refused(update_on_fresh_engine(tmp_path / "nope", [tmp_path]), NotFound, "path_not_found")


def test_path_outside_allowed_roots(tmp_path: Path, new_weights: dict[str, torch.Tensor]) -> None:
    (tmp_path / "outside").mkdir()
    (tmp_path / "root").mkdir()
    save_file(new_weights, str(tmp_path / "outside" / "model.safetensors"))
    result = update_on_fresh_engine(tmp_path / "outside", [tmp_path / "root"])
    assert_refused(result, InvalidRequest, "path_not_allowed")


def test_symlink_cannot_escape_the_allowed_root(tmp_path: Path, new_weights: dict[str, torch.Tensor]) -> None:
    (tmp_path / "outside").mkdir()
    (tmp_path / "root").mkdir()
    save_file(new_weights, str(tmp_path / "outside" / "model.safetensors"))
    (tmp_path / "root" / "link").symlink_to(tmp_path / "outside")
    result = update_on_fresh_engine(tmp_path / "root" / "link", [tmp_path / "root"])
    assert_refused(result, InvalidRequest, "path_not_allowed")


def test_relative_paths_are_refused(tmp_path: Path) -> None:
    assert_refused(update_on_fresh_engine("relative/dir", [tmp_path]), InvalidRequest, "invalid_value")


def test_directory_without_safetensors(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "README").write_text("no weights here")
    assert_refused(update_on_fresh_engine(tmp_path / "empty", [tmp_path]), NotFound, "no_safetensors")


def test_truncated_shard(tmp_path: Path, new_weights: dict[str, torch.Tensor]) -> None:
    ckpt = save_checkpoint(new_weights, tmp_path / "c", shard_bytes=60_000)
    shard = sorted(ckpt.glob("*.safetensors"))[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    assert_refused(update_on_fresh_engine(ckpt, [tmp_path]), InvalidRequest, "corrupt_checkpoint")


@pytest.mark.parametrize(
    "header",
    [b"\xff" * 8, struct.pack("<Q", 10) + b"not json!!", struct.pack("<Q", 2) + b"[]",
     struct.pack("<Q", 60) + b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}'],
)  # fmt: skip
def test_corrupt_header(tmp_path: Path, header: bytes) -> None:
    (tmp_path / "model.safetensors").write_bytes(header + b"\0" * 16)
    result = update_on_fresh_engine(tmp_path / "model.safetensors", [tmp_path])
    assert_refused(result, InvalidRequest, "corrupt_checkpoint")


def test_wrong_shape(tmp_path: Path, new_weights: dict[str, torch.Tensor]) -> None:
    name = "model.norm.weight"
    save_file({**new_weights, name: torch.ones(7)}, str(tmp_path / "model.safetensors"))
    result = update_on_fresh_engine(tmp_path, [tmp_path])
    assert_refused(result, InvalidRequest, "shape_mismatch")
    assert name in str(result[3].details["mismatches"])


def test_wrong_dtype_refused_unless_cast_allowed(
    tmp_path: Path, new_weights: dict[str, torch.Tensor]
) -> None:
    halves = {n: t.half() for n, t in new_weights.items()}
    save_file(halves, str(tmp_path / "model.safetensors"))
    assert_refused(update_on_fresh_engine(tmp_path, [tmp_path]), InvalidRequest, "dtype_mismatch")
    engine, _c, _before, out = update_on_fresh_engine(tmp_path, [tmp_path], allow_dtype_cast=True)
    assert out.stats.extra["dtype_cast"] == len(halves)
    got = engine.model.weights()["model.norm.weight"]
    assert torch.equal(got, halves["model.norm.weight"].float())


def test_missing_tensor_refused_unless_partial(tmp_path: Path, new_weights: dict[str, torch.Tensor]) -> None:
    partial = dict(list(new_weights.items())[:3])
    save_file(partial, str(tmp_path / "model.safetensors"))
    assert_refused(update_on_fresh_engine(tmp_path, [tmp_path]), InvalidRequest, "missing_tensor")
    engine, _c, before, out = update_on_fresh_engine(tmp_path, [tmp_path], allow_partial=True)
    assert out.stats.tensors == 3
    changed = [n for n, h in hashes(engine).items() if h != before[n]]
    assert sorted(changed) == sorted(partial)


def test_unknown_tensor(tmp_path: Path, new_weights: dict[str, torch.Tensor]) -> None:
    save_file({**new_weights, "model.extra.weight": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    assert_refused(update_on_fresh_engine(tmp_path, [tmp_path]), InvalidRequest, "unknown_tensor")


def test_manifest_checksum_mismatch(tmp_path: Path, new_weights: dict[str, torch.Tensor]) -> None:
    ckpt = save_checkpoint(new_weights, tmp_path / "c", shard_bytes=60_000)
    shard = sorted(ckpt.glob("*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # same size, one flipped bit in the data
    shard.write_bytes(bytes(data))
    assert_refused(update_on_fresh_engine(ckpt, [tmp_path]), InvalidRequest, "manifest_mismatch")


def test_missing_shard_listed_in_index(tmp_path: Path, new_weights: dict[str, torch.Tensor]) -> None:
    ckpt = save_checkpoint(new_weights, tmp_path / "c", shard_bytes=60_000)
    sorted(ckpt.glob("*.safetensors"))[1].unlink()
    assert_refused(update_on_fresh_engine(ckpt, [tmp_path]), NotFound, "missing_shard")


def test_shard_deleted_after_validation_leaves_the_worker_torn(
    tmp_path: Path, new_weights: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = save_checkpoint(new_weights, tmp_path / "c", shard_bytes=60_000)
    victim = sorted(ckpt.glob("*.safetensors"))[-1]
    verify = DiskCheckpoint.verify_checksums

    def verify_then_delete(self: DiskCheckpoint) -> dict[str, str]:
        hashes = verify(self)
        victim.unlink()
        return hashes

    monkeypatch.setattr(DiskCheckpoint, "verify_checksums", verify_then_delete)
    engine, c, before, out = update_on_fresh_engine(ckpt, [tmp_path])
    assert isinstance(out, WeightsTorn)
    assert "disappeared" in out.message
    snap = c.snapshot()
    assert snap.torn and snap.paused and snap.version == Declared("v0")
    assert hashes(engine) != before  # the first shards were written: honestly torn


def test_first_shard_deleted_after_validation_changes_nothing(
    tmp_path: Path, new_weights: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = save_checkpoint(new_weights, tmp_path / "c", shard_bytes=60_000)
    victim = sorted(ckpt.glob("*.safetensors"))[0]
    verify = DiskCheckpoint.verify_checksums
    monkeypatch.setattr(DiskCheckpoint, "verify_checksums", lambda self: (verify(self), victim.unlink())[0])
    assert_refused(update_on_fresh_engine(ckpt, [tmp_path]), NotFound, "missing_shard")


def test_writer_crash_before_rename_leaves_no_checkpoint(
    tmp_path: Path, new_weights: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash(tmp: Path, final: Path) -> None:
        raise KeyboardInterrupt("simulated crash")

    monkeypatch.setattr(writer_mod, "_before_rename", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(new_weights, tmp_path / "ckpt", version=1)
    assert not (tmp_path / "ckpt").exists()
    assert list(tmp_path.iterdir()) == []


def test_writer_killed_before_rename_leaves_no_visible_checkpoint(tmp_path: Path) -> None:
    code = f"""
import os, torch
from weightsync.trainer import checkpoint as writer
writer._before_rename = lambda tmp, final: os._exit(9)
writer.save_checkpoint({{"w": torch.ones(1000)}}, {str(tmp_path / "ckpt")!r}, version=1)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert proc.returncode == 9, proc.stderr
    assert not (tmp_path / "ckpt").exists()
    assert all(p.name.startswith(".ckpt.tmp-") for p in tmp_path.iterdir())


def test_writer_overwrite_swaps_atomically(tmp_path: Path) -> None:
    save_checkpoint({"w": torch.zeros(4)}, tmp_path / "c", version=1)
    with pytest.raises(FileExistsError):
        save_checkpoint({"w": torch.ones(4)}, tmp_path / "c", version=2)
    save_checkpoint({"w": torch.ones(4)}, tmp_path / "c", version=2, overwrite=True)
    manifest = json.loads((tmp_path / "c" / "weightsync-manifest.json").read_text())
    assert manifest["version"] == 2 and [p.name for p in tmp_path.iterdir()] == ["c"]


def test_streaming_keeps_extra_memory_below_one_shard(tmp_path: Path) -> None:
    config = ModelConfig(hidden_size=512, intermediate_size=1024, num_layers=6, num_heads=8, num_kv_heads=4,
                         vocab_size=4096, max_position=64)  # fmt: skip
    engine = ReferenceEngine(config)
    weights = perturbed(engine.model.weights())
    shard_bytes = 8 << 20
    ckpt = save_checkpoint(weights, tmp_path / "big", shard_bytes=shard_bytes)
    total = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
    largest = max(p.stat().st_size for p in ckpt.glob("*.safetensors"))
    assert total > 4 * largest  # the checkpoint is far larger than the bound
    del weights

    async def main() -> int:
        c = Controller(engine)
        await c.pause(PauseRequest())
        with PeakAnonMemory() as peak:
            await c.update(UpdateRequest(DiskSource(str(ckpt)), Declared("big")))
        await engine.close()
        return peak.extra

    extra = run(main())
    assert extra <= largest, f"peak extra anonymous memory {extra} > largest shard {largest}"


def test_index_must_match_the_shards(tmp_path: Path, new_weights: dict[str, torch.Tensor]) -> None:
    ckpt = save_checkpoint(new_weights, tmp_path / "c", shard_bytes=60_000)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    shards = sorted({*index["weight_map"].values()})
    index["weight_map"][first] = next(s for s in shards if s != index["weight_map"][first])
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    os.remove(ckpt / "weightsync-manifest.json")
    assert_refused(update_on_fresh_engine(ckpt, [tmp_path]), InvalidRequest, "bad_index")


def test_writer_replaces_an_existing_empty_directory_and_keeps_a_full_one(tmp_path: Path) -> None:
    (tmp_path / "c").mkdir()
    save_checkpoint({"w": torch.zeros(4)}, tmp_path / "c", version=1)
    assert json.loads((tmp_path / "c" / "weightsync-manifest.json").read_text())["version"] == 1
    with pytest.raises(FileExistsError):
        save_checkpoint({"w": torch.ones(4)}, tmp_path / "c", version=2)
    (tmp_path / "link").symlink_to(tmp_path / "empty", target_is_directory=True)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileExistsError):  # a link is not replaced, even one to an empty directory
        save_checkpoint({"w": torch.ones(4)}, tmp_path / "link")
    assert [p.name for p in sorted(tmp_path.iterdir())] == ["c", "empty", "link"]


def test_writer_makes_every_file_world_readable_within_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        save_checkpoint({"a": torch.zeros(4), "b": torch.ones(4)}, tmp_path / "c", shard_bytes=16)
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "c").iterdir()}
    assert len(modes) == 4 and set(modes.values()) == {0o644}, modes
