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
    {"weight_version": _any, "epoch": {**_int, "maximum": 2**63 - 1}, "expected_digest": _hex},
    ("weight_version",),
)
DISK_UPDATE: Final = object_schema(
    {"model_path": _str, "allow_partial": _bool, "allow_dtype_cast": _bool, **_update}, ("model_path",)
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
        **_update,
    },
    ("names", "dtypes", "shapes", "group_name"),
)
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
        "timeout_s": {"type": "number", "exclusiveMinimum": 0, "maximum": 86400},
        "receiver": {"type": "string", "enum": ["inline", "process"]},
    },
    ("master_address", "master_port", "rank_offset", "world_size", "group_name"),
)
GROUP_NAME: Final = object_schema({"group_name": _str}, ("group_name",))
PAUSE: Final = object_schema(
    {"mode": {"type": "string", "enum": ["keep", "wait", "abort"]}, "clear_cache": _bool}
)
FINISH_SESSION: Final = object_schema({"weight_version": _any, "reset_prefix_cache": _bool})
VERIFY: Final = object_schema({"allow_load_digest": _bool})
REQUEST_ID: Final = object_schema({"request_id": _str}, ("request_id",))
RPC: Final = object_schema(
    {"method": _str, "args": {"type": "array"}, "kwargs": {"type": "object"}}, ("method",)
)

# ---------------------------------------------------------------- ok replies

OK: Final = _reply({})
_STATE: Final = {
    "version": _any, "version_declared": _bool, "paused": _bool, "torn": _bool,
    "update_in_flight": _bool, "digest": _digest, "epoch": _epoch,
    "version_digest": _digest, "version_current": _bool, "session_open": _bool, "verified": _bool,
}  # fmt: skip
STATE_REPLY: Final = _reply(_STATE)
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
ALIVE_REPLY: Final = _reply({"alive": _bool})
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
