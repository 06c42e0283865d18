"""What vLLM's trainers send to the weight-transfer routes, read into weightsync's requests.

``init_info`` (``/init_weight_transfer_engine``) becomes the body of
``init_weights_update_group`` and a :class:`Transfer` (what the trainer said about the stream
to come); each ``update_info`` (``/update_weights``) becomes the body of
``update_weights_from_distributed``.  Both are translations only: the registry's parsers
check what comes out.  :func:`located` puts a refusal's field where vLLM's client put it
(``init_info.master_port``, ``update_info[1].dtype_names``), so the error's ``param`` points
into the request that was sent.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Final

import attrs

from weightsync.core.errors import InvalidRequest, NotSupported, WeightSyncError
from weightsync.edge.dynamo import default_rendezvous, refuse_nccl_unique_id
from weightsync.serve.dialects.common import PICKLED_FIELDS, dict_body, refuse_pickle

GROUP: Final = "vllm"
"""The weight-update group the vLLM dialect joins at ``/init_weight_transfer_engine``."""

DEFAULT_PACKED_BUFFER_BYTES: Final = 1024 * 1024 * 1024
"""vLLM's ``DEFAULT_PACKED_BUFFER_SIZE_BYTES``: the chunk size of its packed stream."""

STREAM_FORMATS: Final = ("nccl", "weightsync")

UPDATE_NAMES: Final = {"dtypes": "dtype_names", "group_name": None}
"""weightsync's field names in an update refusal, as ``update_info`` spells them (None: a
field the dialect sets, not the trainer)."""

INIT_NAMES: Final = {"group_name": None}
"""The same for ``init_info``."""


@attrs.define
class Transfer:
    """What the trainer said at ``/init_weight_transfer_engine`` about the stream to come."""

    stream: str = "nccl"  # "nccl": vLLM's stock stream; "weightsync": the packed, checksummed one
    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_BYTES


def only(body: Any, fields: tuple[str, ...]) -> dict[str, Any]:
    """``body`` as an object with no field outside ``fields`` (400 ``unknown_field`` otherwise)."""
    b = dict_body("body", body)
    unknown = sorted(set(b) - set(fields))
    if unknown:
        raise InvalidRequest(
            f"unknown field(s) {unknown}; allowed: {list(fields)}", code="unknown_field", fields=unknown
        )
    return b


@contextmanager
def located(where: str, names: Mapping[str, str | None]) -> Iterator[None]:
    """Refusals raised inside name their field below ``where`` (``init_info``,
    ``update_info[0]``), renamed by ``names``; a field already below ``where`` is kept."""
    try:
        yield
    except WeightSyncError as exc:
        details = exc.details
        field = details.get("field")
        if not isinstance(field, str):
            fields = details.get("fields")
            field = fields[0] if isinstance(fields, list) and fields and isinstance(fields[0], str) else None
        if field is not None and field != where and not field.startswith((f"{where}.", f"{where}[")):
            root = re.split(r"[.\[]", field, maxsplit=1)[0]
            name = names.get(root, root)
            if name is None:
                details.pop("field", None)
            else:
                details["field"] = f"{where}.{name}{field[len(root) :]}"
        raise


def init_body(init_info: Any) -> tuple[dict[str, Any], Transfer]:
    """``init_info`` (vLLM's stock ``nccl`` shape, or the ``weightsync`` backend's) as the body
    of ``init_weights_update_group`` and the :class:`Transfer` it announces.  Fields left
    over stay in the body, for the registry's parser to refuse."""
    info = dict(dict_body("init_info", init_info))
    refuse_nccl_unique_id(info)
    info.pop("nccl_unique_id_b64", None)  # null: vLLM's unset rendezvous field
    stream = info.pop("stream", "nccl")
    if stream not in STREAM_FORMATS:
        raise InvalidRequest(
            f"init_info.stream must be one of {list(STREAM_FORMATS)}",
            code="invalid_value",
            field="init_info.stream",
        )
    packed = info.pop("packed", False)
    if type(packed) is not bool:
        raise InvalidRequest(
            "init_info.packed must be a boolean", code="wrong_type", field="init_info.packed"
        )
    size = info.pop("packed_buffer_size_bytes", DEFAULT_PACKED_BUFFER_BYTES)
    if type(size) is not int or size < 1:
        raise InvalidRequest(
            "init_info.packed_buffer_size_bytes must be a positive integer",
            code="invalid_value",
            field="init_info.packed_buffer_size_bytes",
        )
    buffers = info.pop("packed_num_buffers", 2)
    if type(buffers) is not int or buffers < 1:
        raise InvalidRequest(
            "init_info.packed_num_buffers must be a positive integer",
            code="invalid_value",
            field="init_info.packed_num_buffers",
        )
    info.setdefault("backend", "nccl")  # vLLM's stock backend; the weightsync backend names its own
    default_rendezvous(info, stream)
    if stream == "nccl" and info["backend"] == "gloo":
        info.setdefault("receiver", "process")  # a bare stream's sizes are the request's word
    return {**info, "group_name": GROUP}, Transfer(stream, packed, size)


def update_body(update_info: Any, transfer: Transfer, where: str = "update_info") -> dict[str, Any]:
    """One ``update_info`` object (``where`` says which) as the body of
    ``update_weights_from_distributed``.

    The stock ``nccl`` shape (``names``, ``dtype_names``, ``shapes``) is one broadcast per
    tensor, or vLLM's packed stream when the init said ``packed``; the ``weightsync`` backend
    adds ``packing`` (bucket size and stream id) for its packed, checksummed stream.  Optional
    ``hashes`` (xxh3-64 per tensor) make a bare per-tensor stream verified.  Pickled payloads
    are refused."""
    info = dict(dict_body(where, update_info))
    refuse_pickle(info)
    if "num_updates_list" in info:
        return sparse_body(info, where)
    if "packed" in info:  # older vLLM carried the wire params per update
        packed = info.pop("packed")
        if type(packed) is not bool:
            raise InvalidRequest(f"{where}.packed must be a boolean", code="wrong_type", field="packed")
        transfer = attrs.evolve(transfer, packed=packed)
    for legacy in ("packed_buffer_size_bytes", "packed_num_buffers"):
        info.pop(legacy, None)
    body: dict[str, Any] = {"group_name": GROUP}
    for ours, theirs in (("names", "names"), ("dtypes", "dtype_names"), ("shapes", "shapes")):
        if theirs in info:
            body[ours] = info.pop(theirs)
    if transfer.stream == "weightsync":
        if "packing" not in info:
            raise InvalidRequest(
                f"{where}.packing is required on the weightsync stream", code="missing_field", field="packing"
            )
        body["packing"] = info.pop("packing")
    elif transfer.packed:
        body["packing"] = {"flat": True, "flat_bucket_bytes": transfer.packed_buffer_size_bytes}
    return {**info, **body}  # anything left is refused by the registry's parser


def stream_fields(update_info: Any, transfer: Transfer) -> dict[str, Any]:
    """The stream an ``update_info`` item declares, read as far as it goes and nothing more
    (for a refusal to settle: :func:`weightsync.core.routes.declared_stream`): its lists renamed, and the packing
    the init announced.  Nothing for an item that declares no lists, or that carries its
    tensors another way (CUDA IPC handles: no broadcast comes); a sparse delta declares no
    stream to settle."""
    info = update_info if type(update_info) is dict else {}
    if not info.keys() & {"names", "dtype_names", "shapes"} or info.keys() & PICKLED_FIELDS.keys():
        return {}
    body: dict[str, Any] = {"group_name": GROUP}
    for ours, theirs in (("names", "names"), ("dtypes", "dtype_names"), ("shapes", "shapes")):
        if theirs in info:
            body[ours] = info[theirs]
    if "num_updates_list" in info:
        body["delta"] = {}
    elif transfer.stream == "weightsync":
        body["packing"] = info.get("packing")
    elif transfer.packed or info.get("packed") is True:
        body["packing"] = {"flat": True, "flat_bucket_bytes": transfer.packed_buffer_size_bytes}
    return body


SPARSE_EXTRAS: Final = ("target_hashes", "base_linear", "target_linear")
"""weightsync's optional claims beside vLLM's sparse ``update_info`` (with ``base_digest`` and
``base_version``): see :mod:`weightsync.transports.delta.stream`."""


def sparse_body(info: dict[str, Any], where: str) -> dict[str, Any]:
    """vLLM's ``sparse_nccl`` ``update_info`` (``names``, ``dtype_names``, ``shapes``,
    ``num_updates_list``: per parameter, its int32 indices then its values, broadcast from rank
    0) as ``update_weights_from_distributed`` with a ``delta``.  weightsync's optional claims
    ride beside vLLM's fields: ``base_digest`` (and ``base_version``) name the base the worker
    must hold (409 ``base_mismatch``), ``target_hashes``, ``base_linear`` and ``target_linear``
    verify the write in O(changed elements)."""
    counts = info.pop("num_updates_list")
    if type(counts) is not list or any(type(n) is not int or n < 0 for n in counts):
        raise InvalidRequest(
            f"{where}.num_updates_list must be an array of non-negative integers",
            code="invalid_value",
            field="num_updates_list",
        )
    if type(info.get("names")) is list and len(counts) != len(info["names"]):
        raise InvalidRequest(
            f"{where}.num_updates_list must have one entry per name",
            code="invalid_value",
            field="num_updates_list",
        )
    delta: dict[str, Any] = {"counts": counts, "stream": "sparse"}
    if "base_digest" in info:
        delta["base"] = {"digest": info.pop("base_digest")}
        if "base_version" in info:
            delta["base"]["version"] = info.pop("base_version")
    delta.update({k: info.pop(k) for k in SPARSE_EXTRAS if k in info})
    body: dict[str, Any] = {"group_name": GROUP, "delta": delta}
    for ours, theirs in (("names", "names"), ("dtypes", "dtype_names"), ("shapes", "shapes")):
        if theirs in info:
            body[ours] = info.pop(theirs)
    return {**info, **body}  # anything left is refused by the registry's parser


METADATA: Final = ("names", "dtype_names", "shapes")
"""The ``update_info`` lists vLLM 0.33 leaves empty to mean "the previous call's"."""


def with_metadata(item: Any, last: dict[str, Any] | None, where: str) -> tuple[Any, dict[str, Any] | None]:
    """One ``update_info`` item with the previous call's metadata in place of three empty lists
    (vLLM 0.33's ``NCCLWeightTransferEngine.receive_weights``), and the metadata to remember
    for the next call (the item's own, when it carries names).  Raises ``InvalidRequest``
    (``no_previous_metadata``) for empty lists with nothing to reuse."""
    if type(item) is not dict or "num_updates_list" in item:
        return item, last  # refused by the translation, or a sparse update (its own metadata)
    lists = [item.get(key) for key in METADATA]
    if all(v == [] or v is None for v in lists) and any(v == [] for v in lists):
        if last is None:
            raise InvalidRequest(
                f"{where} has empty names, dtype_names and shapes, which mean the previous update's, "
                "and this group has had none: send them in full; the weight-transfer group was shut "
                "down so that the trainer's broadcast fails instead of hanging (init it again)",
                code="no_previous_metadata",
                field="names",
            )
        return {**item, **last}, last
    if type(item.get("names")) is list and item["names"]:
        last = {key: item.get(key) for key in METADATA}
    return item, last


def checker_body(body: dict[str, Any]) -> tuple[str, dict[str, str] | None]:
    """``/weight_checker``'s ``action`` and ``baseline``, checked.  Raises ``InvalidRequest``,
    or ``NotSupported`` for ``reset`` (weights change only through an update)."""
    action = body.get("action")
    if action not in ("checksum", "reset", "compare"):
        raise InvalidRequest(
            "action must be one of 'checksum', 'reset', 'compare'", code="invalid_value", field="action"
        )
    if action == "reset":
        raise NotSupported(
            "resetting weights outside an update is refused: load known weights with an update instead",
            code="not_supported",
            field="action",
        )
    baseline = body.get("baseline")
    if action == "compare":
        if type(baseline) is not dict or any(type(v) is not str for v in baseline.values()):
            raise InvalidRequest(
                "action='compare' requires a 'baseline' object of name -> checksum strings",
                code="invalid_value",
                field="baseline",
            )
    elif baseline is not None:
        raise InvalidRequest("baseline is only for action='compare'", code="unknown_field", field="baseline")
    return action, baseline
