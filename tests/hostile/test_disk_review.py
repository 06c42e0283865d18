"""Hostile files a disk review found: symlink loops, a shard rewritten in place (same size)
just before the copy reopens it, pseudo-files that say they are empty, and a shard that grows
while it is read.  Each is refused with its own code, nothing written, nothing hung."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import TINY, perturbed
from tests.integration.test_disk import assert_refused, update_on_fresh_engine
from tests.integration.test_dry_run_facts import dry_run_then_update
from weightsync.core import InvalidRequest
from weightsync.engines.reference import ReferenceEngine
from weightsync.trainer import save_checkpoint
from weightsync.transports.disk import DiskCheckpoint
from weightsync.transports.disk.format import ShardHeader

INDEX = "model.safetensors.index.json"
MANIFEST = "weightsync-manifest.json"


@pytest.fixture
def new_weights() -> dict[str, torch.Tensor]:
    return perturbed(ReferenceEngine(TINY).model.weights())


def ckpt(tmp_path: Path, weights: dict[str, torch.Tensor]) -> Path:
    return save_checkpoint(weights, tmp_path / "c", version="v1")


def only_shard(path: Path) -> Path:
    (shard,) = path.glob("*.safetensors")
    return shard


def refusal(result: Any) -> InvalidRequest:
    out = result[3]
    assert isinstance(out, InvalidRequest), out
    return out


@pytest.mark.parametrize("hops", [1, 2])
def test_a_model_path_whose_symlinks_loop_is_a_symlink_loop(tmp_path: Path, hops: int) -> None:
    links = [tmp_path / f"l{i}" for i in range(hops)]
    for i, link in enumerate(links):
        link.symlink_to(links[(i + 1) % hops])
    assert_refused(update_on_fresh_engine(links[0], [tmp_path]), InvalidRequest, "symlink_loop")
    through = links[0] / "model.safetensors"  # a loop in a directory on the way
    assert_refused(update_on_fresh_engine(through, [tmp_path]), InvalidRequest, "symlink_loop")


@pytest.mark.parametrize("name", ["extra.safetensors", INDEX, MANIFEST])
def test_a_checkpoint_file_whose_symlinks_loop_is_a_symlink_loop(
    tmp_path: Path, new_weights: dict[str, torch.Tensor], name: str
) -> None:
    path = ckpt(tmp_path, new_weights)
    if name == "extra.safetensors":
        (path / INDEX).unlink()  # shards found by listing the directory
        (path / MANIFEST).unlink()
    else:
        (path / name).unlink()
    (path / name).symlink_to(path / name)
    assert_refused(update_on_fresh_engine(path, [tmp_path]), InvalidRequest, "symlink_loop")


def test_an_allowed_root_replaced_by_a_symlink_loop_allows_nothing(
    tmp_path: Path, new_weights: dict[str, torch.Tensor]
) -> None:
    root = tmp_path / "root"
    path = ckpt(root, new_weights)

    def replace_root(_: Path) -> None:  # after the dry run: the root is now a loop
        root.rename(tmp_path / "elsewhere")
        root.symlink_to(root)

    out = refusal(dry_run_then_update(path, [root], replace_root))
    assert out.code in ("symlink_loop", "path_not_allowed"), out


def test_a_shard_rewritten_in_place_just_before_the_copy_reopens_it_is_refused_unwritten(
    tmp_path: Path, new_weights: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = ckpt(tmp_path, new_weights)
    shard = only_shard(path)
    reopen = DiskCheckpoint.reopen

    def rewritten_first(self: DiskCheckpoint, header: ShardHeader) -> Any:
        # Same size, same inode, other bytes, and a modification time that moved on.
        st = shard.stat()
        with open(shard, "r+b") as f:
            f.seek(st.st_size - 4)
            f.write(b"\x7f\x7f\x7f\x7f")
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        monkeypatch.setattr(DiskCheckpoint, "reopen", reopen)
        return reopen(self, header)

    def arm(_: Path) -> None:  # after the dry run, so the update copies on its facts
        monkeypatch.setattr(DiskCheckpoint, "reopen", rewritten_first)

    result = dry_run_then_update(path, [tmp_path], arm)
    assert_refused(result, InvalidRequest, "corrupt_checkpoint")
    assert "changed since it was validated" in refusal(result).message


def test_a_shard_that_is_a_pseudo_file_is_refused_unread(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").symlink_to("/proc/self/status")  # says 0 bytes, reads text
    result = update_on_fresh_engine(tmp_path / "model.safetensors", None)
    assert_refused(result, InvalidRequest, "corrupt_checkpoint")
    assert "0 bytes, too short for a header" in refusal(result).message


@pytest.mark.parametrize(("name", "code"), [(INDEX, "bad_index"), (MANIFEST, "manifest_mismatch")])
def test_an_index_or_manifest_that_is_a_pseudo_file_is_refused_unread(
    tmp_path: Path, new_weights: dict[str, torch.Tensor], name: str, code: str
) -> None:
    path = ckpt(tmp_path, new_weights)
    (path / name).unlink()
    (path / name).symlink_to("/proc/self/status")
    result = update_on_fresh_engine(path, None)
    assert_refused(result, InvalidRequest, code)
    assert "the file is empty" in refusal(result).message


def grow_while_read(monkeypatch: pytest.MonkeyPatch, shard: Path) -> Callable[[], int]:
    """Make ``shard`` grow by a MiB each time the checksum pass reopens it; returns a count."""
    reopen = DiskCheckpoint.reopen
    grown = []

    def growing(self: DiskCheckpoint, header: ShardHeader) -> Any:
        f = reopen(self, header)
        with open(shard, "ab") as out:
            out.write(b"\0" * (1 << 20))
        grown.append(1)
        return f

    monkeypatch.setattr(DiskCheckpoint, "reopen", growing)
    return lambda: len(grown)


def test_a_shard_that_grows_while_it_is_read_is_refused_without_reading_on(
    tmp_path: Path, new_weights: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = ckpt(tmp_path, new_weights)
    grown = grow_while_read(monkeypatch, only_shard(path))
    result = update_on_fresh_engine(path, [tmp_path])
    assert_refused(result, InvalidRequest, "corrupt_checkpoint")
    assert "grew while it was read" in refusal(result).message and grown() == 1
