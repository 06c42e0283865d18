"""Verify while serving: what a dry run verified of a checkpoint is reused by the update
that follows it (one copy in the pause window), only while the files are unchanged, and a
file rewritten after the dry run tears the load instead of committing it."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tests.helpers import TINY, hashes, perturbed, run
from weightsync.core import (
    Controller,
    Declared,
    DiskSource,
    InvalidRequest,
    PauseRequest,
    UpdateRequest,
    WeightsTorn,
    WeightSyncError,
)
from weightsync.core.held import weights_digest
from weightsync.engines.reference import ModelConfig, ReferenceEngine
from weightsync.trainer import save_checkpoint
from weightsync.transports.disk import DiskCheckpoint
from weightsync.transports.disk.copy_loop import copy_into
from weightsync.transports.disk.facts import FactsStore
from weightsync.transports.disk.format import ShardHeader
from weightsync.transports.disk.manifest import INDEX_NAME, MANIFEST_NAME, Index, Manifest
from weightsync.transports.hashing import tensor_hashes
from weightsync.transports.sink import TensorSink

Edit = Callable[[Path], None]


@pytest.fixture
def new_weights() -> dict[str, torch.Tensor]:
    return perturbed(ReferenceEngine(TINY).model.weights())


def count_checksum_passes(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Record every up-front checksum pass (the checkpoint it read)."""
    passes: list[Path] = []
    verify = DiskCheckpoint.verify_checksums

    def counted(self: DiskCheckpoint) -> dict[str, str]:
        passes.append(self.root)
        return verify(self)

    monkeypatch.setattr(DiskCheckpoint, "verify_checksums", counted)
    return passes


def dry_run_then_update(
    path: Path, roots: list[Path], between: Edit | None = None, *, dry_run: bool = True
) -> tuple[ReferenceEngine, Controller, dict[str, str], Any]:
    """On a fresh running engine: a dry run of ``path`` (while running), ``between(path)``,
    then pause and update.  Returns the engine, controller, hashes before, outcome or error."""

    async def main() -> tuple[ReferenceEngine, Controller, dict[str, str], Any]:
        engine = ReferenceEngine(TINY, allowed_weight_dirs=roots)
        c = Controller(engine, version=Declared("v0"))
        before = hashes(engine)
        request = UpdateRequest(DiskSource(str(path)), Declared("v1"))
        if dry_run:
            await c.dry_run(request)
        if between is not None:
            between(path)
        await c.pause(PauseRequest())
        try:
            out: Any = await c.update(request)
        except WeightSyncError as exc:
            out = exc
        await engine.close()
        return engine, c, before, out

    return run(main())


def shards(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors")) if path.is_dir() else [path]


def flip_last_bytes(victim: Path) -> None:
    """Rewrite the last 64 bytes of ``victim`` in place (same file, same size)."""
    data = bytearray(victim.read_bytes())
    for i in range(len(data) - 64, len(data)):
        data[i] ^= 0x55
    with victim.open("r+b") as f:
        f.write(bytes(data))


def checkpoint(tmp_path: Path, weights: dict[str, torch.Tensor], kind: str) -> Path:
    """A checkpoint with our manifest (two shards), or a bare safetensors file without one."""
    if kind == "manifest":
        return save_checkpoint(weights, tmp_path / "ckpt", shard_bytes=60_000)
    save_file(weights, str(tmp_path / "model.safetensors"))
    return tmp_path / "model.safetensors"


@pytest.mark.parametrize("kind", ["manifest", "bare"])
def test_an_update_after_a_dry_run_skips_the_checksum_pass_and_loads_verified_bytes(
    tmp_path: Path, new_weights: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    path = checkpoint(tmp_path, new_weights, kind)
    passes = count_checksum_passes(monkeypatch)
    engine, c, _, out = dry_run_then_update(path, [tmp_path])
    assert not isinstance(out, Exception), out
    assert passes == [path if path.is_dir() else path.parent]  # the dry run's, not the update's
    assert out.stats.extra["prepared"] is True
    assert hashes(engine) == tensor_hashes(new_weights.items())
    assert c.snapshot().version == Declared("v1")
    assert c.snapshot().digest == weights_digest(tensor_hashes(new_weights.items()))


def test_an_update_without_a_dry_run_still_verifies_up_front(
    tmp_path: Path, new_weights: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = checkpoint(tmp_path, new_weights, "manifest")
    passes = count_checksum_passes(monkeypatch)
    engine, _, _, out = dry_run_then_update(path, [tmp_path], dry_run=False)
    assert not isinstance(out, Exception), out
    assert passes == [path] and out.stats.extra["prepared"] is False
    assert hashes(engine) == tensor_hashes(new_weights.items())


@pytest.mark.parametrize("kind", ["manifest", "bare"])
@pytest.mark.parametrize("which", [0, -1], ids=["first_shard", "last_shard"])
def test_a_file_rewritten_after_the_dry_run_tears_and_is_never_committed(
    tmp_path: Path,
    new_weights: dict[str, torch.Tensor],
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
    which: int,
) -> None:
    """The rewrite lands after the copy reopened the file and checked its identity (the race
    no cheap check can see): the copy's own hashing catches it, after the first write.  (One
    that lands before the reopen changes the file's times: see tests/hostile/test_disk_review.py.)"""
    path = checkpoint(tmp_path, new_weights, kind)
    victim = shards(path)[which]
    reopen = DiskCheckpoint.reopen

    def reopen_then_rewrite(self: DiskCheckpoint, shard: ShardHeader) -> Any:
        f = reopen(self, shard)
        if shard.path == victim.resolve():
            flip_last_bytes(victim)
        return f

    def arm(_: Path) -> None:  # after the dry run: the update copies on its facts
        monkeypatch.setattr(DiskCheckpoint, "reopen", reopen_then_rewrite)

    engine, c, before, out = dry_run_then_update(path, [tmp_path], arm)
    assert isinstance(out, WeightsTorn), out
    assert out.code == "weights_torn" and "changed after it was verified" in out.message
    snap = c.snapshot()
    assert snap.torn and snap.version == Declared("v0")
    assert hashes(engine) != before  # part was copied: torn is the honest report


def count_reads(monkeypatch: pytest.MonkeyPatch, reads: list[str]) -> None:
    """From now on, record in ``reads`` every header, index and manifest read."""
    for owner, name in [(ShardHeader, "read"), (Index, "from_index_file"), (Manifest, "from_manifest_file")]:
        original = getattr(owner, name)

        def counted(*args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
            reads.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)


@pytest.mark.parametrize("kind", ["manifest", "bare"])
def test_an_update_of_an_untouched_checkpoint_reads_no_header_index_or_manifest_again(
    tmp_path: Path, new_weights: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Every check that does not depend on the bytes was made by the dry run: the pause
    window only resolves the paths again and compares the files' identities."""
    path = checkpoint(tmp_path, new_weights, kind)
    reads: list[str] = []
    engine, c, _, out = dry_run_then_update(path, [tmp_path], lambda _: count_reads(monkeypatch, reads))
    assert not isinstance(out, Exception), out
    assert reads == []
    assert out.stats.extra["prepared"] is True and out.stats.extra["prepared_check"] == "identities"
    assert hashes(engine) == tensor_hashes(new_weights.items())
    assert c.snapshot().digest == weights_digest(tensor_hashes(new_weights.items()))


def add_a_file_beside(path: Path) -> None:
    (path / "README.md").write_text("notes")


def replace_the_manifest_by_a_copy(path: Path) -> None:
    copy = path / "manifest.tmp"
    copy.write_bytes((path / MANIFEST_NAME).read_bytes())
    os.replace(copy, path / MANIFEST_NAME)


def touch_the_index(path: Path) -> None:
    st = (path / INDEX_NAME).stat()
    os.utime(path / INDEX_NAME, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


@pytest.mark.parametrize("edit", [add_a_file_beside, replace_the_manifest_by_a_copy, touch_the_index])
def test_a_changed_identity_beside_the_shards_rechecks_the_headers_and_still_copies_once(
    tmp_path: Path, new_weights: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch, edit: Edit
) -> None:
    path = checkpoint(tmp_path, new_weights, "manifest")
    passes = count_checksum_passes(monkeypatch)
    engine, _, _, out = dry_run_then_update(path, [tmp_path], edit)
    assert not isinstance(out, Exception), out
    assert passes == [path]  # the dry run's only
    assert out.stats.extra["prepared"] is True and out.stats.extra["prepared_check"] == "headers"
    assert hashes(engine) == tensor_hashes(new_weights.items())


def touch_later(victim: Path) -> None:
    st = victim.stat()
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def rewrite_in_place_keeping_the_mtime(victim: Path) -> None:
    st = victim.stat()
    flip_last_bytes(victim)
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))  # only the change time moves


@pytest.mark.parametrize(
    "edit", [touch_later, rewrite_in_place_keeping_the_mtime], ids=["mtime", "ctime_only"]
)
def test_a_changed_file_time_invalidates_the_facts(
    tmp_path: Path, new_weights: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch, edit: Edit
) -> None:
    path = checkpoint(tmp_path, new_weights, "manifest")
    passes = count_checksum_passes(monkeypatch)
    engine, c, before, out = dry_run_then_update(path, [tmp_path], lambda p: edit(shards(p)[-1]))
    assert len(passes) == 2  # the update verified again, up front
    if edit is touch_later:  # same bytes: it loads, unprepared
        assert not isinstance(out, Exception), out
        assert out.stats.extra["prepared"] is False
        assert hashes(engine) == tensor_hashes(new_weights.items())
    else:  # the new bytes fail the manifest before the first write
        assert isinstance(out, InvalidRequest) and out.code == "manifest_mismatch", out
        assert hashes(engine) == before and not c.snapshot().torn


def test_a_file_that_changed_size_after_the_dry_run_is_refused_before_any_write(
    tmp_path: Path, new_weights: dict[str, torch.Tensor]
) -> None:
    path = checkpoint(tmp_path, new_weights, "bare")

    def grow(p: Path) -> None:
        with p.open("ab") as f:
            f.write(b"\0" * 8)

    engine, c, before, out = dry_run_then_update(path, [tmp_path], grow)
    assert isinstance(out, InvalidRequest) and out.code == "corrupt_checkpoint", out
    assert hashes(engine) == before and not c.snapshot().torn


def test_a_checkpoint_replaced_after_the_dry_run_loads_what_is_there_now(
    tmp_path: Path, new_weights: dict[str, torch.Tensor]
) -> None:
    """A trainer that overwrites the checkpoint after the dry run (new file, new identity):
    the facts no longer apply, and the update loads the new weights, verified as usual."""
    path = checkpoint(tmp_path, new_weights, "bare")
    newer = perturbed(new_weights, seed=7)
    engine, c, _, out = dry_run_then_update(path, [tmp_path], lambda p: save_file(newer, str(p)))
    assert not isinstance(out, Exception), out
    assert out.stats.extra["prepared"] is False
    assert hashes(engine) == tensor_hashes(newer.items())
    assert c.snapshot().digest == weights_digest(tensor_hashes(newer.items()))


def test_facts_are_kept_for_a_few_checkpoints_only(tmp_path: Path) -> None:
    weights = ReferenceEngine(ModelConfig.tiny()).model.weights()
    store = FactsStore(keep=2)
    paths = [save_checkpoint(perturbed(weights, seed=i), tmp_path / f"c{i}") for i in range(3)]
    from weightsync.transports.disk.facts import Facts

    for p in paths:
        ckpt = DiskCheckpoint.open(str(p))
        store.remember(Facts.from_verified(ckpt, ckpt.verify_checksums()))
    assert store.recall(DiskCheckpoint.open(str(paths[0]))) is None
    assert store.recall(DiskCheckpoint.open(str(paths[2]))) is not None


def test_a_dry_run_reading_a_checkpoint_holds_up_no_other_command(
    tmp_path: Path, new_weights: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dry run of a checkpoint without a manifest reads every byte; while it reads, a
    declare, a pause and an update (of a checkpoint that needs no up-front pass) go ahead."""
    path = checkpoint(tmp_path, new_weights, "bare")
    reading, release = threading.Event(), threading.Event()
    verify = DiskCheckpoint.verify_checksums

    def held_up(self: DiskCheckpoint) -> dict[str, str]:
        reading.set()
        assert release.wait(120), "never released"
        return verify(self)

    monkeypatch.setattr(DiskCheckpoint, "verify_checksums", held_up)

    async def main() -> None:
        engine = ReferenceEngine(TINY, allowed_weight_dirs=[tmp_path])
        c = Controller(engine, version=Declared("v0"))
        request = UpdateRequest(DiskSource(str(path)), Declared("v1"))
        dry = asyncio.ensure_future(c.dry_run(request))
        try:
            assert await asyncio.to_thread(reading.wait, 60)
            await asyncio.wait_for(c.declare(Declared("v0b")), 30)
            await asyncio.wait_for(c.pause(PauseRequest()), 30)
            out = await asyncio.wait_for(c.update(request), 60)  # bare: no checksum pass
            assert out.stats.extra["prepared"] is False and not dry.done()
            assert c.snapshot().version == Declared("v1") and c.snapshot().paused
        finally:
            release.set()
        outcome = await asyncio.wait_for(dry, 60)  # accepted; no manifest: the digest it read
        assert outcome.digest == weights_digest(tensor_hashes(new_weights.items()))
        assert outcome.snapshot.version == Declared("v1")
        await engine.close()

    run(main())


def test_concurrent_dry_runs_read_one_at_a_time_and_hold_up_no_other_command(
    tmp_path: Path, new_weights: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several dry runs at once each read a whole checkpoint: they read one after another
    (so they cannot take every thread the engine's calls need), and while the first one
    reads, a declare and a pause go ahead."""
    path = checkpoint(tmp_path, new_weights, "bare")
    reading, release = threading.Event(), threading.Event()
    lock = threading.Lock()
    active, most = [0], [0]
    verify = DiskCheckpoint.verify_checksums

    def held_up(self: DiskCheckpoint) -> dict[str, str]:
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        reading.set()
        try:
            assert release.wait(120), "never released"
            return verify(self)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(DiskCheckpoint, "verify_checksums", held_up)

    async def main() -> None:
        engine = ReferenceEngine(TINY, allowed_weight_dirs=[tmp_path])
        c = Controller(engine, version=Declared("v0"))
        request = UpdateRequest(DiskSource(str(path)), Declared("v1"))
        dry = [asyncio.ensure_future(c.dry_run(request)) for _ in range(4)]
        try:
            assert await asyncio.to_thread(reading.wait, 60)
            await asyncio.wait_for(c.declare(Declared("v0b")), 30)
            await asyncio.wait_for(c.pause(PauseRequest()), 30)
            assert c.snapshot().version == Declared("v0b") and c.snapshot().paused
            assert not any(d.done() for d in dry) and most[0] == 1
        finally:
            release.set()
        outcomes = await asyncio.wait_for(asyncio.gather(*dry), 120)
        read = weights_digest(tensor_hashes(new_weights.items()))  # no manifest: computed
        assert [o.digest for o in outcomes] == [read] * 4 and most[0] == 1
        await engine.close()

    run(main())


@pytest.mark.parametrize("readers", [1, 2])
def test_the_copy_reads_every_tensor_into_the_target_and_refuses_bytes_that_changed(
    tmp_path: Path, new_weights: dict[str, torch.Tensor], readers: int
) -> None:
    """One reader reads in the loop's own thread, more read several tensors at once: both
    fill the target exactly and check every tensor against the hashes found before."""
    path = checkpoint(tmp_path, new_weights, "manifest")
    ckpt = DiskCheckpoint.open(str(path))
    expected = ckpt.verify_checksums()
    engine = ReferenceEngine(TINY)
    sink = TensorSink(engine.model.weights())
    for _ in copy_into(ckpt, sink, expected=expected, readers=readers):
        pass
    assert hashes(engine) == tensor_hashes(new_weights.items()) == sink.written_hashes()
    last = next(reversed(list(ckpt.entries))).spec.name
    wrong = {**expected, last: "0" * 16}  # what the bytes no longer are
    with pytest.raises(InvalidRequest) as caught:
        for _ in copy_into(ckpt, TensorSink(engine.model.weights()), expected=wrong, readers=readers):
            pass
    assert caught.value.code == "manifest_mismatch"
    victim = shards(path)[-1]
    st = victim.stat()
    flip_last_bytes(victim)  # a file rewritten since it was opened is refused on reopen
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # (a later time)
    with pytest.raises(InvalidRequest) as caught:
        for _ in copy_into(ckpt, TensorSink(engine.model.weights()), expected=expected, readers=readers):
            pass
    assert caught.value.code == "corrupt_checkpoint" and "changed since" in caught.value.message
