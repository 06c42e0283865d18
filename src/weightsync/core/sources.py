"""Weight sources: what an update loads from.  The core only carries them to the engine.

Each source has one parser, :meth:`parse`, reading its fields from a :class:`Body`.  The
update routes call it on the request body; the wire form (``to_wire``/``from_wire``), a
plain dict for a process boundary such as vLLM's ``collective_rpc`` into its workers, is
the same fields tagged with ``kind``, read by the same parser.  So the far side of a
boundary checks exactly what the edge checked (group names bounded, tensors named once),
and rebuilds the typed value that was sent, or refuses with ``InvalidRequest``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, Final, Union

import attrs

from weightsync.core.errors import InvalidRequest
from weightsync.core.plan.value import PlanPart
from weightsync.core.snapshot import TensorSpec, specs
from weightsync.core.validation import (
    Body,
    any_json,
    array_of,
    boolean,
    hex_digest,
    integer,
    invalid,
    known_dtype,
    named_tensors,
    obj,
    one_of,
    shape,
    short,
    store_name,
    string,
    unique_tensor_names,
)


@attrs.frozen
class DiskSource:
    """A safetensors file or sharded directory on the worker's filesystem."""

    model_path: str
    allow_partial: bool = False
    allow_dtype_cast: bool = False
    relabel: bool = False
    """Whether the update may declare a version other than the one the checkpoint's manifest
    names (the operator says it is a relabel); else that is ``409 version_mismatch``."""
    label: list[Any] | None = None
    """``[version]`` the update declares (set by the update's parser, never by a caller), so
    that the reader can hold it against the manifest's before anything is written."""
    kind: ClassVar[str] = "disk"
    FIELDS: ClassVar[tuple[str, ...]] = ("model_path", "allow_partial", "allow_dtype_cast", "relabel")

    @classmethod
    def parse(cls, b: Body) -> DiskSource:
        """The source's fields of a request body or wire form.  Raises ``InvalidRequest``."""
        return cls(
            b.get("model_path", string),
            b.get("allow_partial", boolean, False),
            b.get("allow_dtype_cast", boolean, False),
            b.get("relabel", boolean, False),
            b.get("label", lambda f, v: None if v is None else _label(f, v), None)
            if b.has("label")
            else None,
        )

    def to_wire(self) -> dict[str, Any]:  # no label: the body form, which a caller sends
        return {
            "kind": self.kind,
            **attrs.asdict(self, recurse=False, filter=lambda a, v: a.name != "label" or v),
        }

    @classmethod
    def from_wire(cls, wire: Any) -> DiskSource:
        """The source a process boundary carried (:meth:`to_wire`), ``label`` included."""
        return cls.parse(_wire_body(wire, cls.kind, (*cls.FIELDS, "label")))


def _label(field: str, value: Any) -> list[Any]:
    """``[version]``: one JSON value in a list (the wire form of :attr:`DiskSource.label`)."""
    if type(value) is not list or len(value) != 1:
        raise invalid(field, f"{field} must be a list of one version value")
    return [any_json(field, value[0])]


def _hash(field: str, value: Any) -> str:
    text = string(field, value)
    if len(text) != 16 or text.strip("0123456789abcdef"):
        raise invalid(field, f"{field} must be an xxh3-64 hash as 16 lowercase hex digits, got {short(text)}")
    return text


def _hashes(values: Iterable[str] | None) -> tuple[str, ...] | None:
    return None if values is None else tuple(values)


def _tensor_wire(tensors: Iterable[TensorSpec]) -> dict[str, Any]:
    ts = list(tensors)
    return {
        "names": [t.name for t in ts],
        "dtypes": [t.dtype for t in ts],
        "shapes": [list(t.shape) for t in ts],
    }


@attrs.frozen
class DistributedSource:
    """Tensors broadcast from rank 0 of a weight-update group.

    Three streams, by ``packing``:

    * weightsync's packed stream (``bucket_bytes`` and ``stream_id``): the tensors arrive
      packed into buckets, after a handshake keyed by ``stream_id``, with a manifest and
      the trainer's per-tensor hashes in the group's store;
    * a bare per-tensor stream (``packing`` omitted): each tensor is one broadcast, in order,
      as vLLM's and SGLang's trainers send them;
    * a flat stream (``flat``): the tensors' bytes concatenated in order and cut into
      broadcasts of just over ``flat_bucket_bytes`` (vLLM's packed stream: a chunk closes
      after the tensor that takes it past the size), or one broadcast of everything without
      it (SGLang's ``flattened_bucket``).

    The bare and flat streams carry no checksums of their own: with ``hashes`` (the xxh3-64
    of every tensor, in order) the bytes received are verified before the update commits;
    without them the load reports ``verified: false``.
    """

    group_name: str
    tensors: tuple[TensorSpec, ...] = attrs.field(converter=specs)
    bucket_bytes: int | None = None
    stream_id: str | None = None
    flat: bool = False
    flat_bucket_bytes: int | None = None
    hashes: tuple[str, ...] | None = attrs.field(default=None, converter=_hashes)
    kind: ClassVar[str] = "distributed"
    FIELDS: ClassVar[tuple[str, ...]] = ("names", "dtypes", "shapes", "group_name", "packing", "hashes")

    @classmethod
    def parse(cls, b: Body) -> DistributedSource:
        """The source's fields of a request body or wire form: ``names``, ``dtypes`` and
        ``shapes`` side by side, ``group_name``, ``packing`` (see the class docstring) and
        ``hashes``.  Raises ``InvalidRequest``."""
        tensors = named_tensors(b)
        names = [t.name for t in tensors]
        group = b.get("group_name", store_name)
        hashes = b.get("hashes", lambda f, v: None if v is None else array_of(_hash)(f, v), None)
        if hashes is not None and len(hashes) != len(names):
            raise invalid("hashes", f"hashes must have one entry per name ({len(names)}), got {len(hashes)}")
        if not b.has("packing") or b.get("packing", lambda f, v: v) is None:
            return cls(group, tensors, hashes=hashes)
        raw = b.get("packing", obj)
        if "flat" in raw:
            flat = Body(raw, ("flat", "flat_bucket_bytes"))
            if not flat.get("flat", lambda f, v: boolean(f"packing.{f}", v)):
                raise invalid(
                    "packing.flat", "packing.flat must be true (omit packing for a per-tensor stream)"
                )
            size = flat.get(
                "flat_bucket_bytes",
                lambda f, v: None if v is None else integer(f"packing.{f}", v, lo=1),
                None,
            )
            return cls(group, tensors, flat=True, flat_bucket_bytes=size, hashes=hashes)
        if hashes is not None:
            raise InvalidRequest(
                "hashes are for a per-tensor or flat stream: weightsync's packed stream carries its own",
                code="conflicting_options",
                field="hashes",
            )
        packing = Body(raw, ("bucket_bytes", "stream_id"))
        return cls(
            group,
            tensors,
            packing.get("bucket_bytes", lambda f, v: integer(f"packing.{f}", v, lo=1)),
            packing.get("stream_id", lambda f, v: store_name(f"packing.{f}", v)),
        )

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "kind": self.kind,
            **_tensor_wire(self.tensors),
            "group_name": self.group_name,
        }
        if self.bucket_bytes is not None or self.stream_id is not None:
            wire["packing"] = {"bucket_bytes": self.bucket_bytes, "stream_id": self.stream_id}
        elif self.flat:
            wire["packing"] = {"flat": True, "flat_bucket_bytes": self.flat_bucket_bytes}
        if self.hashes is not None:
            wire["hashes"] = list(self.hashes)
        return wire

    @classmethod
    def from_wire(cls, wire: Any) -> DistributedSource:
        return cls.parse(_wire_body(wire, cls.kind, cls.FIELDS))


@attrs.frozen(eq=True, hash=False)
class TensorHandle:
    """One tensor shared by a colocated process; ``handle`` is interpreted by the tensor transport."""

    spec: TensorSpec
    handle: dict[str, Any]

    @classmethod
    def parse(cls, field: str, value: Any) -> TensorHandle:
        """``{"name", "dtype", "shape", "handle"}``.  Raises ``InvalidRequest``."""
        t = Body(obj(field, value), ("name", "dtype", "shape", "handle"))
        spec = TensorSpec(t.get("name", string), t.get("dtype", known_dtype), t.get("shape", shape))
        return cls(spec, t.get("handle", obj))

    def to_wire(self) -> dict[str, Any]:
        s = self.spec
        return {"name": s.name, "dtype": s.dtype, "shape": list(s.shape), "handle": self.handle}


def _handles(values: Iterable[TensorHandle]) -> tuple[TensorHandle, ...]:
    return tuple(values)


@attrs.frozen(eq=True, hash=False)
class TensorSource:
    """Tensors in shared memory (CPU) or CUDA IPC handles (GPU) from a colocated trainer."""

    tensors: tuple[TensorHandle, ...] = attrs.field(converter=_handles)
    kind: ClassVar[str] = "tensor"
    FIELDS: ClassVar[tuple[str, ...]] = ("tensors",)

    @classmethod
    def parse(cls, b: Body) -> TensorSource:
        """The source's ``tensors`` of a request body or wire form.  Raises ``InvalidRequest``."""
        tensors = b.get("tensors", array_of(TensorHandle.parse))
        if not tensors:
            raise invalid("tensors", "tensors must not be empty")
        unique_tensor_names("tensors", (h.spec.name for h in tensors))
        return cls(tensors)

    def to_wire(self) -> dict[str, Any]:
        return {"kind": self.kind, "tensors": [h.to_wire() for h in self.tensors]}

    @classmethod
    def from_wire(cls, wire: Any) -> TensorSource:
        return cls.parse(_wire_body(wire, cls.kind, cls.FIELDS))


@attrs.frozen
class PlanSource:
    """This worker's part of a sharded transfer plan (:mod:`weightsync.core.plan.build`), run on a
    weight-update group after a handshake keyed by ``stream_id``."""

    group_name: str
    stream_id: str
    part: PlanPart
    kind: ClassVar[str] = "plan"
    FIELDS: ClassVar[tuple[str, ...]] = ("group_name", "stream_id", "plan")

    @property
    def tensors(self) -> tuple[TensorSpec, ...]:
        return self.part.tensors

    @classmethod
    def parse(cls, b: Body) -> PlanSource:
        """The source's fields of a request body or wire form.  Raises ``InvalidRequest``
        (``invalid_layout`` for a malformed plan part)."""
        return cls(
            b.get("group_name", store_name),
            b.get("stream_id", store_name),
            b.get("plan", lambda f, v: PlanPart.from_wire(obj(f, v))),
        )

    def to_wire(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "group_name": self.group_name,
            "stream_id": self.stream_id,
            "plan": self.part.to_wire(),
        }

    @classmethod
    def from_wire(cls, wire: Any) -> PlanSource:
        return cls.parse(_wire_body(wire, cls.kind, cls.FIELDS))


@attrs.frozen
class HeldBase:
    """What the worker holds as a delta reaches its engine, set by the controller (never by a
    request): the digest of its weights, and its version when declared."""

    digest: str | None
    version: Any = None
    declared: bool = False

    @classmethod
    def parse(cls, field: str, value: Any) -> HeldBase:
        b = Body(obj(field, value), ("digest", "version", "declared"))
        digest = b.get("digest", lambda f, v: None if v is None else hex_digest(f, v))
        return cls(digest, b.get("version", any_json, None), b.get("declared", boolean, False))


@attrs.frozen
class DeltaSource:
    """A delta checkpoint on the worker's filesystem (:mod:`weightsync.transports.delta`): it
    applies only to the exact base it names.  ``held`` is what the controller knows the worker
    holds when the delta reaches the engine (``None`` from a request)."""

    delta_path: str
    held: HeldBase | None = None
    kind: ClassVar[str] = "delta"
    FIELDS: ClassVar[tuple[str, ...]] = ("delta_path",)

    @classmethod
    def parse(cls, b: Body) -> DeltaSource:
        """The source's field of a request body.  Raises ``InvalidRequest``."""
        return cls(b.get("delta_path", string))

    def to_wire(self) -> dict[str, Any]:
        held = None if self.held is None else attrs.asdict(self.held)
        return {"kind": self.kind, "delta_path": self.delta_path, "held": held}

    @classmethod
    def from_wire(cls, wire: Any) -> DeltaSource:
        b = _wire_body(wire, cls.kind, (*cls.FIELDS, "held"))
        held = b.get("held", lambda f, v: None if v is None else HeldBase.parse(f, v), None)
        return cls(b.get("delta_path", string), held)


@attrs.frozen(eq=True, hash=False)
class DeltaStreamSource:
    """A sparse delta broadcast on a weight-update group (:mod:`weightsync.transports.delta.stream`):
    ``counts[i]`` changed elements of ``tensors[i]`` as flat indices and new values, in vLLM's
    ``sparse_nccl`` shape (``stream="sparse"``) or weightsync's trainer's (``"packed"``, after a
    handshake keyed by ``stream_id``).  ``claims`` (base and target the trainer names) are read
    by the channel; ``held`` is set by the controller, never by a request.  Body: ``names``,
    ``dtypes``, ``shapes``, ``group_name`` and ``delta: {"counts", "stream", "stream_id", ...}``."""

    group_name: str
    tensors: tuple[TensorSpec, ...] = attrs.field(converter=specs)
    counts: tuple[int, ...]
    stream: str = "sparse"
    stream_id: str | None = None
    claims: Mapping[str, Any] = attrs.field(factory=dict)
    held: HeldBase | None = None
    kind: ClassVar[str] = "delta_stream"
    FIELDS: ClassVar[tuple[str, ...]] = ("names", "dtypes", "shapes", "group_name", "delta")
    OWN: ClassVar[tuple[str, ...]] = ("counts", "stream", "stream_id")

    @classmethod
    def parse(cls, b: Body) -> DeltaStreamSource:
        """Raises ``InvalidRequest``."""
        tensors, group = named_tensors(b), b.get("group_name", store_name)
        raw = dict(b.get("delta", obj))
        d = Body({k: raw.pop(k) for k in cls.OWN if k in raw}, cls.OWN)
        counts = tuple(
            d.get("counts", lambda f, v: array_of(lambda g, n: integer(g, n, lo=0))(f"delta.{f}", v))
        )
        if len(counts) != len(tensors):
            raise invalid("delta.counts", f"delta.counts must have one entry per name ({len(tensors)})")
        stream = d.get("stream", lambda f, v: one_of(("sparse", "packed"))(f"delta.{f}", v), "sparse")
        stream_id = d.get("stream_id", lambda f, v: store_name(f"delta.{f}", v), None)
        if (stream == "packed") != (stream_id is not None):
            raise invalid("delta.stream_id", "delta.stream_id is given exactly for the packed stream")
        return cls(group, tensors, counts, stream, stream_id, raw)

    def to_wire(self) -> dict[str, Any]:
        delta = {"counts": list(self.counts), "stream": self.stream, **self.claims}
        delta.update({} if self.stream_id is None else {"stream_id": self.stream_id})
        held = None if self.held is None else attrs.asdict(self.held)
        return {"kind": self.kind, **_tensor_wire(self.tensors), "group_name": self.group_name,
                "delta": delta, "held": held}  # fmt: skip

    @classmethod
    def from_wire(cls, wire: Any) -> DeltaStreamSource:
        b = _wire_body(wire, cls.kind, (*cls.FIELDS, "held"))
        held = b.get("held", lambda f, v: None if v is None else HeldBase.parse(f, v), None)
        return attrs.evolve(cls.parse(b), held=held)


_ALL = (DiskSource, DistributedSource, TensorSource, PlanSource, DeltaSource, DeltaStreamSource)
WeightSource = Union[DiskSource, DistributedSource, TensorSource, PlanSource, DeltaSource, DeltaStreamSource]  # noqa: UP007
SourceType = type[WeightSource]
SOURCES: Final[Mapping[str, SourceType]] = {cls.kind: cls for cls in _ALL}


def _wire_body(wire: Any, kind: str, fields: tuple[str, ...]) -> Body:
    b = Body(wire, ("kind", *fields))
    if b.get("kind", string) != kind:
        raise InvalidRequest(f"not a {kind} source", code="invalid_source", field="kind")
    return b


def source_from_wire(wire: Any) -> WeightSource:
    """Rebuild any source from its ``to_wire`` dict (chosen by ``kind``).  Raises
    ``InvalidRequest`` for a malformed dict, as the request parser would."""
    kind = wire.get("kind") if isinstance(wire, dict) else None
    cls = SOURCES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise InvalidRequest(f"not a weight source: kind {short(kind)}", code="invalid_source", field="kind")
    return cls.from_wire(wire)
