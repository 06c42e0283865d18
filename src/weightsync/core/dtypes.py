"""The one table of tensor dtypes every part of weightsync agrees on.

A dtype travels by name (``"bfloat16"``): in request bodies, in a broadcast's metadata, in
shared-memory handles and in ``weight_info`` replies.  Each name maps to its size in bytes
per element, its code in a safetensors header (``None`` where the format has none, so a
checkpoint cannot carry it) and the name of the ``torch`` attribute that is the dtype.

The request parser accepts exactly these names; the published JSON Schemas list them; the
disk channel reads safetensors codes through :data:`BY_SAFETENSORS`; the distributed and
shared-memory channels size tensors with :func:`itemsize`.  Adding a dtype is one row here.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final, NamedTuple

from weightsync.core.errors import InvalidRequest


class DType(NamedTuple):
    itemsize: int
    safetensors: str | None  # the header code, or None: the safetensors format cannot carry it
    torch: str  # the attribute of the ``torch`` module


def _row(itemsize: int, safetensors: str | None, torch: str) -> DType:
    return DType(itemsize, safetensors, torch)


DTYPES: Final[Mapping[str, DType]] = MappingProxyType({
    "float64": _row(8, "F64", "float64"),
    "float32": _row(4, "F32", "float32"),
    "float16": _row(2, "F16", "float16"),
    "bfloat16": _row(2, "BF16", "bfloat16"),
    "float8_e4m3fn": _row(1, "F8_E4M3", "float8_e4m3fn"),
    "float8_e5m2": _row(1, "F8_E5M2", "float8_e5m2"),
    "float8_e4m3fnuz": _row(1, "F8_E4M3FNUZ", "float8_e4m3fnuz"),
    "float8_e5m2fnuz": _row(1, "F8_E5M2FNUZ", "float8_e5m2fnuz"),
    "int64": _row(8, "I64", "int64"),
    "int32": _row(4, "I32", "int32"),
    "int16": _row(2, "I16", "int16"),
    "int8": _row(1, "I8", "int8"),
    "uint8": _row(1, "U8", "uint8"),
    "bool": _row(1, "BOOL", "bool"),
    "complex64": _row(8, "C64", "complex64"),
    "complex128": _row(16, None, "complex128"),
})  # fmt: skip
"""Dtype name -> (bytes per element, safetensors code, torch attribute)."""

NAMES: Final = tuple(DTYPES)
"""Every dtype name a request may carry, in table order."""

BY_SAFETENSORS: Final[Mapping[str, str]] = MappingProxyType(
    {row.safetensors: name for name, row in DTYPES.items() if row.safetensors is not None}
)
"""Safetensors header code -> dtype name, for the codes weightsync reads."""


def itemsize(name: str) -> int:
    """Bytes per element of dtype ``name``.  Raises ``InvalidRequest`` (``unsupported_dtype``)
    for a name outside the table."""
    row = DTYPES.get(name)
    if row is None:
        raise InvalidRequest(f"dtype {name!r} is not supported", code="unsupported_dtype")
    return row.itemsize


def safetensors_code(name: str) -> str:
    """The safetensors header code of dtype ``name``.  Raises ``InvalidRequest``
    (``unsupported_dtype``) when the format cannot carry it."""
    row = DTYPES.get(name)
    if row is None or row.safetensors is None:
        raise InvalidRequest(
            f"dtype {name!r} cannot be stored in a safetensors checkpoint", code="unsupported_dtype"
        )
    return row.safetensors
