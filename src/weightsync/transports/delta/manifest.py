"""``weightsync-delta.json``: what a delta checkpoint applies to, what it makes, and how.

A delta checkpoint is a directory written atomically: an ordinary weightsync checkpoint (the
payload tensors, with their index and ``weightsync-manifest.json``, so every byte of the
payload is checksummed like any checkpoint's) plus this file::

    {"format": "weightsync-delta/1", "encoding": "sparse" | "xor",
     "linear": "weightsync-linear/1",
     "base":   {"version": <any JSON>, "digest": "<32 hex>"},
     "target": {"version": <any JSON>, "digest": "<32 hex>"},
     "tensors": {"<name>": {"dtype": "bfloat16", "shape": [..], "changed": <int>,
                            "base_hash": "<16 hex>", "target_hash": "<16 hex>",
                            "base_linear": [a, b], "target_linear": [c, d],
                            "indices": "<payload key>", "values": "<payload key>"}}}

``tensors`` names every tensor of the model (``changed`` 0 for one the delta leaves alone, with
no payload keys), so the two digests can be checked against the per-tensor hashes before a
byte is read: ``base.digest`` is the digest of the ``base_hash`` es and ``target.digest`` of the
``target_hash`` es, as :func:`weightsync.core.held.weights_digest` combines them (the digest
``get_weight_version`` reports).  For ``sparse`` the payload's ``values`` are the new elements;
for ``xor`` they are the xor of old and new raw bits, in the tensor's own dtype.
:class:`DeltaManifest.from_json` refuses anything else with ``bad_delta``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import attrs

from weightsync.core.dtypes import DTYPES
from weightsync.core.errors import InvalidRequest
from weightsync.core.held import weights_digest
from weightsync.core.validation import Body, any_json, hex_digest, integer, obj, one_of, shape, short, string
from weightsync.transports.delta.linear import LANES, SCHEME, P
from weightsync.transports.disk.manifest import DELTA_NAME

DELTA_FORMAT: Final = "weightsync-delta/1"
ENCODINGS: Final = ("sparse", "xor")
MAX_TENSORS: Final = 1 << 20


def bad_delta(why: str, **details: Any) -> InvalidRequest:
    return InvalidRequest(f"not a valid delta: {why}", code="bad_delta", **details)


def _hash16(field: str, value: Any) -> str:
    text = hex_digest(field, value)
    if len(text) != 16:
        raise InvalidRequest(f"{field} must be 16 hex digits (xxh3-64), got {short(text)}", code="bad_delta")
    return text


def _linear(field: str, value: Any) -> tuple[int, ...]:
    if type(value) is not list or len(value) != LANES:
        raise InvalidRequest(f"{field} must be a list of {LANES} integers", code="bad_delta")
    return tuple(integer(f"{field}[{i}]", v, 0, P - 1) for i, v in enumerate(value))


@attrs.frozen
class Point:
    """One end of a delta: the version label and the content digest."""

    version: Any
    digest: str

    @classmethod
    def parse(cls, field: str, value: Any) -> Point:
        b = Body(obj(field, value), ("version", "digest"))
        return cls(b.get("version", any_json, None), b.get("digest", hex_digest))

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "digest": self.digest}


@attrs.frozen
class TensorDelta:
    """What the delta does to one tensor."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    changed: int
    base_hash: str
    target_hash: str
    base_linear: tuple[int, ...]
    target_linear: tuple[int, ...]
    indices: str | None = None
    values: str | None = None

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @classmethod
    def parse(cls, name: str, value: Any) -> TensorDelta:
        fields = ("dtype", "shape", "changed", "base_hash", "target_hash", "base_linear",
                  "target_linear", "indices", "values")  # fmt: skip
        b = Body(obj(name, value), fields)
        entry = cls(
            name,
            b.get("dtype", one_of(sorted(DTYPES))),
            b.get("shape", shape),
            b.get("changed", integer),
            b.get("base_hash", _hash16),
            b.get("target_hash", _hash16),
            b.get("base_linear", _linear),
            b.get("target_linear", _linear),
            b.get("indices", string, None),
            b.get("values", string, None),
        )
        if not 0 <= entry.changed <= entry.numel:
            raise bad_delta(f"tensor {short(name)}: changed {entry.changed} is not within 0..{entry.numel}")
        if (entry.changed > 0) != (entry.indices is not None and entry.values is not None):
            raise bad_delta(f"tensor {short(name)}: payload keys must be given exactly when elements change")
        if entry.changed == 0 and (
            entry.base_hash != entry.target_hash or entry.base_linear != entry.target_linear
        ):
            raise bad_delta(f"tensor {short(name)}: unchanged, yet its base and target differ")
        return entry

    def to_json(self) -> dict[str, Any]:
        out = attrs.asdict(self, recurse=False)
        del out["name"]
        out["shape"] = list(self.shape)
        out["base_linear"] = list(self.base_linear)
        out["target_linear"] = list(self.target_linear)
        if self.changed == 0:
            del out["indices"], out["values"]
        return out


@attrs.frozen
class DeltaManifest:
    """A parsed and self-consistent ``weightsync-delta.json``."""

    encoding: str
    base: Point
    target: Point
    tensors: Mapping[str, TensorDelta]

    @property
    def changed(self) -> list[TensorDelta]:
        return [t for t in self.tensors.values() if t.changed]

    @classmethod
    def from_json(cls, value: Any) -> DeltaManifest:
        """Raises ``InvalidRequest`` (``bad_delta``) for anything malformed or inconsistent."""
        try:
            return cls._parse(value)
        except InvalidRequest as exc:
            if exc.code == "bad_delta":
                raise
            raise bad_delta(exc.message) from None

    @classmethod
    def _parse(cls, value: Any) -> DeltaManifest:
        b = Body(obj(DELTA_NAME, value), ("format", "encoding", "linear", "base", "target", "tensors"))
        if b.get("format", string) != DELTA_FORMAT:
            raise bad_delta(f"format is not {DELTA_FORMAT!r}")
        if b.get("linear", string) != SCHEME:
            raise bad_delta(f"linear is not {SCHEME!r}")
        raw = b.get("tensors", obj)
        if not raw or len(raw) > MAX_TENSORS:
            raise bad_delta(f"tensors must name 1 to {MAX_TENSORS} tensors")
        tensors = {name: TensorDelta.parse(name, entry) for name, entry in raw.items()}
        keys = [k for t in tensors.values() for k in (t.indices, t.values) if k is not None]
        if len(keys) != len(set(keys)):
            raise bad_delta("a payload key is used twice")
        manifest = cls(
            b.get("encoding", one_of(ENCODINGS)),
            b.get("base", Point.parse),
            b.get("target", Point.parse),
            tensors,
        )
        manifest._check_digests()
        return manifest

    def _check_digests(self) -> None:
        for point, attr in ((self.base, "base_hash"), (self.target, "target_hash")):
            try:
                digest = weights_digest({t.name: getattr(t, attr) for t in self.tensors.values()})
            except ValueError as exc:
                raise bad_delta(str(exc)) from None
            if digest != point.digest:
                which = attr.split("_")[0]
                raise bad_delta(f"{which}.digest is not the digest of the tensors' {attr}es", field=which)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": DELTA_FORMAT,
            "encoding": self.encoding,
            "linear": SCHEME,
            "base": self.base.to_json(),
            "target": self.target.to_json(),
            "tensors": {name: t.to_json() for name, t in self.tensors.items()},
        }
