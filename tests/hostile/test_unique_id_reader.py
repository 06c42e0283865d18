"""The reader of vLLM's pickled ``ncclUniqueId`` (transports/distributed/unique_id.py) accepts
that one value and refuses everything else without unpickling it."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weightsync.core.errors import InvalidRequest
from weightsync.transports.distributed.unique_id import read_nccl_unique_id


def real_pickle(raw: bytes, protocol: int = 4) -> bytes:
    """What ``pickle.dumps(ncclUniqueId())`` writes, built with vLLM's class."""
    from vllm.distributed.device_communicators.pynccl_wrapper import ncclUniqueId as Real

    uid = Real()
    for i, b in enumerate(raw):
        uid.internal[i] = b - 256 if b > 127 else b
    return pickle.dumps(uid, protocol=protocol)


@pytest.mark.parametrize("protocol", [3, 4, 5])
def test_the_real_pickle_gives_the_ids_bytes(protocol: int) -> None:
    raw = os.urandom(128)
    assert read_nccl_unique_id(real_pickle(raw, protocol)) == raw


def refused(data: Any) -> None:
    with pytest.raises(InvalidRequest) as info:
        read_nccl_unique_id(data)
    assert info.value.code == "bad_unique_id"


class Opens:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (open, (str(self.path), "w"))


def test_a_reduce_payload_is_refused_and_never_runs(tmp_path: Path) -> None:
    target = tmp_path / "written"
    refused(pickle.dumps(Opens(target)))
    assert not target.exists()


def test_the_right_shape_under_another_global_is_refused(tmp_path: Path) -> None:
    good = real_pickle(os.urandom(128))
    for old, new in [(b"_unpickle", b"_unpickl3"), (b"ncclUniqueId", b"ncclUniqueIx")]:
        refused(good.replace(old, new))
    refused(good.replace(b"\x8c\x07_ctypes", b"\x8c\x07builtin"))


@pytest.mark.parametrize(
    "value",
    [
        None,
        "text",
        b"",
        b"\x80\x04.",
        pickle.dumps(b"\0" * 128),
        pickle.dumps({"internal": 1}),
        b"\x80" * 5000,
    ],
)
def test_other_values_are_refused(value: Any) -> None:
    refused(value)


def test_a_protocol_2_pickle_which_needs_codecs_is_refused() -> None:
    refused(real_pickle(os.urandom(128), protocol=2))


@given(st.binary(max_size=400))
def test_any_bytes_are_the_id_or_a_refusal(data: bytes) -> None:
    try:
        raw = read_nccl_unique_id(data)
    except InvalidRequest as exc:
        assert exc.code == "bad_unique_id"
    else:
        assert len(raw) == 128


@given(st.integers(min_value=0, max_value=246), st.integers(min_value=0, max_value=255))
def test_a_one_byte_change_is_the_id_or_a_refusal(at: int, byte: int) -> None:
    good = bytearray(real_pickle(bytes(range(128))))
    good[at % len(good)] = byte
    try:
        raw = read_nccl_unique_id(bytes(good))
    except InvalidRequest as exc:
        assert exc.code == "bad_unique_id"
    else:
        assert len(raw) == 128
