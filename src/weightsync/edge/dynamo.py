"""Dynamo's forms of the worker's own ``/engine/*`` routes, mapped onto weightsync's registry routes.

Dynamo's vLLM worker (``components/src/dynamo/vllm/handlers.py``) answers four of its
``/engine/*`` routes by calling the vLLM worker method the body names in ``engine_rpc``, the
rest of the body (less its control keys) becoming the method's keyword arguments:
``update_weights_from_disk`` (``reload_weights``, or a worker extension's
``update_weights_from_path``), ``update_weights_from_distributed`` (vLLM's
``start_weight_update`` / ``update_weights`` with ``update_info`` / ``finish_weight_update``),
``init_weights_update_group`` (``init_weight_transfer_engine`` with ``init_info``) and
``destroy_weights_update_group``.

A weightsync worker takes the same bodies but never calls a method the caller chose: each
route knows a fixed set of Dynamo's methods (:data:`weightsync.core.schemas.DYNAMO_FORMS`, the
form of each body), and each is one call of a registry route, whose own parser then validates
what the form carried — so no rule is written twice and a refusal changes nothing.  A method
not on the map is ``400 method_not_allowed``; Dynamo's default method of a route that belongs
to another framework's worker extension (prime-rl's NCCL broadcaster, which speaks its own
wire protocol) is ``501 not_supported``.  Every field is checked: unknown fields, inside
``update_info`` and ``init_info`` too, are ``unknown_field``, and a field given both beside a
nested object and (by its weightsync name) inside it is ``conflicting_options``.

vLLM has one weight-transfer engine per server: the group joined by
``init_weight_transfer_engine`` is named :data:`GROUP`, the vLLM dialect's group too.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping
from typing import Any, Final

from weightsync.core import events
from weightsync.core.errors import InvalidRequest, NotSupported, WeightSyncError
from weightsync.core.requests import InitGroupRequest, unpaused_options
from weightsync.core.schemas import DYNAMO_FORMS, INIT_INFO, INIT_INFO_GROUP_FIELDS, UPDATE_INFO
from weightsync.core.sources import DistributedSource
from weightsync.core.validation import Body, boolean, integer, short, wrong

__all__ = [
    "FOREIGN",
    "GROUP",
    "MAX_TAINTS",
    "PACKED_BUFFER_BYTES",
    "TAINT_ROUTE",
    "model_taints",
    "translate",
]

GROUP: Final = "vllm"
"""The weight-update group of vLLM's one weight-transfer engine."""

TAINT_ROUTE: Final = "update/model_taints"
"""Dynamo 1.6.1's worker route that sets the worker's routing taints
(``dynamo/common/model_taints.py``: ``POST /engine/update/model_taints {"taints": [...]}``)."""

TOPOLOGY_TAINT_PREFIX: Final = "dynamo.topology/"
"""Taints Dynamo reserves for its own topology labels: refused on the route, as Dynamo does."""

MAX_TAINTS: Final = 256
"""At most this many taints, each at most 256 characters (Dynamo sets no bound)."""

PACKED_BUFFER_BYTES: Final = 1 << 30
"""vLLM's default chunk size of its packed stream (``DEFAULT_PACKED_BUFFER_SIZE_BYTES``)."""

FOREIGN: Final[Mapping[str, str]] = {
    "update_weights_from_distributed": "update_weights_from_path",
    "init_weights_update_group": "init_broadcaster",
    "destroy_weights_update_group": "destroy_broadcaster",
}
"""Dynamo's default method of a route where it is a worker extension's (prime-rl's NCCL
broadcaster), not vLLM's: named, and refused as ``501 not_supported``."""

_NESTED: Final[Mapping[str, frozenset[str]]] = {
    "update_info": frozenset(UPDATE_INFO["properties"]) | frozenset(DistributedSource.FIELDS),
    "init_info": frozenset(INIT_INFO["properties"]) | frozenset(InitGroupRequest.FIELDS),
}
"""What a nested object carries, by its own and by weightsync's names: none of it may also
stand beside it."""

Call = tuple[str, Any]
"""A registry route and the body to parse for it."""


def translate(route: str, body: Any) -> Call:
    """The registry route and body that ``body`` means on ``route``: itself when it names no
    ``engine_rpc`` (weightsync's own form), else the registry call Dynamo's worker method maps
    onto.  Raises ``InvalidRequest`` or ``NotSupported`` (logged as a refusal of ``route``);
    the registry route's parser checks the rest."""
    if route not in DYNAMO_FORMS or type(body) is not dict or "engine_rpc" not in body:
        return route, body
    try:
        return _translate(route, DYNAMO_FORMS[route], body)
    except WeightSyncError as exc:
        events.route_refused(route, exc)
        raise


def _translate(route: str, forms: Mapping[str, Any], body: dict[str, Any]) -> Call:
    method = body["engine_rpc"]
    if type(method) is not str:
        raise wrong("engine_rpc", "a string naming a worker method", method)
    if method == FOREIGN.get(route):
        raise NotSupported(
            f"engine_rpc {method!r} is a worker extension's method (prime-rl's NCCL broadcaster, "
            f"with its own wire protocol), not spoken here; {route} takes {sorted(forms)}",
            code="not_supported",
            field="engine_rpc",
        )
    if method not in forms:
        raise InvalidRequest(
            f"engine_rpc {short(method)} is not a worker method {route} takes: one of {sorted(forms)}",
            code="method_not_allowed",
            field="engine_rpc",
        )
    rest = {k: v for k, v in body.items() if k != "engine_rpc"}
    for nested, carried in _NESTED.items():
        clash = sorted(set(rest) & carried) if nested in rest else []
        if clash:
            raise InvalidRequest(
                f"{clash} given beside {nested}, which carries them: give each once, inside {nested}",
                code="conflicting_options",
                fields=clash,
            )
    b = Body(rest, tuple(p for p in forms[method]["properties"] if p != "engine_rpc"))
    return _CALLS[method](b, rest)


def _disk(_: Body, rest: dict[str, Any]) -> Call:
    # reload_weights(weights_path=model_path) and update_weights_from_path(weight_path=model_path)
    # both load the checkpoint at model_path: weightsync's disk update, every field its own
    return "update_weights_from_disk", rest


def _start(b: Body, _: dict[str, Any]) -> Call:
    unpaused_options(b)  # checked; a session needs a paused worker whatever they say
    if not b.get("is_checkpoint_format", boolean, True):
        raise NotSupported(
            "is_checkpoint_format false (tensors in the engine's kernel layout) is not supported: "
            "send checkpoint-format tensors",
            code="not_supported",
            field="is_checkpoint_format",
        )
    return "begin_weight_update", {}


def _update(b: Body, rest: dict[str, Any]) -> Call:
    unpaused_options(b)  # checked; the cache is reset (or not) by the finish
    body = update_info(b.get("update_info", lambda f, v: v))
    if "weight_version" in rest:
        body["weight_version"] = rest["weight_version"]
    return "update_weights_from_distributed", {**body, "session": True}


def _finish(b: Body, rest: dict[str, Any]) -> Call:
    _, reset = unpaused_options(b)
    body: dict[str, Any] = {"reset_prefix_cache": reset}
    if "weight_version" in rest:
        body["weight_version"] = rest["weight_version"]
    return "end_weight_update", body


def _init(b: Body, _: dict[str, Any]) -> Call:
    return "init_weights_update_group", init_info(b.get("init_info", lambda f, v: v))


def _shutdown(_: Body, __: dict[str, Any]) -> Call:
    return "destroy_weights_update_group", {"group_name": GROUP}


_CALLS: Final[Mapping[str, Callable[[Body, dict[str, Any]], Call]]] = {
    "reload_weights": _disk,
    "update_weights_from_path": _disk,
    "start_weight_update": _start,
    "update_weights": _update,
    "finish_weight_update": _finish,
    "init_weight_transfer_engine": _init,
    "shutdown_weight_transfer_engine": _shutdown,
}


def _nested(field: str, value: Any, schema: Mapping[str, Any]) -> dict[str, Any]:
    """``value`` as the object ``schema`` describes, its fields named ``field.<name>`` in
    refusals: not an object, an unknown or a missing field."""
    if type(value) is not dict:
        raise wrong(field, "an object", value)
    unknown = sorted(f"{field}.{k}" for k in set(value) - set(schema["properties"]))
    if unknown:
        raise InvalidRequest(
            f"unknown field(s) {unknown}; allowed: {sorted(schema['properties'])}",
            code="unknown_field",
            fields=unknown,
        )
    for name in schema["required"]:
        if name not in value:
            raise InvalidRequest(
                f"missing required field '{field}.{name}'", code="missing_field", field=f"{field}.{name}"
            )
    return value


def _positive(field: str, value: Any) -> int:
    return integer(field, value, lo=1)


def update_info(value: Any) -> dict[str, Any]:
    """vLLM's ``update_info`` as the source fields of ``update_weights_from_distributed`` on
    :data:`GROUP`: one broadcast per tensor, or with ``packed`` vLLM's packed stream (the bytes
    concatenated in order, a chunk closing after the tensor that takes it past
    ``packed_buffer_size_bytes``).  Raises ``InvalidRequest``."""
    info = _nested("update_info", value, UPDATE_INFO)
    packed = boolean("update_info.packed", info.get("packed", False))
    size = _positive(
        "update_info.packed_buffer_size_bytes", info.get("packed_buffer_size_bytes", PACKED_BUFFER_BYTES)
    )
    _positive("update_info.packed_num_buffers", info.get("packed_num_buffers", 2))  # the trainer's pipelining
    body = {
        "names": info["names"],
        "dtypes": info["dtype_names"],
        "shapes": info["shapes"],
        "group_name": GROUP,
    }
    if "hashes" in info:
        body["hashes"] = info["hashes"]
    if packed:
        body["packing"] = {"flat": True, "flat_bucket_bytes": size}
    return body


def refuse_nccl_unique_id(info: Mapping[str, Any]) -> None:
    """Check a pre-shared NCCL unique id (``nccl_unique_id_b64``, vLLM's torch-free
    rendezvous) as vLLM's ``decode_nccl_unique_id`` does (standard base64 of 128 bytes, never
    beside ``master_address``/``master_port``: ``InvalidRequest``), then raise ``NotSupported``:
    the group meets through a TCPStore rendezvous here."""
    uid = info.get("nccl_unique_id_b64")
    if uid is None:
        return
    field = "init_info.nccl_unique_id_b64"
    if "master_address" in info or "master_port" in info:
        raise InvalidRequest(
            "pass nccl_unique_id_b64 OR master_address/master_port, not both",
            code="conflicting_options",
            field=field,
        )
    try:
        raw = base64.b64decode(uid, validate=True) if isinstance(uid, str) and len(uid) < 1024 else None
    except ValueError:
        raw = None
    if raw is None or len(raw) != 128:
        raise InvalidRequest(
            "nccl_unique_id_b64 must be standard base64 of the 128 bytes of an ncclUniqueId",
            code="invalid_value",
            field=field,
        )
    raise NotSupported(
        "joining by a pre-shared NCCL unique id (a torch-free trainer) is not supported: pass "
        "master_address and master_port (vLLM's StatelessProcessGroup rendezvous, or a gloo group)",
        code="not_supported",
        field=field,
    )


def default_rendezvous(info: dict[str, Any], stream: str = "nccl") -> None:
    """Name, unless ``info`` does, how the dialect's trainer forms its group: vLLM's stock
    trainer ``StatelessProcessGroup`` + ``PyNcclCommunicator`` on nccl, a plain
    ``torch.distributed.init_process_group`` on gloo (weightsync's documented extension),
    weightsync's own trainer (``stream: "weightsync"``) its ``process_group``."""
    if stream == "weightsync":
        info.setdefault("rendezvous", "process_group")
    else:
        info.setdefault(
            "rendezvous", "default_group" if info.get("backend", "nccl") == "gloo" else "vllm_stateless"
        )


def init_info(value: Any) -> dict[str, Any]:
    """vLLM's ``init_info`` as the body of ``init_weights_update_group`` on :data:`GROUP`; on
    ``gloo`` the group is received by a helper process (the stream is bare: its sizes are the
    request's word).  Raises ``InvalidRequest``, or ``NotSupported`` for a pre-shared NCCL id
    and for ``packed`` (announce it per update: ``update_info.packed``)."""
    info = _nested("init_info", value, INIT_INFO)
    refuse_nccl_unique_id(info)
    if boolean("init_info.packed", info.get("packed", False)):
        raise NotSupported(
            "init_info.packed is not remembered by this route: send packed (and packed_buffer_size_bytes) "
            "in each update_info",
            code="not_supported",
            field="init_info.packed",
        )
    for name in ("packed_buffer_size_bytes", "packed_num_buffers"):
        if name in info:
            _positive(f"init_info.{name}", info[name])  # no effect on an unpacked stream
    body = {k: info[k] for k in INIT_INFO_GROUP_FIELDS if k in info}
    default_rendezvous(body)
    if body.get("backend") == "gloo":
        body["receiver"] = "process"
    return {**body, "group_name": GROUP}


def model_taints(body: Any) -> frozenset[str]:
    """The taints of Dynamo's ``update/model_taints`` body (``{"taints": [str, ...]}``, repeats
    counted once), checked as Dynamo checks them plus a bound.  Raises ``InvalidRequest``:
    ``wrong_type`` when ``taints`` is not an array of strings (or missing), ``invalid_value``
    for a reserved prefix or past :data:`MAX_TAINTS`, ``unknown_field`` for any other field."""
    b = Body(body, ("taints",))
    taints = b.get("taints", lambda f, v: v, None)
    if type(taints) is not list or any(type(t) is not str for t in taints):
        raise InvalidRequest("'taints' must be a JSON array of strings", code="wrong_type", field="taints")
    if len(taints) > MAX_TAINTS or any(not t or len(t) > 256 for t in taints):
        raise InvalidRequest(
            f"at most {MAX_TAINTS} taints, each of 1 to 256 characters", code="invalid_value", field="taints"
        )
    reserved = next((t for t in taints if t.startswith(TOPOLOGY_TAINT_PREFIX)), None)
    if reserved is not None:
        raise InvalidRequest(
            f"taint {reserved!r} uses reserved prefix {TOPOLOGY_TAINT_PREFIX!r}",
            code="invalid_value",
            field="taints",
        )
    return frozenset(taints)
