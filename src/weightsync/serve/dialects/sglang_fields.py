"""The fields of SGLang's request bodies as its server reads them (pydantic models with
``extra="forbid"``): unknown fields refused, strict booleans, ``weight_version`` passed on when
given, ``load_format`` among those a route takes; pickled fields refused first.
"""

from __future__ import annotations

from typing import Any

from weightsync.core.errors import InvalidRequest, NotSupported
from weightsync.serve.dialects.common import PICKLED_FIELDS, dict_body, refuse_pickle


def fields(body: Any, allowed: tuple[str, ...]) -> dict[str, Any]:
    """``body`` as a dict of ``allowed`` fields: a pickled field (``pickle_refused``) or a field
    outside ``allowed`` (``unknown_field``) is refused."""
    b = dict_body("body", body)
    refuse_pickle(b)
    unknown = sorted(set(b) - set(allowed))
    if unknown:
        raise InvalidRequest(
            f"unknown field(s) {unknown}; allowed: {list(allowed)}", code="unknown_field", fields=unknown
        )
    return b


def boolean(body: dict[str, Any], field: str, default: bool) -> bool:
    """``body[field]`` (``default`` when absent), a strict boolean (``wrong_type``)."""
    value = body.get(field, default)
    if type(value) is not bool:
        raise InvalidRequest(f"{field} must be a boolean", code="wrong_type", field=field)
    return value


def version_field(body: dict[str, Any]) -> dict[str, Any]:
    """``weight_version`` for a weightsync body: omitted when SGLang's is absent or null."""
    return {"weight_version": body["weight_version"]} if body.get("weight_version") is not None else {}


def load_format(body: dict[str, Any], allowed: tuple[Any, ...]) -> Any:
    """``body``'s ``load_format``, one of ``allowed`` (else ``not_supported``)."""
    value = body.get("load_format")
    if value not in allowed:
        raise NotSupported(
            f"load_format {value!r} is not supported here; use one of {[a for a in allowed if a]}",
            code="not_supported",
            field="load_format",
        )
    return value


def distributed_stream(body: Any, default_group: str) -> dict[str, Any]:
    """The stream an ``/update_weights_from_distributed`` body declares, read as far as it
    goes and nothing more (for a refusal to settle: :func:`weightsync.core.routes.declared_stream`): the lists
    renamed as weightsync's, the group (SGLang's default when absent), and the flat packing of
    a ``flattened_bucket``.  Nothing for a body that declares no lists, or carries a pickled
    payload (no broadcast comes with it)."""
    b = body if type(body) is dict else {}
    if not b.keys() & {"names", "dtypes", "dtype_names", "shapes"} or b.keys() & PICKLED_FIELDS.keys():
        return {}
    stream = {
        "names": b.get("names"),
        "dtypes": b.get("dtypes", b.get("dtype_names")),
        "shapes": b.get("shapes"),
        "group_name": b.get("group_name", default_group),
    }
    if b.get("load_format") == "flattened_bucket":
        stream["packing"] = {"flat": True}
    return {k: v for k, v in stream.items() if v is not None}
