"""The JSON checks every layout and plan wire form shares: one error (``InvalidRequest``,
``invalid_layout``), readers of integers, objects and lists that raise it, the bounds they
enforce, and the wire form of a :class:`~weightsync.core.snapshot.TensorSpec`.  Pure Python.
"""

from __future__ import annotations

from typing import Any, Final

from weightsync.core.dtypes import DTYPES
from weightsync.core.errors import InvalidRequest
from weightsync.core.snapshot import TensorSpec

MAX_RANKS: Final = 65536
MAX_TENSORS: Final = 1 << 20
MAX_DIMS: Final = 16


def bad_layout(message: str, field: str | None = None) -> InvalidRequest:
    """The ``InvalidRequest`` (``invalid_layout``) for a malformed layout or plan."""
    extra = {"field": field} if field else {}
    return InvalidRequest(message, code="invalid_layout", **extra)


def wire_int(value: Any, what: str, lo: int = 0, hi: int | None = None) -> int:
    """``value`` as an integer in ``[lo, hi]``.  Raises ``InvalidRequest`` (``invalid_layout``)."""
    if type(value) is not int or value < lo or (hi is not None and value > hi):
        bound = f" and at most {hi}" if hi is not None else ""
        raise bad_layout(f"{what} must be an integer of at least {lo}{bound}, got {value!r}", what)
    return value


def spec_to_wire(spec: TensorSpec) -> dict[str, Any]:
    """The JSON object of ``spec``: name, dtype and shape."""
    return {"name": spec.name, "dtype": spec.dtype, "shape": list(spec.shape)}


def spec_from_wire(value: Any, what: str) -> TensorSpec:
    """The spec ``value`` names (other keys are the caller's to check).  Raises
    ``InvalidRequest`` (``invalid_layout``)."""
    if not isinstance(value, dict):
        raise bad_layout(f"{what} must be an object", what)
    name, dtype, shape = value.get("name"), value.get("dtype"), value.get("shape")
    if not isinstance(name, str) or not name or len(name) > 1024:
        raise bad_layout(f"{what}.name must be a non-empty string of at most 1024 characters", what)
    if dtype not in DTYPES:
        raise bad_layout(f"{what}.dtype {dtype!r} is not a known dtype", what)
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        raise bad_layout(f"{what}.shape must be a list of at most {MAX_DIMS} sizes", what)
    return TensorSpec(name, str(dtype), tuple(wire_int(n, f"{what}.shape", 0, 1 << 48) for n in shape))


def wire_object(value: Any, keys: set[str], what: str) -> dict[str, Any]:
    """``value`` as an object with no keys beyond ``keys``.  Raises ``InvalidRequest``
    (``invalid_layout``)."""
    if not isinstance(value, dict):
        raise bad_layout(f"{what} must be an object", what)
    unknown = set(value) - keys
    if unknown:
        raise bad_layout(f"{what} has unknown fields {sorted(unknown)}", what)
    return value


def wire_list(value: Any, what: str, limit: int) -> list[Any]:
    """``value`` as a list of at most ``limit`` entries.  Raises ``InvalidRequest``
    (``invalid_layout``)."""
    if not isinstance(value, list) or len(value) > limit:
        raise bad_layout(f"{what} must be a list of at most {limit} entries", what)
    return value
