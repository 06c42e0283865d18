"""JSON Schemas of the admin routes' bodies and ok replies: plain data the route registry
(:mod:`weightsync.core.routes`) points at, so the OpenAPI document, the fuzz tests and the
docs all read them from one place.

Body schemas describe what the parser in :mod:`weightsync.core.requests` accepts, except for
rules across fields (equal lengths, conflicting flags) that JSON Schema cannot say; the
parser stays the authority.  Reply schemas name the fields an ok reply always carries;
replies may add more (``stats`` grows per channel).
"""

from __future__ import annotations

from typing import Any, Final

from weightsync.core import dtypes
from weightsync.core.requests import MAX_TIMEOUT_S

Schema = dict[str, Any]

_any: Final[Schema] = {}
_bool: Final = {"type": "boolean"}
_str: Final = {"type": "string", "minLength": 1}
_int: Final = {"type": "integer", "minimum": 0}
_dtype: Final = {"type": "string", "enum": list(dtypes.NAMES)}
_shape: Final = {"type": "array", "items": {"type": "integer", "minimum": 0}}
_update: Final = {
    "weight_version": _any, "allow_unpaused": _bool, "reset_prefix_cache": _bool, "dry_run": _bool,
    "session": _bool,
}  # fmt: skip
_hex: Final = {"type": "string", "pattern": "^[0-9a-f]{1,128}$"}
_digest: Final = {"type": ["string", "null"]}
_epoch: Final = {"type": ["integer", "null"]}


def object_schema(props: Schema, required: tuple[str, ...] = ()) -> Schema:
    return {"type": "object", "properties": props, "required": list(required), "additionalProperties": False}


def _reply(props: Schema) -> Schema:
    """An ok reply: ``status`` plus ``props`` (all present; more fields may follow)."""
    return {
        "type": "object",
        "properties": {"status": {"type": "string", "enum": ["ok"]}, **props},
        "required": ["status", *props],
    }


# ---------------------------------------------------------------- bodies

EMPTY: Final = object_schema({})
SET_VERSION: Final = object_schema(
    {
        "weight_version": _any,
        "epoch": {**_int, "maximum": 2**63 - 1},
        "expected_digest": _hex,
        "not_after": {"type": "number", "exclusiveMinimum": 0, "maximum": 253402300799},
    },
    ("weight_version",),
)
DISK_UPDATE: Final = object_schema(
    {"model_path": _str, "allow_partial": _bool, "allow_dtype_cast": _bool, "relabel": _bool, **_update},
    ("model_path",),
)
DISTRIBUTED_UPDATE: Final = object_schema(
    {
        "names": {"type": "array", "items": _str, "minItems": 1},
        "dtypes": {"type": "array", "items": _dtype},
        "shapes": {"type": "array", "items": _shape},
        "group_name": _str,
        "packing": {
            "oneOf": [
                object_schema(
                    {"bucket_bytes": {"type": "integer", "minimum": 1}, "stream_id": _str},
                    ("bucket_bytes", "stream_id"),
                ),
                object_schema(
                    {
                        "flat": {"type": "boolean", "enum": [True]},
                        "flat_bucket_bytes": {"type": "integer", "minimum": 1},
                    },
                    ("flat",),
                ),
            ]
        },
        "hashes": {"type": "array", "items": {"type": "string", "pattern": "^[0-9a-f]{16}$"}},
        "delta": {  # a sparse delta stream instead of dense tensors (weightsync.transports.delta.stream)
            "type": "object",
            "properties": {
                "counts": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                "stream": {"enum": ["sparse", "packed"]},
                "stream_id": _str,
                "base": {"type": "object"},
                "target": {"type": "object"},
                "target_hashes": {"type": "array"},
                "base_linear": {"type": "array"},
                "target_linear": {"type": "array"},
            },
            "required": ["counts"],
            "additionalProperties": False,
        },
        **_update,
    },
    ("names", "dtypes", "shapes", "group_name"),
)
DELTA_UPDATE: Final = object_schema({"delta_path": _str, **_update}, ("delta_path",))
PLAN_UPDATE: Final = object_schema(
    {
        "group_name": _str,
        "stream_id": _str,
        "plan": {"type": "object"},
        **_update,
    },
    ("group_name", "stream_id", "plan"),
)
TENSOR_UPDATE: Final = object_schema(
    {
        "tensors": {
            "type": "array",
            "minItems": 1,
            "items": object_schema(
                {"name": _str, "dtype": _dtype, "shape": _shape, "handle": {"type": "object"}},
                ("name", "dtype", "shape", "handle"),
            ),
        },
        **_update,
    },
    ("tensors",),
)
INIT_GROUP: Final = object_schema(
    {
        "master_address": _str,
        "master_port": {"type": "integer", "minimum": 1, "maximum": 65535},
        "rank_offset": {"type": "integer", "minimum": 1},
        "world_size": {"type": "integer", "minimum": 2},
        "group_name": _str,
        "backend": {"type": "string", "enum": ["nccl", "gloo"]},
        "timeout_s": {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_TIMEOUT_S},
        "receiver": {"type": "string", "enum": ["inline", "process"]},
        "rendezvous": {"type": "string", "enum": ["process_group", "default_group", "vllm_stateless"]},
    },
    ("master_address", "master_port", "rank_offset", "world_size", "group_name"),
)
GROUP_NAME: Final = object_schema({"group_name": _str}, ("group_name",))
PAUSE: Final = object_schema(
    {"mode": {"type": "string", "enum": ["keep", "wait", "abort"]}, "clear_cache": _bool}
)
MEMORY_RELEASE: Final = object_schema(
    {"weights": {"type": "string", "enum": ["offload", "discard", "keep"]}, "kv_cache": _bool}
)
MEMORY_RESUME: Final = object_schema({"weights": _bool, "kv_cache": _bool})
FINISH_SESSION: Final = object_schema({"weight_version": _any, "reset_prefix_cache": _bool})
VERIFY: Final = object_schema({"allow_load_digest": _bool})
REQUEST_ID: Final = object_schema({"request_id": _str}, ("request_id",))
RPC: Final = object_schema(
    {"method": _str, "args": {"type": "array"}, "kwargs": {"type": "object"}}, ("method",)
)

# ---------------------------------------------------------------- Dynamo's forms

_control: Final = {"allow_unpaused": _bool, "reset_prefix_cache": _bool}
_positive: Final = {"type": "integer", "minimum": 1}
UPDATE_INFO: Final = object_schema(
    {
        "names": DISTRIBUTED_UPDATE["properties"]["names"],
        "dtype_names": DISTRIBUTED_UPDATE["properties"]["dtypes"],
        "shapes": DISTRIBUTED_UPDATE["properties"]["shapes"],
        "packed": _bool,
        "packed_buffer_size_bytes": _positive,
        "packed_num_buffers": _positive,
        "hashes": DISTRIBUTED_UPDATE["properties"]["hashes"],
    },
    ("names", "dtype_names", "shapes"),
)
"""vLLM's ``update_info`` (its NCCL backend's, with vLLM <= 0.23's ``packed`` and buffer sizes)
as Dynamo forwards it, plus weightsync's ``hashes``."""
INIT_INFO_GROUP_FIELDS: Final[tuple[str, ...]] = (
    "master_address", "master_port", "rank_offset", "world_size", "backend", "timeout_s", "rendezvous",
)  # fmt: skip
"""The fields of vLLM's ``init_info`` that are ``init_weights_update_group``'s own."""
INIT_INFO: Final = object_schema(
    {
        **{k: INIT_GROUP["properties"][k] for k in INIT_INFO_GROUP_FIELDS},
        "packed": {"type": "boolean", "enum": [False]},
        "packed_buffer_size_bytes": _positive,
        "packed_num_buffers": _positive,
        "nccl_unique_id_b64": {"type": ["string", "null"]},
    },
    ("master_address", "master_port", "rank_offset", "world_size"),
)
"""vLLM's ``init_info`` (its NCCL backend's) as Dynamo forwards it, plus weightsync's
``backend`` and ``timeout_s``; a packed stream is announced per update (``update_info.packed``)."""


def _form(rpc: str, props: Schema, required: tuple[str, ...] = ()) -> Schema:
    return object_schema(
        {"engine_rpc": {"type": "string", "enum": [rpc]}, **props}, ("engine_rpc", *required)
    )


DYNAMO_FORMS: Final[dict[str, dict[str, Schema]]] = {
    "update_weights_from_disk": {
        rpc: _form(rpc, DISK_UPDATE["properties"], ("model_path",))
        for rpc in ("reload_weights", "update_weights_from_path")
    },
    "update_weights_from_distributed": {
        "start_weight_update": _form(
            "start_weight_update", {"is_checkpoint_format": {"type": "boolean", "enum": [True]}, **_control}
        ),
        "update_weights": _form(
            "update_weights",
            {"update_info": UPDATE_INFO, "weight_version": _any, **_control},
            ("update_info",),
        ),
        "finish_weight_update": _form("finish_weight_update", {"weight_version": _any, **_control}),
    },
    "init_weights_update_group": {
        "init_weight_transfer_engine": _form(
            "init_weight_transfer_engine", {"init_info": INIT_INFO}, ("init_info",)
        )
    },
    "destroy_weights_update_group": {
        "shutdown_weight_transfer_engine": _form("shutdown_weight_transfer_engine", {})
    },
}
"""Route -> Dynamo's worker method (``engine_rpc``) -> the body of that form, as Dynamo's vLLM
worker forwards it (:mod:`weightsync.edge.dynamo` maps each onto a registry route)."""

# ---------------------------------------------------------------- ok replies

OK: Final = _reply({})
_STATE: Final = {
    "version": _any, "version_declared": _bool, "paused": _bool, "torn": _bool,
    "update_in_flight": _bool, "digest": _digest, "epoch": _epoch,
    "version_digest": _digest, "version_current": _bool, "session_open": _bool, "verified": _bool,
    "weights": {"enum": ["resident", "offloaded", "discarded"]}, "kv_cache": {"enum": ["resident", "released"]},
    "weights_released": _bool,
}  # fmt: skip
STATE_REPLY: Final = _reply(_STATE)
# an HTTP worker adds the routing taints it carries (Dynamo's model_taints; none by default)
STATE_REPLY["properties"]["taints"] = {"type": "array", "items": {"type": "string"}}
_STATE_OBJECT: Final = {"type": "object", "properties": _STATE, "required": list(_STATE)}
SESSION_REPLY: Final = _reply({"session_open": _bool, "deadline_s": {"type": "number"}})
ABANDON_REPLY: Final = _reply({"torn": _bool, "paused": _bool, "digest": _digest})
CAPABILITIES_REPLY: Final = _reply(
    {
        "engine": {"type": "string"},
        "world_size": _int,
        "channels": {"type": "array", "items": {"type": "string"}},
        "backends": {"type": "array", "items": {"type": "string"}},
        "pause_modes": {"type": "array", "items": {"type": "string"}},
        "digests": _bool,
        "dry_run": _bool,
        "verify_weights": _bool,
        "session_deadline_s": {"type": "number"},
        "vllm_weight_transfer": {"type": "array", "items": {"type": "string"}},
    }
)
DECLARED_REPLY: Final = _reply(
    {"version": _any, "version_declared": _bool, "digest": _digest, "epoch": _epoch}
)
UPDATE_REPLY: Final = {
    "oneOf": [
        _reply(
            {
                "version": _any,
                "version_declared": _bool,
                "prefix_cache_reset": _bool,
                "digest": _digest,
                "epoch": _epoch,
                "stats": {
                    "type": "object",
                    "properties": {
                        "tensors": _int,
                        "bytes": _int,
                        "files": _int,
                        "seconds": {"type": "number"},
                    },
                    "required": ["tensors", "bytes", "files", "seconds"],
                },
                "state": _STATE_OBJECT,
            }
        ),
        _reply(
            {
                "dry_run": {"type": "boolean", "enum": [True]},
                "digest": _digest,
                "epoch": _epoch,
                "state": _STATE_OBJECT,
            }
        ),
    ]
}
PAUSE_REPLY: Final = _reply(
    {
        "mode": {"type": "string", "enum": ["keep", "wait", "abort"]},
        "clear_cache": _bool,
        "aborted": _int,
        "already_paused": _bool,
    }
)
FLUSH_REPLY: Final = _reply({"flushed": _bool})
MEMORY_REPLY: Final = _reply(
    {
        "weights": _STATE["weights"],
        "kv_cache": _STATE["kv_cache"],
        "weights_released": _bool,
        "paused": _bool,
        "digest": _digest,
    }
)
ALIVE_REPLY: Final = _reply({"alive": _bool})
CLOCK_REPLY: Final = _reply({"clock": {"type": "number"}})
WEIGHT_INFO_REPLY: Final = _reply(
    {
        "names": {"type": "array", "items": {"type": "string"}},
        "dtypes": {"type": "array", "items": {"type": "string"}},
        "shapes": {"type": "array", "items": _shape},
    }
)
VERIFY_REPLY: Final = _reply(
    {"digest": _digest, "recorded_digest": _digest, "match": _bool, "scope": {"type": "string"}}
)
RPC_REPLY: Final = _reply({"result": _any})
