"""Checkers for fields of untrusted JSON, and :class:`Body`, the object being parsed.

This is the edge: every request and wire form is parsed with these, and past them nothing
re-checks a type.  Rules:

* the body is a JSON object; unknown fields are refused (a typo must not be ignored);
* booleans are strict: ``"false"``, ``0`` and ``1`` are not booleans;
* integers are strict too (``true`` is not ``1``, ``2.0`` is not ``2``);
* every error is an :class:`~weightsync.core.errors.InvalidRequest` naming the field,
  with a code: ``not_an_object``, ``unknown_field``, ``missing_field``, ``wrong_type``,
  ``invalid_value`` or ``duplicate_tensor``.

A checker is ``check(field, value) -> typed value``; it raises and never coerces.


Strict JSON parsing shared by every edge that reads JSON from outside.

Python's ``json`` accepts ``NaN``/``Infinity`` literals and keeps the last of repeated keys;
either would let two readers of the same bytes disagree about what they say.  Pure standard
library, so core stays importable anywhere.
"""

from __future__ import annotations

import ipaddress
import json
import math
import re
from collections.abc import Callable, Collection, Iterable
from typing import Any, Final, TypeVar

from weightsync.core.dtypes import DTYPES
from weightsync.core.errors import InvalidRequest
from weightsync.core.snapshot import Declared, JSONValue, NotJSON, TensorSpec, json_problem

T = TypeVar("T")

_MISSING: Final = object()

MAX_NAME_LEN: Final = 128
"""The longest group name or stream id: they become keys in the trainer's TCPStore, which
drops a connection that sends a key over 8192 bytes (every later call on the group fails)."""

MAX_DIGEST_CHARS: Final = 128

_NAME_CHARS: Final = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")


def type_name(value: Any) -> str:
    """The JSON name of ``value``'s type (``boolean``, ``array``...), for messages."""
    return {
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "string",
        list: "array",
        dict: "object",
        type(None): "null",
    }.get(type(value), type(value).__name__)


def short(value: Any) -> str:
    """``value`` as JSON, cut to 60 characters, for messages."""
    try:
        text = json.dumps(value, default=repr)
    except (RecursionError, ValueError):  # nested too deep to quote: name the type instead
        return f"({type_name(value)})"
    return text if len(text) <= 60 else text[:57] + "..."


def wrong(field: str, expected: str, value: Any) -> InvalidRequest:
    """The ``wrong_type`` error for ``field``."""
    return InvalidRequest(
        f"{field} must be {expected}, got {type_name(value)} {short(value)}", code="wrong_type", field=field
    )


def invalid(field: str, message: str) -> InvalidRequest:
    """The ``invalid_value`` error for ``field``."""
    return InvalidRequest(message, code="invalid_value", field=field)


def exactly(field: str, value: Any, kind: type[T], expected: str) -> T:
    """``value`` itself when its type is exactly ``kind`` (no subclass: ``True`` is no int,
    and nothing is coerced), else the ``wrong_type`` error saying it must be ``expected``."""
    if type(value) is not kind:
        raise wrong(field, expected, value)
    return value


def boolean(field: str, value: Any) -> bool:
    return exactly(field, value, bool, "a boolean (true or false)")


def string(field: str, value: Any) -> str:
    """A non-empty string."""
    if type(value) is not str:
        raise wrong(field, "a string", value)
    if not value:
        raise invalid(field, f"{field} must not be empty")
    return value


def store_name(field: str, value: Any) -> str:
    """A group name or stream id: 1 to :data:`MAX_NAME_LEN` characters of ``[A-Za-z0-9._-]``."""
    text = string(field, value)
    if len(text) > MAX_NAME_LEN or not _NAME_CHARS.issuperset(text):
        raise invalid(
            field,
            f"{field} must be 1 to {MAX_NAME_LEN} characters of A-Z, a-z, 0-9, '.', '_' and '-', "
            f"got {short(text)}",
        )
    return text


_HOST_LABEL: Final = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def host(field: str, value: Any) -> str:
    """A host to connect to: a DNS host name (RFC 1123 labels, at most 253 characters), an IPv4
    address, or an IPv6 address, bare (``::1``, as vLLM's ``StatelessProcessGroup`` takes it)
    or in brackets (``[::1]``, as SGLang's ``tcp://`` rendezvous writes it), returned bare.
    Anything else (a port, a scheme, a path, whitespace, a zone index) is ``invalid_value``:
    a worker must refuse it before it connects, not try it until a timeout."""
    text = string(field, value)
    bare = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    try:
        address = ipaddress.ip_address(bare)
    except ValueError:
        address = None
    if address is not None and (bare is text or address.version == 6) and "%" not in bare:
        return bare
    labels = text.split(".")
    is_name = address is None and len(text) <= 253 and all(_HOST_LABEL.fullmatch(label) for label in labels)
    if is_name and not labels[-1].isdigit():  # "1.2.3" or "300.1.1.1" is a mistyped address, not a name
        return text
    raise invalid(
        field,
        f"{field} must be a host name or an IP address (IPv6 bare or in brackets), with no port, "
        f"scheme or spaces; got {short(text)}",
    )


def integer(field: str, value: Any, lo: int | None = None, hi: int | None = None) -> int:
    if type(value) is not int:
        raise wrong(field, "an integer", value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
        raise invalid(field, f"{field} must be {bounds}, got {value}")
    return value


def bounded(lo: int | None = None, hi: int | None = None) -> Callable[[str, Any], int]:
    """The checker of an integer between ``lo`` and ``hi``."""
    return lambda field, value: integer(field, value, lo, hi)


def positive_number(field: str, value: Any, hi: float = math.inf) -> float:
    if type(value) not in (int, float):
        raise wrong(field, "a number", value)
    # a huge int compares fine but float() overflows: bound-check before converting
    if not (0 < value <= hi) or (type(value) is float and not math.isfinite(value)):
        bounds = f"a positive number up to {hi:g}" if math.isfinite(hi) else "a positive number"
        raise invalid(field, f"{field} must be {bounds}, got {short(value)}")
    return float(value)


def any_json(field: str, value: Any) -> JSONValue:
    """A JSON value every reply can write back (UTF-8, bounded depth and size; see
    :func:`weightsync.core.snapshot.json_problem`), else ``invalid_value``."""
    problem = json_problem(value)
    if problem is not None:
        raise invalid(field, f"{field} must be a JSON value: {problem}")
    return value


def declared(field: str, value: Any) -> Declared:
    """A version label: :func:`any_json`'s check, run once (by ``Declared`` itself)."""
    try:
        return Declared(value)
    except NotJSON as exc:
        raise invalid(field, f"{field} must be a JSON value: {exc.problem}") from None


def one_of(options: Collection[str]) -> Callable[[str, Any], str]:
    """The checker of a string among ``options``."""

    def check(field: str, value: Any) -> str:
        if type(value) is not str:
            raise wrong(field, f"one of {sorted(options)}", value)
        if value not in options:
            raise invalid(field, f"{field} must be one of {sorted(options)}, got {value!r}")
        return value

    return check


def known_dtype(field: str, value: Any) -> str:
    """A dtype name of the table (``bfloat16``; a ``torch.`` prefix is dropped)."""
    if type(value) is not str:
        raise wrong(field, "a torch dtype name such as 'bfloat16'", value)
    name = value.removeprefix("torch.")
    if name not in DTYPES:
        raise invalid(field, f"{field}: unknown dtype {value!r}")
    return name


def shape(field: str, value: Any) -> tuple[int, ...]:
    dims = exactly(field, value, list, "an array of non-negative integers")
    return tuple(integer(f"{field}[{i}]", d, lo=0) for i, d in enumerate(dims))


def array(field: str, value: Any, item: Callable[[str, Any], T]) -> list[T]:
    items = exactly(field, value, list, "an array")
    return [item(f"{field}[{i}]", v) for i, v in enumerate(items)]


def array_of(item: Callable[[str, Any], T]) -> Callable[[str, Any], list[T]]:
    """The checker of an array whose items ``item`` checks."""
    return lambda field, value: array(field, value, item)


def obj(field: str, value: Any) -> dict[str, Any]:
    return exactly(field, value, dict, "an object")


def hex_digest(field: str, value: Any) -> str:
    """A lowercase hex string (a content digest), at most :data:`MAX_DIGEST_CHARS` long."""
    if type(value) is not str:
        raise wrong(field, "a lowercase hex string", value)
    if not value or len(value) > MAX_DIGEST_CHARS or value.strip("0123456789abcdef"):
        raise invalid(
            field,
            f"{field} must be a lowercase hex string of 1 to {MAX_DIGEST_CHARS} characters, got {short(value)}",
        )
    return value


def unique_tensor_names(field: str, names: Iterable[str]) -> None:
    """Refuse a tensor named twice (``duplicate_tensor``): one load would write it twice,
    and no single hash could describe what was loaded."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise InvalidRequest(
                f"{field}: tensor {short(name)} is named more than once", code="duplicate_tensor", field=field
            )
        seen.add(name)


class Body:
    """A JSON object being parsed: refuses unknown fields up front, then hands out fields."""

    def __init__(self, body: Any, fields: Collection[str]) -> None:
        if type(body) is not dict:
            raise InvalidRequest(
                f"the request body must be a JSON object, got {type_name(body)}", code="not_an_object"
            )
        unknown = sorted(set(body) - set(fields))
        if unknown:
            raise InvalidRequest(
                f"unknown field(s) {unknown}; allowed: {sorted(fields)}", code="unknown_field", fields=unknown
            )
        self._body = body

    def has(self, name: str) -> bool:
        return name in self._body

    def get(self, name: str, check: Callable[[str, Any], T], default: Any = _MISSING) -> T:
        """``check(name, value)`` of the field, ``default`` when it is absent; a missing field
        without a default is ``missing_field``."""
        if name not in self._body:
            if default is _MISSING:
                raise InvalidRequest(f"missing required field {name!r}", code="missing_field", field=name)
            return default  # type: ignore[no-any-return]
        return check(name, self._body[name])


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


def strict_loads(raw: str | bytes, *, finite: bool = False) -> Any:
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


def named_tensors(b: Body) -> list[TensorSpec]:
    """A body's ``names``, ``dtypes`` and ``shapes`` side by side, at least one, names unique
    (a stream's metadata).  Raises ``InvalidRequest``."""
    names = b.get("names", array_of(string))
    dtypes = b.get("dtypes", array_of(known_dtype))
    shapes = b.get("shapes", array_of(shape))
    if not (len(names) == len(dtypes) == len(shapes)):
        raise InvalidRequest(
            f"names, dtypes and shapes must have the same length, got {len(names)}, {len(dtypes)}, {len(shapes)}",
            code="invalid_value",
        )
    if not names:
        raise invalid("names", "names must not be empty")
    unique_tensor_names("names", names)
    return [TensorSpec(n, d, s) for n, d, s in zip(names, dtypes, shapes, strict=True)]
