"""JSON Schemas of the admin route bodies, for the OpenAPI document and for fuzzing.

They describe what the parser in ``weightsync.core.requests`` accepts, except for rules
across fields (equal lengths, conflicting flags) that JSON Schema cannot say; the parser
stays the authority.  The fuzz tests draw bodies from these schemas.
"""

from __future__ import annotations

from typing import Any, Final

_any: Final[dict[str, Any]] = {}
_bool: Final = {"type": "boolean"}
_str: Final = {"type": "string", "minLength": 1}
_dtype: Final = {
    "type": "string",
    "enum": ["float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"],
}
_shape: Final = {"type": "array", "items": {"type": "integer", "minimum": 0}}
_update: Final = {"weight_version": _any, "allow_unpaused": _bool, "reset_prefix_cache": _bool}


def _obj(props: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(required), "additionalProperties": False}


EMPTY: Final = _obj({})

BODIES: Final[dict[str, dict[str, Any]]] = {
    "get_weight_version": EMPTY,
    "set_weight_version": _obj({"weight_version": _any}, ("weight_version",)),
    "update_weights_from_disk": _obj(
        {"model_path": _str, "allow_partial": _bool, "allow_dtype_cast": _bool, **_update}, ("model_path",)
    ),
    "update_weights_from_distributed": _obj(
        {
            "names": {"type": "array", "items": _str, "minItems": 1},
            "dtypes": {"type": "array", "items": _dtype},
            "shapes": {"type": "array", "items": _shape},
            "group_name": _str,
            "packing": _obj(
                {"bucket_bytes": {"type": "integer", "minimum": 1}, "stream_id": _str},
                ("bucket_bytes", "stream_id"),
            ),
            **_update,
        },
        ("names", "dtypes", "shapes", "group_name"),
    ),
    "update_weights_from_tensor": _obj(
        {
            "tensors": {
                "type": "array",
                "minItems": 1,
                "items": _obj(
                    {"name": _str, "dtype": _dtype, "shape": _shape, "handle": {"type": "object"}},
                    ("name", "dtype", "shape", "handle"),
                ),
            },
            **_update,
        },
        ("tensors",),
    ),
    "init_weights_update_group": _obj(
        {
            "master_address": _str,
            "master_port": {"type": "integer", "minimum": 1, "maximum": 65535},
            "rank_offset": {"type": "integer", "minimum": 1},
            "world_size": {"type": "integer", "minimum": 2},
            "group_name": _str,
            "backend": {"type": "string", "enum": ["nccl", "gloo"]},
            "timeout_s": {"type": "number", "exclusiveMinimum": 0, "maximum": 86400},
        },
        ("master_address", "master_port", "rank_offset", "world_size", "group_name"),
    ),
    "destroy_weights_update_group": _obj({"group_name": _str}, ("group_name",)),
    "pause_generation": _obj(
        {"mode": {"type": "string", "enum": ["keep", "wait", "abort"]}, "clear_cache": _bool}
    ),
    "resume_generation": EMPTY,
    "flush_cache": EMPTY,
    "abort_request": _obj({"request_id": _str}, ("request_id",)),
    "liveness_probe": EMPTY,
    "weight_info": EMPTY,
    "engine_rpc": _obj(
        {"method": _str, "args": {"type": "array"}, "kwargs": {"type": "object"}}, ("method",)
    ),
}

COMPLETION: Final = _obj(
    {
        "model": {"type": "string"},
        "prompt": {
            "oneOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
            ]
        },
        "max_tokens": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number", "minimum": 0},
        "seed": {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1},
        "request_id": _str,
    },
    ("prompt",),
)

REPLY: Final = {
    "type": "object",
    "properties": {
        "status": {"type": "string", "enum": ["ok", "error"]},
        "code": {"type": "string"},
        "message": {"type": "string"},
    },
    "required": ["status"],
}
