"""Hostile deltas: every one is refused before a byte is written (or undone), and the worker
stays exactly on its base: same bytes, same digest, same label, not torn."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from tests.delta_helpers import Worker, base_weights, changed, delta_worker, write_delta
from weightsync.trainer.digest import weights_digest
from weightsync.transports.delta.manifest import DeltaManifest
from weightsync.transports.disk.manifest import DELTA_NAME
from weightsync.transports.hashing import tensor_hashes

Payload = dict[str, torch.Tensor]


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[Worker]:
    with delta_worker(tmp_path) as w:
        yield w


def assert_on_base(worker: Worker, base: Payload) -> None:
    state = worker.state()
    assert (state["version"], state["torn"], state["digest"]) == ("A", False, weights_digest(base))
    assert worker.held() == tensor_hashes(base.items())


def first_indices(m: DeltaManifest, payload: Payload) -> torch.Tensor:
    return payload[m.changed[0].indices or ""]


def _out_of_range(m: DeltaManifest, p: Payload) -> None:
    first_indices(m, p)[-1] = m.changed[0].numel


def _negative(m: DeltaManifest, p: Payload) -> None:
    first_indices(m, p)[0] = -1


def _duplicated(m: DeltaManifest, p: Payload) -> None:
    idx = first_indices(m, p)
    idx[1] = idx[0]


def _unsorted(m: DeltaManifest, p: Payload) -> None:
    idx = first_indices(m, p)
    idx[0], idx[1] = int(idx[1]), int(idx[0])


def _count_lies(m: DeltaManifest, p: Payload) -> DeltaManifest:
    entry = m.changed[0]
    return attrs.evolve(m, tensors={**m.tensors, entry.name: attrs.evolve(entry, changed=entry.changed - 1)})


def _values_short(m: DeltaManifest, p: Payload) -> None:
    key = m.changed[0].values or ""
    p[key] = p[key][:-1].clone()


def _nan(m: DeltaManifest, p: Payload) -> None:
    p[m.changed[-1].values or ""][0] = float("nan")


def _wrong_dtype(m: DeltaManifest, p: Payload) -> None:
    key = m.changed[0].values or ""
    p[key] = p[key].to(torch.float64)


def _float_indices(m: DeltaManifest, p: Payload) -> None:
    key = m.changed[0].indices or ""
    p[key] = p[key].to(torch.float32)


PAYLOAD_LIES: dict[str, Callable[[DeltaManifest, Payload], DeltaManifest | None]] = {
    "index out of range": _out_of_range,
    "negative index": _negative,
    "duplicated index": _duplicated,
    "unsorted indices": _unsorted,
    "a values count that lies": _count_lies,
    "fewer values than indices": _values_short,
    "NaN value": _nan,
    "values of another dtype": _wrong_dtype,
    "float indices": _float_indices,
}


@pytest.mark.parametrize("lie", sorted(PAYLOAD_LIES))
def test_a_lying_payload_is_refused_before_any_write(worker: Worker, tmp_path: Path, lie: str) -> None:
    base = base_weights()
    path = write_delta(base, changed(base), tmp_path / "d", edit=PAYLOAD_LIES[lie])
    r = worker.post("update_weights_from_delta", delta_path=str(path), weight_version="B")
    assert r.status_code == 400 and r.json()["code"] == "bad_delta", r.text
    assert "undone" not in r.json().get("details", {})  # refused, not written then undone
    assert_on_base(worker, base)


def test_an_xor_that_makes_nan_is_refused_before_any_write(worker: Worker, tmp_path: Path) -> None:
    base = base_weights()

    def to_nan(m: DeltaManifest, p: Payload) -> None:
        entry = m.changed[0]
        idx = p[entry.indices or ""][0]
        old = base[entry.name].reshape(-1)[idx : idx + 1]
        nan = torch.tensor([float("nan")], dtype=old.dtype)
        p[entry.values or ""][0] = torch.bitwise_xor(old.view(torch.int32), nan.view(torch.int32)).view(
            old.dtype
        )[0]

    path = write_delta(base, changed(base), tmp_path / "d", encoding="xor", edit=to_nan)
    r = worker.post("update_weights_from_delta", delta_path=str(path), weight_version="B")
    assert r.status_code == 400 and r.json()["code"] == "bad_delta", r.text
    assert_on_base(worker, base)


def _payload_file(path: Path) -> Path:
    return next(path.glob("*.safetensors"))


def test_a_truncated_payload_is_refused(worker: Worker, tmp_path: Path) -> None:
    base = base_weights()
    path = write_delta(base, changed(base), tmp_path / "d")
    f = _payload_file(path)
    os.truncate(f, f.stat().st_size - 8)
    r = worker.post("update_weights_from_delta", delta_path=str(path), weight_version="B")
    assert r.status_code == 400 and r.json()["code"] in ("corrupt_checkpoint", "manifest_mismatch"), r.text
    assert_on_base(worker, base)


def test_a_rewritten_payload_byte_is_refused(worker: Worker, tmp_path: Path) -> None:
    base = base_weights()
    path = write_delta(base, changed(base), tmp_path / "d")
    f = _payload_file(path)
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x40  # a value's bits, same size: only the checksum can tell
    f.write_bytes(bytes(data))
    r = worker.post("update_weights_from_delta", delta_path=str(path), weight_version="B")
    assert r.status_code == 400 and r.json()["code"] == "manifest_mismatch", r.text
    assert_on_base(worker, base)


def _rewrite_manifest(path: Path, change: Callable[[dict[str, Any]], Any]) -> None:
    f = path / DELTA_NAME
    value = json.loads(f.read_text())
    out = change(value)
    f.write_text(out if isinstance(out, str) else json.dumps(value))


def _first_changed(value: dict[str, Any]) -> dict[str, Any]:
    return next(e for e in value["tensors"].values() if e["changed"])


MANIFEST_LIES: dict[str, tuple[Callable[[dict[str, Any]], Any], int, str]] = {
    "a base digest that is not its hashes'": (lambda v: v["base"].update(digest="0" * 32), 400, "bad_delta"),
    "a target digest that is not its hashes'": (
        lambda v: v["target"].update(digest="0" * 32),
        400,
        "bad_delta",
    ),
    "another format": (lambda v: v.update(format="weightsync-delta/9"), 400, "bad_delta"),
    "an unknown encoding": (lambda v: v.update(encoding="zstd"), 400, "bad_delta"),
    "an unknown field": (lambda v: v.update(extra=1), 400, "bad_delta"),
    "a tensor's shape as a string": (lambda v: _first_changed(v).update(shape="[2, 2]"), 400, "bad_delta"),
    "a linear digest out of range": (
        lambda v: _first_changed(v).update(base_linear=[2**31, 0]),
        400,
        "bad_delta",
    ),
    "not JSON": (lambda v: "{not json", 400, "bad_delta"),
    "deeply nested JSON": (lambda v: "[" * 100_000 + "]" * 100_000, 400, "bad_delta"),
    "an empty file": (lambda v: "", 400, "bad_delta"),
    "NaN in JSON": (
        lambda v: re.sub(r'"changed": \d+', '"changed": NaN', json.dumps(v), count=1),
        400,
        "bad_delta",
    ),
}


@pytest.mark.parametrize("lie", sorted(MANIFEST_LIES))
def test_a_lying_manifest_is_refused(worker: Worker, tmp_path: Path, lie: str) -> None:
    change, status, code = MANIFEST_LIES[lie]
    base = base_weights()
    path = write_delta(base, changed(base), tmp_path / "d")
    _rewrite_manifest(path, change)
    r = worker.post("update_weights_from_delta", delta_path=str(path), weight_version="B")
    assert (r.status_code, r.json()["code"]) == (status, code), r.text
    assert_on_base(worker, base)


def test_a_consistent_manifest_for_another_base_is_base_mismatch(worker: Worker, tmp_path: Path) -> None:
    """Hashes and digest rewritten together (a delta made for other weights): the digests agree
    with the hashes, so only the base check can refuse it."""
    base = base_weights()
    other = changed(base, 0.001, seed=5)
    path = write_delta(other, changed(other), tmp_path / "d", base_version="A")
    r = worker.post("update_weights_from_delta", delta_path=str(path), weight_version="B")
    assert r.status_code == 409 and r.json()["code"] == "base_mismatch", r.text
    assert_on_base(worker, base)


def test_a_missing_manifest_a_fifo_and_a_path_outside_the_roots_are_refused(
    worker: Worker, tmp_path: Path
) -> None:
    base = base_weights()
    path = write_delta(base, changed(base), tmp_path / "d")
    (path / DELTA_NAME).unlink()
    r = worker.post("update_weights_from_delta", delta_path=str(path))
    assert r.status_code == 400 and r.json()["code"] == "bad_delta", r.text
    os.mkfifo(path / DELTA_NAME)  # no writer: a blocking open would wedge the worker
    r = worker.post("update_weights_from_delta", delta_path=str(path))
    assert r.status_code == 400 and r.json()["code"] in ("not_a_file", "bad_delta"), r.text
    r = worker.post("update_weights_from_delta", delta_path="/etc")
    assert r.status_code == 400 and r.json()["code"] == "path_not_allowed", r.text
    r = worker.post("update_weights_from_delta", delta_path=7)
    assert r.status_code == 400 and r.json()["code"] == "wrong_type", r.text
    assert_on_base(worker, base)
