"""Strict JSON parsing shared by every edge that reads JSON from outside.

Python's ``json`` accepts ``NaN``/``Infinity`` literals and keeps the last of repeated keys;
either would let two readers of the same bytes disagree about what they say.  Pure standard
library, so core stays importable anywhere.
"""

from __future__ import annotations

import json
import math
from typing import Any


def reject_constant(name: str) -> Any:
    """``parse_constant`` hook: ``NaN``, ``Infinity`` and ``-Infinity`` are not JSON."""
    raise ValueError(f"{name} is not valid JSON")


def unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook``: a key repeated in one object is an error (which one counts would be a guess)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key[:100]!r}")
        out[key] = value
    return out


def finite_float(text: str) -> float:
    """``parse_float`` hook: a number that overflows to infinity (``1e400``) is an error."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number out of range: {text[:100]}")
    return value


def loads(raw: str | bytes, *, finite: bool = False) -> Any:
    """Parse ``raw`` strictly: no constants, unique keys, and with ``finite`` no overflowing floats.

    Raises ``ValueError`` (``json.JSONDecodeError`` and ``UnicodeDecodeError`` included) for
    anything that is not strict JSON, and ``RecursionError`` for nesting deeper than the
    parser's stack: callers turn both into their own refusal.
    """
    if finite:
        return json.loads(
            raw, parse_constant=reject_constant, object_pairs_hook=unique_object, parse_float=finite_float
        )
    return json.loads(raw, parse_constant=reject_constant, object_pairs_hook=unique_object)
