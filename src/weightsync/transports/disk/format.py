"""The safetensors file format, read without trusting it.

A safetensors file is ``u64 little-endian header length N``, ``N`` bytes of JSON, then the
data.  We parse and check headers ourselves (cheaply, before any weight is touched) so every
corruption is found up front: an impossible header length, bad JSON, offsets outside the
data, a byte size that disagrees with dtype × shape, or a file whose length is not exactly
header + data (a truncated shard).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Final

import attrs

from weightsync.core.errors import InvalidRequest
from weightsync.core.values import TensorSpec

# safetensors dtype -> (torch dtype name, bytes per element)
DTYPES: Final = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
    "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1),
    "U8": ("uint8", 1), "BOOL": ("bool", 1),
}  # fmt: skip
MAX_HEADER: Final = 100 << 20


def corrupt(path: Path, why: str) -> InvalidRequest:
    return InvalidRequest(
        f"{path.name}: corrupt safetensors file: {why}", code="corrupt_checkpoint", file=str(path)
    )


@attrs.frozen
class TensorEntry:
    spec: TensorSpec
    start: int  # absolute byte offset in the file
    end: int


@attrs.frozen
class ShardHeader:
    """A checked header: the file's tensors with absolute offsets, and its exact size."""

    path: Path
    tensors: dict[str, TensorEntry]
    size: int

    @property
    def data_bytes(self) -> int:
        return sum(t.end - t.start for t in self.tensors.values())

    @classmethod
    def read(cls, path: Path) -> ShardHeader:
        """Parse and check ``path``'s header.  Raises ``InvalidRequest`` (``corrupt_checkpoint``)."""
        size = path.stat().st_size
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise corrupt(path, f"file is {size} bytes, too short for a header")
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER or n > size - 8:
                raise corrupt(path, f"header length {n} is impossible for a {size}-byte file")
            raw = f.read(n)
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise corrupt(path, f"header is not JSON ({exc})") from None
        if not isinstance(header, dict):
            raise corrupt(path, "header is not a JSON object")
        base = 8 + n
        tensors: dict[str, TensorEntry] = {}
        data_end = 0
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype, itemsize = DTYPES[meta["dtype"]]
                shape = tuple(int(d) for d in meta["shape"])
                begin, stop = (int(o) for o in meta["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise corrupt(path, f"bad entry for tensor {name!r}") from None
            if any(d < 0 for d in shape) or not 0 <= begin <= stop:
                raise corrupt(path, f"bad shape or offsets for tensor {name!r}")
            if stop - begin != math.prod(shape) * itemsize:
                raise corrupt(
                    path, f"tensor {name!r}: {stop - begin} bytes for {meta['dtype']} {list(shape)}"
                )
            data_end = max(data_end, stop)
            tensors[name] = TensorEntry(TensorSpec(name, dtype, shape), base + begin, base + stop)
        if base + data_end != size:
            what = "truncated" if base + data_end > size else "has trailing bytes"
            raise corrupt(path, f"file {what}: {size} bytes, header promises {base + data_end}")
        return cls(path, tensors, size)
