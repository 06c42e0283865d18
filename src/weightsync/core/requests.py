"""Parsing untrusted admin-route bodies into frozen, typed requests.

This is the edge: past ``from_body`` nothing re-checks a type.  Rules:

* the body is a JSON object; unknown fields are refused (a typo must not be ignored);
* booleans are strict: ``"false"``, ``0`` and ``1`` are not booleans;
* integers are strict too (``true`` is not ``1``, ``2.0`` is not ``2``);
* every error is an :class:`~weightsync.core.errors.InvalidRequest` naming the field,
  with a code: ``not_an_object``, ``unknown_field``, ``missing_field``, ``wrong_type``,
  ``invalid_value``, ``duplicate_tensor`` or ``conflicting_options``.

Parsing never looks at the worker's state: a malformed request is a 400 even when the
state would also refuse it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, ClassVar, Final, TypeVar, Union

import attrs

from .dtypes import DTYPES
from .errors import InvalidRequest
from .values import Declared, JSONValue, PauseMode, TensorSpec, json_problem, specs

T = TypeVar("T")

_MISSING: Final = object()


def _type_name(value: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object", type(None): "null"}.get(type(value), type(value).__name__)  # fmt: skip


def _wrong(field: str, expected: str, value: Any) -> InvalidRequest:
    return InvalidRequest(
        f"{field} must be {expected}, got {_type_name(value)} {_short(value)}",
        code="wrong_type",
        field=field,
    )


def _short(value: Any) -> str:
    try:
        text = json.dumps(value, default=repr)
    except (RecursionError, ValueError):  # nested too deep to quote: name the type instead
        return f"({_type_name(value)})"
    return text if len(text) <= 60 else text[:57] + "..."


def boolean(field: str, value: Any) -> bool:
    if type(value) is not bool:
        raise _wrong(field, "a boolean (true or false)", value)
    return value


def string(field: str, value: Any) -> str:
    if type(value) is not str:
        raise _wrong(field, "a string", value)
    if not value:
        raise InvalidRequest(f"{field} must not be empty", code="invalid_value", field=field)
    return value


MAX_NAME_LEN: Final = 128
"""The longest group name or stream id: they become keys in the trainer's TCPStore, which
drops a connection that sends a key over 8192 bytes (every later call on the group fails)."""

_NAME_CHARS: Final = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")


def store_name(field: str, value: Any) -> str:
    """A group name or stream id: 1 to :data:`MAX_NAME_LEN` characters of ``[A-Za-z0-9._-]``."""
    text = string(field, value)
    if len(text) > MAX_NAME_LEN or not _NAME_CHARS.issuperset(text):
        raise InvalidRequest(
            f"{field} must be 1 to {MAX_NAME_LEN} characters of A-Z, a-z, 0-9, '.', '_' and '-', "
            f"got {_short(text)}",
            code="invalid_value",
            field=field,
        )
    return text


def integer(field: str, value: Any, lo: int | None = None, hi: int | None = None) -> int:
    if type(value) is not int:
        raise _wrong(field, "an integer", value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
        raise InvalidRequest(f"{field} must be {bounds}, got {value}", code="invalid_value", field=field)
    return value


def positive_number(field: str, value: Any, hi: float = math.inf) -> float:
    if type(value) not in (int, float):
        raise _wrong(field, "a number", value)
    # a huge int compares fine but float() overflows: bound-check before converting
    if not (0 < value <= hi) or (type(value) is float and not math.isfinite(value)):
        bounds = f"a positive number up to {hi:g}" if math.isfinite(hi) else "a positive number"
        raise InvalidRequest(
            f"{field} must be {bounds}, got {_short(value)}", code="invalid_value", field=field
        )
    return float(value)


def any_json(field: str, value: Any) -> JSONValue:
    """A JSON value every reply can write back (UTF-8, bounded depth and size; see
    :func:`weightsync.core.values.json_problem`), else ``invalid_value``."""
    problem = json_problem(value)
    if problem is not None:
        raise InvalidRequest(f"{field} must be a JSON value: {problem}", code="invalid_value", field=field)
    return value


def one_of(options: Collection[str]) -> Callable[[str, Any], str]:
    def check(field: str, value: Any) -> str:
        if type(value) is not str:
            raise _wrong(field, f"one of {sorted(options)}", value)
        if value not in options:
            raise InvalidRequest(
                f"{field} must be one of {sorted(options)}, got {value!r}", code="invalid_value", field=field
            )
        return value

    return check


def dtype_name(field: str, value: Any) -> str:
    if type(value) is not str:
        raise _wrong(field, "a torch dtype name such as 'bfloat16'", value)
    name = value.removeprefix("torch.")
    if name not in DTYPES:
        raise InvalidRequest(f"{field}: unknown dtype {value!r}", code="invalid_value", field=field)
    return name


def shape(field: str, value: Any) -> tuple[int, ...]:
    if type(value) is not list:
        raise _wrong(field, "an array of non-negative integers", value)
    return tuple(integer(f"{field}[{i}]", d, lo=0) for i, d in enumerate(value))


def array(field: str, value: Any, item: Callable[[str, Any], T]) -> list[T]:
    if type(value) is not list:
        raise _wrong(field, "an array", value)
    return [item(f"{field}[{i}]", v) for i, v in enumerate(value)]


def obj(field: str, value: Any) -> dict[str, Any]:
    if type(value) is not dict:
        raise _wrong(field, "an object", value)
    return value


def unique_tensor_names(field: str, names: Iterable[str]) -> None:
    """Refuse a tensor named twice (``duplicate_tensor``): one load would write it twice,
    and no single hash could describe what was loaded."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise InvalidRequest(
                f"{field}: tensor {_short(name)} is named more than once",
                code="duplicate_tensor",
                field=field,
            )
        seen.add(name)


class Body:
    """A JSON object being parsed: refuses unknown fields up front, then hands out fields."""

    def __init__(self, body: Any, fields: Collection[str]) -> None:
        if type(body) is not dict:
            raise InvalidRequest(
                f"the request body must be a JSON object, got {_type_name(body)}", code="not_an_object"
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
        if name not in self._body:
            if default is _MISSING:
                raise InvalidRequest(f"missing required field {name!r}", code="missing_field", field=name)
            return default  # type: ignore[no-any-return]
        return check(name, self._body[name])


# --------------------------------------------------------------------------- requests


@attrs.frozen
class EmptyRequest:
    """Routes without fields: get_weight_version, resume_generation, flush_cache, ..."""

    FIELDS: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_body(cls, body: Any) -> EmptyRequest:
        Body(body, cls.FIELDS)
        return cls()


MAX_EPOCH: Final = 2**63 - 1
"""The largest fleet epoch (it fits a signed 64-bit integer everywhere it is stored)."""

MAX_DIGEST_CHARS: Final = 128


def hex_digest(field: str, value: Any) -> str:
    """A lowercase hex string (a content digest), at most :data:`MAX_DIGEST_CHARS` long."""
    if type(value) is not str:
        raise _wrong(field, "a lowercase hex string", value)
    if not value or len(value) > MAX_DIGEST_CHARS or value.strip("0123456789abcdef"):
        raise InvalidRequest(
            f"{field} must be a lowercase hex string of 1 to {MAX_DIGEST_CHARS} characters, got {_short(value)}",
            code="invalid_value",
            field=field,
        )
    return value


@attrs.frozen(eq=True, hash=False)
class SetWeightVersion:
    """Declare a version; with ``epoch`` (a fleet commit) and ``expected_digest`` (the
    weights the declaration is about) as guards checked against the worker's state."""

    version: Declared
    epoch: int | None = None
    expected_digest: str | None = None
    FIELDS: ClassVar[tuple[str, ...]] = ("weight_version", "epoch", "expected_digest")

    @classmethod
    def from_body(cls, body: Any) -> SetWeightVersion:
        b = Body(body, cls.FIELDS)
        return cls(
            Declared(b.get("weight_version", any_json)),
            b.get("epoch", lambda f, v: integer(f, v, 0, MAX_EPOCH), None),
            b.get("expected_digest", hex_digest, None),
        )


@attrs.frozen
class PauseRequest:
    mode: PauseMode = PauseMode.KEEP
    clear_cache: bool = False
    FIELDS: ClassVar[tuple[str, ...]] = ("mode", "clear_cache")

    @classmethod
    def from_body(cls, body: Any) -> PauseRequest:
        b = Body(body, cls.FIELDS)
        mode = b.get("mode", one_of([m.value for m in PauseMode]), "keep")
        return cls(PauseMode(mode), b.get("clear_cache", boolean, False))


@attrs.frozen
class AbortRequest:
    request_id: str
    FIELDS: ClassVar[tuple[str, ...]] = ("request_id",)

    @classmethod
    def from_body(cls, body: Any) -> AbortRequest:
        return cls(Body(body, cls.FIELDS).get("request_id", string))


# ----- weight sources: what an update loads from.  The core only carries them to the engine.
#
# Each source has a wire form (``to_wire``/``from_wire``): a plain dict tagged with ``kind``
# for a process boundary, such as vLLM's ``collective_rpc`` into its workers.  ``from_wire``
# checks every field with the checkers above and raises ``InvalidRequest`` on a malformed
# dict, so the far side rebuilds exactly the typed value that was sent, or refuses.


def _spec_to_wire(spec: TensorSpec) -> list[Any]:
    return [spec.name, spec.dtype, list(spec.shape)]


def _spec_from_wire(field: str, value: Any) -> TensorSpec:
    if type(value) is not list or len(value) != 3:
        raise _wrong(field, "an array [name, dtype, shape]", value)
    return TensorSpec(
        string(f"{field}[0]", value[0]), dtype_name(f"{field}[1]", value[1]), shape(f"{field}[2]", value[2])
    )


def _wire_body(wire: Any, kind: str, fields: Collection[str]) -> Body:
    b = Body(wire, ("kind", *fields))
    if b.get("kind", string) != kind:
        raise InvalidRequest(f"not a {kind} source", code="invalid_source", field="kind")
    return b


@attrs.frozen
class DiskSource:
    """A safetensors file or sharded directory on the worker's filesystem."""

    model_path: str
    allow_partial: bool = False
    allow_dtype_cast: bool = False
    kind: ClassVar[str] = "disk"

    def to_wire(self) -> dict[str, Any]:
        return {"kind": self.kind, **attrs.asdict(self)}

    @classmethod
    def from_wire(cls, wire: Any) -> DiskSource:
        b = _wire_body(wire, cls.kind, ("model_path", "allow_partial", "allow_dtype_cast"))
        return cls(
            b.get("model_path", string), b.get("allow_partial", boolean), b.get("allow_dtype_cast", boolean)
        )


@attrs.frozen
class DistributedSource:
    """Tensors broadcast from rank 0 of a weight-update group.

    With ``bucket_bytes`` (weightsync's packed stream) the tensors arrive packed into buckets,
    after a handshake keyed by ``stream_id``; without it (``packing`` omitted) each tensor is
    one broadcast, in order, as vLLM's and SGLang's trainers send them.
    """

    group_name: str
    tensors: tuple[TensorSpec, ...] = attrs.field(converter=specs)
    bucket_bytes: int | None = None
    stream_id: str | None = None
    kind: ClassVar[str] = "distributed"

    def to_wire(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "group_name": self.group_name,
            "tensors": [_spec_to_wire(t) for t in self.tensors],
            "bucket_bytes": self.bucket_bytes,
            "stream_id": self.stream_id,
        }

    @classmethod
    def from_wire(cls, wire: Any) -> DistributedSource:
        b = _wire_body(wire, cls.kind, ("group_name", "tensors", "bucket_bytes", "stream_id"))
        return cls(
            b.get("group_name", string),  # bounded where a request is parsed (store_name)
            b.get("tensors", lambda f, v: array(f, v, _spec_from_wire)),
            b.get("bucket_bytes", lambda f, v: None if v is None else integer(f, v, lo=1)),
            b.get("stream_id", lambda f, v: None if v is None else string(f, v)),
        )


@attrs.frozen(eq=True, hash=False)
class TensorHandle:
    """One tensor shared by a colocated process; ``handle`` is interpreted by the tensor transport."""

    spec: TensorSpec
    handle: dict[str, Any]


def _handles(values: Iterable[TensorHandle]) -> tuple[TensorHandle, ...]:
    return tuple(values)


@attrs.frozen(eq=True, hash=False)
class TensorSource:
    """Tensors in shared memory (CPU) or CUDA IPC handles (GPU) from a colocated trainer."""

    tensors: tuple[TensorHandle, ...] = attrs.field(converter=_handles)
    kind: ClassVar[str] = "tensor"

    def to_wire(self) -> dict[str, Any]:
        return {"kind": self.kind, "tensors": [[*_spec_to_wire(h.spec), h.handle] for h in self.tensors]}

    @classmethod
    def from_wire(cls, wire: Any) -> TensorSource:
        def handle(field: str, value: Any) -> TensorHandle:
            if type(value) is not list or len(value) != 4:
                raise _wrong(field, "an array [name, dtype, shape, handle]", value)
            return TensorHandle(_spec_from_wire(field, value[:3]), obj(f"{field}[3]", value[3]))

        return cls(_wire_body(wire, cls.kind, ("tensors",)).get("tensors", lambda f, v: array(f, v, handle)))


WeightSource = Union[DiskSource, DistributedSource, TensorSource]  # noqa: UP007

SOURCES: Final[Mapping[str, type[DiskSource] | type[DistributedSource] | type[TensorSource]]] = {
    cls.kind: cls for cls in (DiskSource, DistributedSource, TensorSource)
}


def source_from_wire(wire: Any) -> WeightSource:
    """Rebuild any source from its ``to_wire`` dict (chosen by ``kind``).  Raises
    ``InvalidRequest`` for a malformed dict."""
    kind = wire.get("kind") if isinstance(wire, dict) else None
    cls = SOURCES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise InvalidRequest(f"not a weight source: kind {_short(kind)}", code="invalid_source", field="kind")
    return cls.from_wire(wire)


_UPDATE_FIELDS: Final = ("weight_version", "allow_unpaused", "reset_prefix_cache", "dry_run")


@attrs.frozen(eq=True, hash=False)
class UpdateRequest:
    """An update from any source.  ``version`` is ``None`` when the caller omitted it.

    ``reset_prefix_cache`` defaults to ``not allow_unpaused``: a cache cannot be reset
    under running requests, so only an explicit ``true`` with ``allow_unpaused`` is refused.
    ``dry_run`` validates the source and writes nothing (legal in every state).
    """

    source: WeightSource
    version: Declared | None = None
    allow_unpaused: bool = False
    reset_prefix_cache: bool = True
    dry_run: bool = False

    def __attrs_post_init__(self) -> None:
        if self.allow_unpaused and self.reset_prefix_cache:
            raise InvalidRequest(
                "allow_unpaused and reset_prefix_cache cannot both be true: a prefix cache cannot "
                "be reset under running requests",
                code="conflicting_options",
            )

    @classmethod
    def _common(cls, b: Body, source: WeightSource) -> UpdateRequest:
        version = Declared(b.get("weight_version", any_json)) if b.has("weight_version") else None
        allow_unpaused = b.get("allow_unpaused", boolean, False)
        reset = b.get("reset_prefix_cache", boolean, not allow_unpaused)
        return cls(source, version, allow_unpaused, reset, b.get("dry_run", boolean, False))

    @classmethod
    def from_disk_body(cls, body: Any) -> UpdateRequest:
        b = Body(body, ("model_path", "allow_partial", "allow_dtype_cast", *_UPDATE_FIELDS))
        source = DiskSource(
            b.get("model_path", string),
            b.get("allow_partial", boolean, False),
            b.get("allow_dtype_cast", boolean, False),
        )
        return cls._common(b, source)

    @classmethod
    def from_distributed_body(cls, body: Any) -> UpdateRequest:
        b = Body(body, ("names", "dtypes", "shapes", "group_name", "packing", *_UPDATE_FIELDS))
        names = b.get("names", lambda f, v: array(f, v, string))
        dtypes = b.get("dtypes", lambda f, v: array(f, v, dtype_name))
        shapes = b.get("shapes", lambda f, v: array(f, v, shape))
        if not (len(names) == len(dtypes) == len(shapes)):
            raise InvalidRequest(
                f"names, dtypes and shapes must have the same length, got "
                f"{len(names)}, {len(dtypes)}, {len(shapes)}",
                code="invalid_value",
            )
        if not names:
            raise InvalidRequest("names must not be empty", code="invalid_value", field="names")
        unique_tensor_names("names", names)
        tensors = [TensorSpec(n, d, s) for n, d, s in zip(names, dtypes, shapes, strict=True)]
        group = b.get("group_name", store_name)
        if b.has("packing"):
            packing = Body(b.get("packing", obj), ("bucket_bytes", "stream_id"))
            source = DistributedSource(
                group,
                tensors,
                packing.get("bucket_bytes", lambda f, v: integer(f"packing.{f}", v, lo=1)),
                packing.get("stream_id", lambda f, v: store_name(f"packing.{f}", v)),
            )
        else:
            source = DistributedSource(group, tensors)
        return cls._common(b, source)

    @classmethod
    def from_tensor_body(cls, body: Any) -> UpdateRequest:
        b = Body(body, ("tensors", *_UPDATE_FIELDS))

        def handle(field: str, value: Any) -> TensorHandle:
            t = Body(obj(field, value), ("name", "dtype", "shape", "handle"))
            spec = TensorSpec(t.get("name", string), t.get("dtype", dtype_name), t.get("shape", shape))
            return TensorHandle(spec, t.get("handle", obj))

        tensors = b.get("tensors", lambda f, v: array(f, v, handle))
        if not tensors:
            raise InvalidRequest("tensors must not be empty", code="invalid_value", field="tensors")
        unique_tensor_names("tensors", (h.spec.name for h in tensors))
        return cls._common(b, TensorSource(tensors))


MAX_TIMEOUT_S: Final = 86400.0
"""The longest rendezvous a worker waits for (a day); longer would overflow the timers."""

MAX_WORLD_SIZE: Final = 65536
"""The largest weight-update group (torch takes ranks and sizes as 32-bit integers)."""


@attrs.frozen
class InitGroupRequest:
    """Join a dedicated weight-update group as ranks ``rank_offset ..`` (the trainer is rank 0)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str = "nccl"
    timeout_s: float = 60.0
    FIELDS: ClassVar[tuple[str, ...]] = (
        "master_address", "master_port", "rank_offset", "world_size", "group_name", "backend", "timeout_s",
    )  # fmt: skip

    @classmethod
    def from_body(cls, body: Any) -> InitGroupRequest:
        b = Body(body, cls.FIELDS)
        req = cls(
            b.get("master_address", string),
            b.get("master_port", lambda f, v: integer(f, v, 1, 65535)),
            b.get("rank_offset", lambda f, v: integer(f, v, 1, MAX_WORLD_SIZE - 1)),
            b.get("world_size", lambda f, v: integer(f, v, 2, MAX_WORLD_SIZE)),
            b.get("group_name", store_name),
            b.get("backend", one_of(("nccl", "gloo")), "nccl"),
            b.get("timeout_s", lambda f, v: positive_number(f, v, hi=MAX_TIMEOUT_S), 60.0),
        )
        if req.rank_offset >= req.world_size:
            raise InvalidRequest(
                f"rank_offset ({req.rank_offset}) must be below world_size ({req.world_size})",
                code="invalid_value",
                field="rank_offset",
            )
        return req


@attrs.frozen
class DestroyGroupRequest:
    group_name: str
    FIELDS: ClassVar[tuple[str, ...]] = ("group_name",)

    @classmethod
    def from_body(cls, body: Any) -> DestroyGroupRequest:
        return cls(Body(body, cls.FIELDS).get("group_name", store_name))


@attrs.frozen(eq=True, hash=False)
class EngineRpcRequest:
    """Dynamo's ``engine_rpc``, limited to an allow-list: no caller-chosen method names."""

    method: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = attrs.field(factory=dict)
    FIELDS: ClassVar[tuple[str, ...]] = ("method", "args", "kwargs")

    @classmethod
    def from_body(cls, body: Any, allowed: Collection[str] = ()) -> EngineRpcRequest:
        b = Body(body, cls.FIELDS)
        method = b.get("method", string)
        if method not in allowed:
            raise InvalidRequest(
                f"engine_rpc method {method!r} is not on the allow-list {sorted(allowed)}",
                code="method_not_allowed",
                field="method",
            )
        args = b.get("args", lambda f, v: array(f, v, any_json), [])
        return cls(method, tuple(args), b.get("kwargs", obj, {}))
