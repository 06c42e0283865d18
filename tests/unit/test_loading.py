"""`load_sync` is a total backstop: whatever a channel raises, the engine gets `LoadFailed`
whose `wrote` matches the sink, and a failure before the first write is a 4xx refusal."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import TINY, perturbed
from weightsync.core import DiskSource, LoadFailed, UpdateRequest, WeightSyncError
from weightsync.core.sources import WeightSource
from weightsync.engines.reference import CausalLM
from weightsync.trainer import save_checkpoint, share_tensors
from weightsync.transports.disk import DiskCheckpoint
from weightsync.transports.hashing import tensor_hashes
from weightsync.transports.loading import LoadContext, load_sync
from weightsync.transports.sink import TensorSink


@pytest.fixture
def weights() -> dict[str, torch.Tensor]:
    return CausalLM(TINY).weights()


@pytest.fixture
def shared(weights: dict[str, torch.Tensor]) -> Iterator[list[dict[str, Any]]]:
    with share_tensors(perturbed(weights, seed=5)) as s:
        yield s.tensors


def load_refused(
    source: WeightSource, weights: dict[str, torch.Tensor], sink: TensorSink | None = None
) -> Any:
    """Run ``source`` through ``load_sync``; assert a clean refusal; return its cause."""
    before = tensor_hashes(weights.items())
    sink = sink or TensorSink(weights)
    with pytest.raises(LoadFailed) as err:
        load_sync(source, sink, LoadContext.create(None))
    assert err.value.wrote is False and not sink.wrote
    assert tensor_hashes(weights.items()) == before, "a refused load changed the weights"
    cause = err.value.cause
    assert isinstance(cause, WeightSyncError) and 400 <= cause.http_status < 500, (cause, err.value)
    return cause


def _shm_handle(shared: list[dict[str, Any]], **handle: Any) -> WeightSource:
    return UpdateRequest.from_tensor_body({"tensors": [{**shared[0], "handle": handle}]}).source


# Inputs that raised a builtin exception out of a channel's validation (issue 9 A).
HOSTILE: dict[str, Callable[[Path, list[dict[str, Any]], dict[str, torch.Tensor]], WeightSource]] = {
    "disk: NUL byte in model_path (ValueError)": lambda tmp, shm, w: DiskSource(f"{tmp}/a\0b"),
    "disk: manifest files entry is a string (AttributeError)": lambda tmp, shm, w: _manifest_entry_string(
        tmp, w
    ),
    "shm: segment name with a slash (OSError)": lambda tmp, shm, w: _shm_handle(
        shm, shm="weightsync_a/b", offset=0
    ),
    "shm: 300-character segment name (OSError)": lambda tmp, shm, w: _shm_handle(
        shm, shm="weightsync_" + "x" * 300, offset=0
    ),
}


def _manifest_entry_string(tmp: Path, weights: dict[str, torch.Tensor]) -> WeightSource:
    ckpt = save_checkpoint(perturbed(weights), tmp / "ckpt", shard_bytes=60_000)
    manifest_path = ckpt / "weightsync-manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][next(iter(manifest["files"]))] = "not an object"
    manifest_path.write_text(json.dumps(manifest))
    return DiskSource(str(ckpt))


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_inputs_are_refused_with_a_4xx_and_nothing_written(
    case: str, tmp_path: Path, shared: list[dict[str, Any]], weights: dict[str, torch.Tensor]
) -> None:
    cause = load_refused(HOSTILE[case](tmp_path, shared, weights), weights)
    if cause.code == "invalid_source":  # the backstop answered (no precise code from the channel)
        assert cause.details["exception"] in cause.message


class _RaisingSpecs(dict[str, Any]):
    """The sink's spec table, made to fail the way a validator bug fails: every lookup raises."""

    def __init__(self, specs: dict[str, Any], exc: BaseException) -> None:
        super().__init__(specs)
        self.exc = exc

    def get(self, *_: Any) -> Any:
        raise self.exc

    def __getitem__(self, _: str) -> Any:
        raise self.exc


BUILTIN_FAILURES = [
    OverflowError("int too large"),
    RecursionError("maximum recursion depth exceeded"),
    KeyError("float8_e4m3fnuz"),
    AttributeError("'str' object has no attribute 'get'"),
    ValueError("embedded null byte"),
    TypeError("unhashable type: 'list'"),
    IndexError("list index out of range"),
    ZeroDivisionError("division by zero"),
    RuntimeError("anything else"),
]


@pytest.mark.parametrize("channel", ["disk", "shm"])
@pytest.mark.parametrize("exc", BUILTIN_FAILURES, ids=lambda e: type(e).__name__)
def test_any_exception_from_validation_is_a_4xx_refusal(
    channel: str,
    exc: BaseException,
    tmp_path: Path,
    shared: list[dict[str, Any]],
    weights: dict[str, torch.Tensor],
) -> None:
    if channel == "disk":
        source: WeightSource = DiskSource(str(save_checkpoint(perturbed(weights), tmp_path / "c")))
    else:
        source = UpdateRequest.from_tensor_body({"tensors": shared}).source
    sink = TensorSink(weights)
    sink.specs = _RaisingSpecs(sink.specs, exc)
    cause = load_refused(source, weights, sink)
    if cause.code == "invalid_source":
        assert cause.details["exception"] == type(exc).__name__ and type(exc).__name__ in cause.message


@pytest.mark.parametrize("exc", BUILTIN_FAILURES, ids=lambda e: type(e).__name__)
def test_a_stray_exception_before_any_write_becomes_invalid_source(
    exc: BaseException, monkeypatch: pytest.MonkeyPatch, weights: dict[str, torch.Tensor]
) -> None:
    def validate(*_: Any) -> Any:  # a channel whose validation lets a builtin exception escape
        raise exc

    monkeypatch.setattr("weightsync.transports.disk.reader.DiskReader.validate", validate)
    cause = load_refused(DiskSource("/anywhere"), weights)
    assert cause.code == "invalid_source" and cause.http_status == 400
    assert cause.details["exception"] == type(exc).__name__ and type(exc).__name__ in cause.message


@pytest.mark.parametrize(
    "exc",
    [KeyError("late"), LoadFailed("the channel lost count", wrote=False, code="read_failed")],
    ids=["builtin", "load_failed_claiming_no_write"],
)
def test_the_sink_decides_wrote_whatever_the_channel_claims(
    exc: BaseException, monkeypatch: pytest.MonkeyPatch, weights: dict[str, torch.Tensor]
) -> None:
    name = next(iter(weights))

    def validate(*_: Any) -> None:
        pass

    def stream(self: Any, sink: TensorSink) -> Iterator[None]:
        sink.write(name, torch.zeros_like(weights[name]))
        raise exc
        yield

    monkeypatch.setattr("weightsync.transports.disk.reader.DiskReader.validate", validate)
    monkeypatch.setattr("weightsync.transports.disk.reader.DiskReader.stream", stream)
    with pytest.raises(LoadFailed) as err:
        load_sync(DiskSource("/anywhere"), TensorSink(weights), LoadContext.create(None))
    assert err.value.wrote is True and err.value.cause is None


def test_a_failure_after_the_first_write_reports_wrote(
    tmp_path: Path, weights: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = save_checkpoint(perturbed(weights), tmp_path / "c", shard_bytes=60_000)
    last = sorted(ckpt.glob("*.safetensors"))[-1]
    sink = TensorSink(weights)
    verify = DiskCheckpoint.verify_checksums

    def verify_then_shrink(self: DiskCheckpoint) -> dict[str, str]:
        # The copy reads ahead of the sink, so a cut made once a tensor is written may land
        # after every byte was read; cut the last shard between validation and the copy.
        hashes = verify(self)
        with last.open("r+b") as f:
            f.truncate(last.stat().st_size // 2)
        return hashes

    monkeypatch.setattr(DiskCheckpoint, "verify_checksums", verify_then_shrink)
    with pytest.raises(LoadFailed) as err:
        load_sync(DiskSource(str(ckpt)), sink, LoadContext.create(None))
    assert err.value.wrote is True and sink.wrote
