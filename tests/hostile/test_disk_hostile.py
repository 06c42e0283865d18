"""Hostile checkpoints on real files: every refusal is a 4xx of the family with nothing
written; a file changed, truncated or swapped for a FIFO mid-update never kills, wedges or
fools the worker."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save_file

from tests.helpers import TINY, WorkerProcess, hashes, perturbed
from tests.integration.test_disk import assert_refused, update_on_fresh_engine
from tests.integration.test_dry_run_facts import dry_run_then_update
from weightsync.core import (
    Declared,
    DiskSource,
    InvalidRequest,
    LoadFailed,
    WeightsTorn,
    WeightSyncError,
)
from weightsync.engines.reference import ModelConfig, ReferenceEngine
from weightsync.trainer import save_checkpoint
from weightsync.transports.disk import DiskCheckpoint
from weightsync.transports.disk import reader as reader_mod
from weightsync.transports.disk.reader import DiskReader
from weightsync.transports.hashing import tensor_hashes
from weightsync.transports.loading import load
from weightsync.transports.sink import PullTarget, TensorSink, pull

INDEX = "model.safetensors.index.json"
MANIFEST = "weightsync-manifest.json"
DEEP = "[" * 200_000 + "]" * 200_000


@pytest.fixture
def new_weights() -> dict[str, torch.Tensor]:
    return perturbed(ReferenceEngine(TINY).model.weights())


def raw_file(path: Path, header: str, data: int) -> Path:
    encoded = header.encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"\0" * data)
    return path


def entry(shape: str, offsets: str, dtype: str = "F32") -> str:
    return f'{{"dtype": "{dtype}", "shape": {shape}, "data_offsets": {offsets}}}'


# (header JSON, data bytes): each must be refused as corrupt_checkpoint before any write.
BAD_HEADERS = {
    "infinity_in_shape": ('{"w": ' + entry("[Infinity]", "[0, 4]") + "}", 4),
    "huge_float_offset": ('{"w": ' + entry("[1]", "[0, 1e400]") + "}", 4),
    "nan_in_shape": ('{"w": ' + entry("[NaN]", "[0, 4]") + "}", 4),
    "float_dimension": ('{"w": ' + entry("[512.9]", "[0, 2048]") + "}", 2048),
    "nested_200k_deep": ('{"w": ' + DEEP + "}", 0),
    "overlapping_offsets": ('{"a": ' + entry("[2]", "[0, 8]") + ', "b": ' + entry("[2]", "[4, 12]") + "}", 12),
    "gap_between_tensors": ('{"a": ' + entry("[1]", "[0, 4]") + ', "b": ' + entry("[1]", "[8, 12]") + "}", 12),
    "duplicate_tensor_name": ('{"w": ' + entry("[1]", "[0, 4]") + ', "w": ' + entry("[1]", "[0, 4]") + "}", 4),
    "metadata_not_strings": ('{"__metadata__": {"a": 1}, "w": ' + entry("[1]", "[0, 4]") + "}", 4),
    "offsets_not_a_pair": ('{"w": ' + entry("[1]", "[0, 4, 8]") + "}", 4),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD_HEADERS))
def test_hostile_header_is_refused_as_corrupt_without_writing(tmp_path: Path, case: str) -> None:
    header, data = BAD_HEADERS[case]
    raw_file(tmp_path / "model.safetensors", header, data)
    result = update_on_fresh_engine(tmp_path / "model.safetensors", [tmp_path])
    assert_refused(result, InvalidRequest, "corrupt_checkpoint")


def sharded(tmp_path: Path, weights: dict[str, torch.Tensor]) -> Path:
    return save_checkpoint(weights, tmp_path / "c", version="v1", shard_bytes=60_000)


def edit_json(path: Path, edit: Callable[[Any], Any]) -> None:
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


def test_index_nested_200k_deep_is_a_bad_index(tmp_path: Path, new_weights: dict[str, torch.Tensor]) -> None:
    ckpt = sharded(tmp_path, new_weights)
    (ckpt / INDEX).write_text('{"weight_map": ' + DEEP + "}")
    assert_refused(update_on_fresh_engine(ckpt, [tmp_path]), InvalidRequest, "bad_index")


def test_manifest_nested_200k_deep_is_a_manifest_mismatch(
    tmp_path: Path, new_weights: dict[str, torch.Tensor]
) -> None:
    ckpt = sharded(tmp_path, new_weights)
    text = (ckpt / MANIFEST).read_text()
    (ckpt / MANIFEST).write_text(text.replace('"version": "v1"', '"version": ' + DEEP))
    assert_refused(update_on_fresh_engine(ckpt, [tmp_path]), InvalidRequest, "manifest_mismatch")


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: {**m, "files": {k: "not an object" for k in m["files"]}},
        lambda m: {**m, "files": {k: {**v, "size": float(v["size"])} for k, v in m["files"].items()}},
        lambda m: {**m, "tensors": ["not", "an", "object"]},
        lambda m: {**m, "tensors": {**m["tensors"], "model.extra.weight": "0"}},
        lambda m: {**m, "files": dict(list(m["files"].items())[1:])},
        lambda m: [m],
    ],
    ids=["files_entry_is_a_string", "float_size", "tensors_not_an_object", "tensors_name_unknown_tensor",
         "file_missing_from_manifest", "not_an_object"],
)  # fmt: skip
def test_malformed_manifest_is_a_manifest_mismatch(
    tmp_path: Path, new_weights: dict[str, torch.Tensor], edit: Callable[[Any], Any]
) -> None:
    ckpt = sharded(tmp_path, new_weights)
    edit_json(ckpt / MANIFEST, edit)
    assert_refused(update_on_fresh_engine(ckpt, [tmp_path]), InvalidRequest, "manifest_mismatch")


@pytest.mark.parametrize(
    "weight_map",
    [lambda wm: list(wm), lambda wm: dict.fromkeys(wm, 5), lambda wm: dict.fromkeys(wm, "../c/x"),
     lambda wm: {}, lambda wm: dict.fromkeys(wm, "a\0b")],
    ids=["list", "file_is_a_number", "path_with_slash", "empty", "nul_in_name"],
)  # fmt: skip
def test_malformed_index_is_a_bad_index(
    tmp_path: Path, new_weights: dict[str, torch.Tensor], weight_map: Callable[[Any], Any]
) -> None:
    ckpt = sharded(tmp_path, new_weights)
    os.remove(ckpt / MANIFEST)
    edit_json(ckpt / INDEX, lambda index: {**index, "weight_map": weight_map(index["weight_map"])})
    assert_refused(update_on_fresh_engine(ckpt, [tmp_path]), InvalidRequest, "bad_index")


def test_index_splitting_tensors_between_a_shard_and_its_symlink_alias_is_a_bad_index(
    tmp_path: Path, new_weights: dict[str, torch.Tensor]
) -> None:
    save_file(new_weights, str(tmp_path / "model.safetensors"))
    (tmp_path / "alias.safetensors").symlink_to(tmp_path / "model.safetensors")
    names = sorted(new_weights)
    weight_map = {n: "alias.safetensors" if i % 2 else "model.safetensors" for i, n in enumerate(names)}
    (tmp_path / INDEX).write_text(json.dumps({"weight_map": weight_map}))
    assert_refused(update_on_fresh_engine(tmp_path, [tmp_path]), InvalidRequest, "bad_index")


def test_index_naming_only_a_symlink_alias_loads_the_shard_behind_it(
    tmp_path: Path, new_weights: dict[str, torch.Tensor]
) -> None:
    save_file(new_weights, str(tmp_path / "model.safetensors"))
    (tmp_path / "alias.safetensors").symlink_to("model.safetensors")
    (tmp_path / INDEX).write_text(json.dumps({"weight_map": dict.fromkeys(new_weights, "alias.safetensors")}))
    engine, _c, before, out = update_on_fresh_engine(tmp_path, [tmp_path])
    assert not isinstance(out, Exception), out
    assert hashes(engine) == tensor_hashes(new_weights.items()) != before


@pytest.mark.parametrize("bad", ["/tmp/a\0b", "/tmp/\ud800"], ids=["nul_byte", "lone_surrogate"])
def test_unencodable_model_path_is_an_invalid_value(tmp_path: Path, bad: str) -> None:
    assert_refused(update_on_fresh_engine(bad, [tmp_path]), InvalidRequest, "invalid_value")


def test_directory_named_like_a_shard_is_not_a_file(
    tmp_path: Path, new_weights: dict[str, torch.Tensor]
) -> None:
    save_file(new_weights, str(tmp_path / "a.safetensors"))
    (tmp_path / "x.safetensors").mkdir()
    assert_refused(update_on_fresh_engine(tmp_path, [tmp_path]), InvalidRequest, "not_a_file")


@pytest.mark.parametrize("target", ["outside", "/proc/self/mem"])
def test_globbed_shard_symlinked_outside_the_roots_is_refused(
    tmp_path: Path, new_weights: dict[str, torch.Tensor], target: str
) -> None:
    (tmp_path / "outside").mkdir()
    (tmp_path / "root" / "ckpt").mkdir(parents=True)
    save_file(new_weights, str(tmp_path / "outside" / "model.safetensors"))
    where = tmp_path / "outside" / "model.safetensors" if target == "outside" else Path(target)
    (tmp_path / "root" / "ckpt" / "model.safetensors").symlink_to(where)
    result = update_on_fresh_engine(tmp_path / "root" / "ckpt", [tmp_path / "root"])
    assert_refused(result, InvalidRequest, "path_not_allowed")


def test_index_and_manifest_symlinked_outside_the_roots_are_refused(
    tmp_path: Path, new_weights: dict[str, torch.Tensor]
) -> None:
    (tmp_path / "root").mkdir()
    ckpt = save_checkpoint(new_weights, tmp_path / "root" / "c", shard_bytes=60_000)
    outside = save_checkpoint(new_weights, tmp_path / "outside", shard_bytes=60_000)
    for name in (INDEX, MANIFEST):
        os.replace(ckpt / name, tmp_path / f"saved-{name}")
        (ckpt / name).symlink_to(outside / name)
        result = update_on_fresh_engine(ckpt, [tmp_path / "root"])
        assert_refused(result, InvalidRequest, "path_not_allowed")
        (ckpt / name).unlink()
        os.replace(tmp_path / f"saved-{name}", ckpt / name)


@pytest.mark.parametrize("what", ["shard_copy", "shard_hard_link", "directory"])
def test_a_file_swapped_for_a_symlink_outside_the_roots_after_the_dry_run_is_refused(
    tmp_path: Path, new_weights: dict[str, torch.Tensor], what: str
) -> None:
    """The update of a prepared checkpoint re-resolves every path against the roots: a shard
    (or the whole directory) swapped for a link out of them, even to the very same file, is
    refused before any write."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    ckpt = save_checkpoint(new_weights, root / "c", shard_bytes=60_000)
    victim = sorted(ckpt.glob("*.safetensors"))[-1]

    def swap(path: Path) -> None:
        if what == "directory":
            os.replace(path, outside / "c")
            path.symlink_to(outside / "c")
            return
        twin = outside / victim.name
        if what == "shard_hard_link":
            os.link(victim, twin)  # the same inode, reached from outside the roots
        else:
            twin.write_bytes(victim.read_bytes())
        victim.unlink()
        victim.symlink_to(twin)

    assert_refused(dry_run_then_update(ckpt, [root], swap), InvalidRequest, "path_not_allowed")


def test_a_link_redirected_out_of_the_roots_to_the_same_untouched_file_after_the_dry_run_is_refused(
    tmp_path: Path, new_weights: dict[str, torch.Tensor]
) -> None:
    """Nothing the checkpoint's files' identities would show: the shard is a link into a
    store directory, and after the dry run the store is swapped for a link out of the roots
    that reaches the same inode, untouched.  Only resolving the path again sees it."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "c").mkdir(parents=True)
    (root / "store").mkdir()
    outside.mkdir()
    save_file(new_weights, str(root / "store" / "model.safetensors"))
    os.link(root / "store" / "model.safetensors", outside / "model.safetensors")
    (root / "c" / "model.safetensors").symlink_to(root / "store" / "model.safetensors")

    def redirect(_: Path) -> None:
        os.replace(root / "store", root / "store-old")  # the file keeps its links and times
        (root / "store").symlink_to(outside)

    assert_refused(dry_run_then_update(root / "c", [root], redirect), InvalidRequest, "path_not_allowed")


def test_a_shard_swapped_for_a_fifo_after_the_dry_run_is_refused_promptly(
    tmp_path: Path, new_weights: dict[str, torch.Tensor]
) -> None:
    ckpt = save_checkpoint(new_weights, tmp_path / "c", shard_bytes=60_000)
    victim = sorted(ckpt.glob("*.safetensors"))[0]

    def swap(_: Path) -> None:
        victim.unlink()
        os.mkfifo(victim)

    t0 = time.monotonic()
    assert_refused(dry_run_then_update(ckpt, [tmp_path], swap), InvalidRequest, "not_a_file")
    assert time.monotonic() - t0 < 60  # no open blocked on the FIFO


def test_unexpected_exception_during_validation_is_a_4xx_refusal_not_a_tear(
    tmp_path: Path, new_weights: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    save_file(new_weights, str(tmp_path / "model.safetensors"))

    def broken(*args: Any, **kwargs: Any) -> list[str]:
        raise ZeroDivisionError("a validator bug")

    monkeypatch.setattr(reader_mod, "check_metadata", broken)
    engine, c, before, out = update_on_fresh_engine(tmp_path, [tmp_path])
    assert isinstance(out, WeightSyncError) and 400 <= out.http_status < 500, out
    assert hashes(engine) == before and not c.snapshot().torn
    sink = TensorSink({n: t.clone() for n, t in new_weights.items()})
    with pytest.raises(LoadFailed) as info:
        load(DiskReader(DiskSource(str(tmp_path))), sink)
    assert not info.value.wrote and info.value.cause is not None
    assert info.value.cause.http_status == 400


def test_hostile_checkpoints_answer_4xx_over_http_and_the_worker_stays_untorn(
    make_worker: Callable[..., Any], new_weights: dict[str, torch.Tensor]
) -> None:
    w = make_worker()
    w.client.pause_generation()
    raw_file(w.root / "inf.safetensors", '{"w": ' + entry("[Infinity]", "[0, 4]") + "}", 4)
    raw_file(w.root / "deep.safetensors", '{"w": ' + DEEP + "}", 0)
    for path, code in ((w.root / "inf.safetensors", "corrupt_checkpoint"),
                       (w.root / "deep.safetensors", "corrupt_checkpoint"),
                       (str(w.root) + "/\0", "invalid_value")):  # fmt: skip
        body = {"model_path": str(path)}
        r = httpx.post(f"{w.url}/engine/update_weights_from_disk", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["code"] == code, r.text
        assert not w.client.get_weight_version()["torn"]


# ---------------------------------------------------------------- bytes verified as copied


def load_into_sink(path: Path, targets: dict[str, torch.Tensor], **flags: Any) -> TensorSink:
    sink = TensorSink(targets)
    load(DiskReader(DiskSource(str(path), **flags)), sink)
    return sink


def test_writer_manifest_records_per_tensor_hashes(
    tmp_path: Path, new_weights: dict[str, torch.Tensor]
) -> None:
    ckpt = sharded(tmp_path, new_weights)
    assert json.loads((ckpt / MANIFEST).read_text())["tensors"] == tensor_hashes(new_weights.items())


@pytest.mark.parametrize("manifest", ["per_tensor", "files_only", "none"])
def test_sink_records_the_hash_of_every_tensor_as_written(
    tmp_path: Path, new_weights: dict[str, torch.Tensor], manifest: str
) -> None:
    ckpt = sharded(tmp_path, new_weights)
    if manifest == "files_only":
        edit_json(ckpt / MANIFEST, lambda m: {k: v for k, v in m.items() if k != "tensors"})
    elif manifest == "none":
        os.remove(ckpt / MANIFEST)
    targets = {n: torch.zeros_like(t) for n, t in new_weights.items()}
    sink = load_into_sink(ckpt, targets)
    assert sink.hashes == tensor_hashes(targets.items()) == tensor_hashes(new_weights.items())


def test_sink_hashes_describe_the_cast_weights_not_the_file(
    tmp_path: Path, new_weights: dict[str, torch.Tensor]
) -> None:
    save_file({n: t.half() for n, t in new_weights.items()}, str(tmp_path / "model.safetensors"))
    targets = {n: torch.zeros_like(t) for n, t in new_weights.items()}
    sink = load_into_sink(tmp_path, targets, allow_dtype_cast=True)
    assert sink.hashes == tensor_hashes(targets.items())
    assert targets["model.norm.weight"].equal(new_weights["model.norm.weight"].half().float())


def rewrite_after_verification(monkeypatch: pytest.MonkeyPatch, victim: Path) -> None:
    """Between the checksum pass and the copy, rewrite ``victim`` in place, same size."""
    verify = DiskCheckpoint.verify_checksums

    def verify_then_rewrite(self: DiskCheckpoint) -> dict[str, str]:
        hashes = verify(self)
        st = victim.stat()
        data = bytearray(victim.read_bytes())
        for i in range(len(data) - 64, len(data)):
            data[i] ^= 0x55
        with victim.open("r+b") as f:  # in place: same file, same size
            f.write(bytes(data))
        # A later time, as a rewrite has (the clock that stamps files may not have ticked yet).
        os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        return hashes

    monkeypatch.setattr(DiskCheckpoint, "verify_checksums", verify_then_rewrite)


@pytest.mark.parametrize("manifest", ["per_tensor", "files_only"])
def test_shard_rewritten_after_verification_tears_instead_of_committing(
    tmp_path: Path, new_weights: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch, manifest: str
) -> None:
    ckpt = sharded(tmp_path, new_weights)
    if manifest == "files_only":  # a manifest written before per-tensor hashes existed
        edit_json(ckpt / MANIFEST, lambda m: {k: v for k, v in m.items() if k != "tensors"})
    rewrite_after_verification(monkeypatch, sorted(ckpt.glob("*.safetensors"))[-1])
    engine, c, before, out = update_on_fresh_engine(ckpt, [tmp_path])
    assert isinstance(out, WeightsTorn), out
    assert "changed since it was validated" in out.message or "manifest" in out.message
    snap = c.snapshot()
    assert snap.torn and snap.version == Declared("v0")
    assert hashes(engine) != before  # the shards before it were copied: torn is the honest report


@pytest.mark.parametrize("manifest", ["per_tensor", "files_only"])
def test_first_shard_rewritten_after_verification_is_refused_before_any_write(
    tmp_path: Path, new_weights: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch, manifest: str
) -> None:
    # The copy reopens the shard before reading it and finds its modification time moved on
    # (same size, same inode): nothing was copied yet, so nothing tears.
    ckpt = sharded(tmp_path, new_weights)
    if manifest == "files_only":
        edit_json(ckpt / MANIFEST, lambda m: {k: v for k, v in m.items() if k != "tensors"})
    rewrite_after_verification(monkeypatch, sorted(ckpt.glob("*.safetensors"))[0])
    result = update_on_fresh_engine(ckpt, [tmp_path])
    assert_refused(result, InvalidRequest, "corrupt_checkpoint")
    assert "changed since it was validated" in result[3].message


def test_stream_refuses_a_tensor_rewritten_after_verification(
    tmp_path: Path, new_weights: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt_path = sharded(tmp_path, new_weights)
    ckpt = DiskCheckpoint.open(str(ckpt_path))
    ckpt.verify_checksums()
    victim = sorted(ckpt_path.glob("*.safetensors"))[-1]

    def flip() -> None:
        data = bytearray(victim.read_bytes())
        data[-1] ^= 0xFF
        with victim.open("r+b") as f:
            f.write(bytes(data))

    reopen = DiskCheckpoint.reopen

    def reopen_then_flip(self: DiskCheckpoint, shard: Any) -> Any:
        f = reopen(self, shard)
        if shard.path == victim.resolve():  # after the reopen's identity check: only the hash sees it
            flip()
        return f

    monkeypatch.setattr(DiskCheckpoint, "reopen", reopen_then_flip)
    target = PullTarget()
    with pytest.raises(InvalidRequest) as info:
        for _ in pull(ckpt.copy_into(target), target):
            pass
    assert info.value.code == "manifest_mismatch"
    monkeypatch.setattr(DiskCheckpoint, "reopen", reopen)
    st = victim.stat()
    flip()  # before the reopen: the file's times moved on, so it is refused unread
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    target = PullTarget()
    with pytest.raises(InvalidRequest) as info:
        for _ in pull(ckpt.copy_into(target), target):
            pass
    assert info.value.code == "corrupt_checkpoint" and "changed since" in info.value.message


def test_streamed_tensors_stay_valid_after_the_stream_moves_on(
    tmp_path: Path, new_weights: dict[str, torch.Tensor]
) -> None:
    ckpt = DiskCheckpoint.open(str(sharded(tmp_path, new_weights)))
    target = PullTarget()
    held = list(
        pull(ckpt.copy_into(target), target)
    )  # a consumer that keeps every tensor (vLLM fuses q/k/v later)
    assert len(held) == len(new_weights)
    assert tensor_hashes(held) == tensor_hashes(new_weights.items())


# ---------------------------------------------------------------- real worker processes


def post(url: str, route: str, body: dict[str, Any], timeout: float = 15) -> httpx.Response:
    return httpx.post(f"{url}/engine/{route}", json=body, timeout=timeout)


def test_fifo_as_shard_index_or_manifest_is_refused_promptly_and_the_worker_serves_on(
    tmp_path: Path, new_weights: dict[str, torch.Tensor]
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    fifo_shard = root / "fifo-shard"
    fifo_shard.mkdir()
    os.mkfifo(fifo_shard / "model.safetensors")
    cases = {"shard": fifo_shard}
    for name in (INDEX, MANIFEST):
        ckpt = save_checkpoint(new_weights, root / f"fifo-{name}", shard_bytes=60_000)
        os.remove(ckpt / name)
        os.mkfifo(ckpt / name)
        cases[name] = ckpt
    good = save_checkpoint(new_weights, root / "good", shard_bytes=60_000)
    worker = WorkerProcess("--allowed-weight-dir", str(root)).wait_ready()
    try:
        assert post(worker.url, "pause_generation", {}).status_code == 200
        for what, path in cases.items():
            t0 = time.monotonic()
            r = post(worker.url, "update_weights_from_disk", {"model_path": str(path)})
            assert r.status_code == 400 and r.json()["code"] == "not_a_file", (what, r.text)
            assert time.monotonic() - t0 < 10, what
            state = post(worker.url, "get_weight_version", {}).json()
            assert not state["torn"] and not state["update_in_flight"], what
        r = post(worker.url, "update_weights_from_disk", {"model_path": str(good), "weight_version": "good"})
        assert r.status_code == 200, r.text
    finally:
        worker.stop()


TRUNCATOR = r"""
import os, signal, sys
pid, victim, keep, threshold = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
seen_open_at = None  # the reader's byte count (positional reads included) when it had the file open
def read_bytes():
    with open(f"/proc/{pid}/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("rchar:"))
def reading():
    global seen_open_at
    try:
        with open(f"/proc/{pid}/maps") as maps:
            if victim in maps.read():  # a mapping of the file (mmap readers)
                return "mapped"
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") != victim:
                    continue
                with open(f"/proc/{pid}/fdinfo/{fd}") as info:
                    pos = int(info.readline().split()[1])
                rchar = read_bytes()
            except OSError:
                continue
            if pos > threshold:  # past the header: the copy has begun
                return f"read to {pos}"
            if seen_open_at is None:
                seen_open_at = rchar
            elif rchar - seen_open_at > threshold:  # positional reads leave pos alone
                return f"read {rchar - seen_open_at} bytes since it was open"
    except OSError:
        pass
    return None
print("ready", flush=True)
while not (how := reading()):
    pass
os.kill(pid, signal.SIGSTOP)  # freeze it mid-copy, cut the file, let it run on
os.truncate(victim, keep)
os.kill(pid, signal.SIGCONT)
print("truncated while", how, flush=True)
"""


def test_shard_truncated_by_another_process_mid_load_fails_cleanly_and_the_worker_lives(
    tmp_path: Path,
) -> None:
    config = ModelConfig()  # the serve default: ~95 MB of float32
    weights = perturbed(ReferenceEngine(config).model.weights())
    root = tmp_path / "root"
    (root / "big").mkdir(parents=True)
    victim = root / "big" / "model.safetensors"
    good = save_checkpoint(weights, root / "good")
    worker = WorkerProcess("--allowed-weight-dir", str(root), model_config="default").wait_ready()
    try:
        assert post(worker.url, "pause_generation", {}).status_code == 200
        for _attempt in range(5):  # the cut must land inside the copy; retry if the load won
            save_file(weights, str(victim))  # no manifest: validation reads only the header
            data_start = 8 + struct.unpack("<Q", victim.read_bytes()[:8])[0]
            cutter = subprocess.Popen(
                [sys.executable, "-c", TRUNCATOR, str(worker.proc.pid), os.path.realpath(victim), str(data_start + 4096),
                 str(data_start)],
                stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            assert cutter.stdout is not None and cutter.stdout.readline() == "ready\n"
            try:
                body = {"model_path": str(victim.parent), "weight_version": "big"}
                r = post(worker.url, "update_weights_from_disk", body, 60)
            except httpx.HTTPError:
                r = None  # the worker died (SIGBUS on a mapping)
            finally:
                try:
                    cut, _ = cutter.communicate(timeout=3)  # it may be just past its cut
                except subprocess.TimeoutExpired:
                    cutter.kill()
                    cut, _ = cutter.communicate(timeout=30)
            print(f"attempt {_attempt}: {cut.strip()!r} -> {r.text[:200] if r else 'no answer'}")
            if r is None or (cutter.returncode == 0 and r.status_code != 200):
                break
        else:
            pytest.fail("the truncation never overlapped the copy")
        assert worker.proc.poll() is None, f"the worker died: {worker.proc.returncode} after {cut.strip()}"
        assert r is not None
        assert httpx.get(f"{worker.url}/health", timeout=10).status_code == 200
        state = post(worker.url, "get_weight_version", {}).json()
        if r.status_code == 500:  # part was copied before the cut: honestly torn
            assert r.json()["code"] == "weights_torn" and state["torn"], r.text
            assert "shrank" in r.json()["message"], r.text
        else:
            assert 400 <= r.status_code < 500 and not state["torn"], r.text
        assert state["version"] != "big"
        r = post(
            worker.url, "update_weights_from_disk", {"model_path": str(good), "weight_version": "good"}, 60
        )
        assert r.status_code == 200, r.text
        assert not post(worker.url, "get_weight_version", {}).json()["torn"]
    finally:
        if worker.proc.poll() is None:
            os.kill(worker.proc.pid, signal.SIGCONT)
        worker.stop()
