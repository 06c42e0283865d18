"""JSON Schemas for the OpenAPI document and for fuzzing: the route bodies (from the route
registry, :data:`weightsync.core.routes.ROUTES`), the completion body, and the documented
error replies.

Body schemas live in :mod:`weightsync.core.schemas` and describe what the parser accepts
except for rules across fields that JSON Schema cannot say; the parser stays the authority.
The fuzz tests draw bodies from :data:`BODIES`.
"""

from __future__ import annotations

from typing import Any, Final

from weightsync.core.routes import ROUTES
from weightsync.core.schemas import object_schema

BODIES: Final[dict[str, dict[str, Any]]] = {name: r.body for name, r in ROUTES.items()}
"""Route name -> the plain JSON Schema of its body (no descriptions)."""
_str: Final = {"type": "string", "minLength": 1}

_ids: Final = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_prob: Final = {"type": "number", "exclusiveMinimum": 0, "maximum": 1}
_SAMPLING: Final[dict[str, Any]] = {
    "model": {"type": "string"},
    "max_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0},
    "top_p": _prob,
    "top_k": {"type": "integer", "minimum": -1},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "repetition_penalty": {"type": "number", "exclusiveMinimum": 0},
    "n": {"type": "integer", "minimum": 1, "maximum": 128},
    "stop": {"oneOf": [_str, {"type": "array", "items": _str}]},
    "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}},
    "seed": {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1},
    "ignore_eos": {"type": "boolean"},
    "prompt_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
    "return_token_ids": {"type": "boolean"},
    "return_tokens_as_token_ids": {"type": "boolean"},
    "stream": {"type": "boolean"},
    "stream_options": object_schema({"include_usage": {"type": "boolean"}}, ()),
    "request_id": _str,
    "user": {"type": "string"},
}
_SHARED_SAMPLING: Final = (
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "n",
)  # fmt: skip
"""The sampling fields SGLang's ``sampling_params`` spells as OpenAI's body does."""

COMPLETION: Final = object_schema(
    {
        "prompt": {
            "oneOf": [
                {"type": "string", "minLength": 1},
                _ids,
                {"type": "array", "items": {"oneOf": [_str, _ids]}, "minItems": 1, "maxItems": 256},
            ]
        },
        **_SAMPLING,
        "logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
    },
    ("prompt",),
)
_message: Final = object_schema(
    {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {
            "oneOf": [
                {"type": "string"},
                {
                    "type": "array",
                    "items": object_schema(
                        {"type": {"const": "text"}, "text": {"type": "string"}}, ("type", "text")
                    ),
                },
            ]
        },
        "name": {"type": "string"},
    },
    ("role",),
)
CHAT_COMPLETION: Final = object_schema(
    {
        "messages": {"type": "array", "items": _message, "minItems": 1},
        **_SAMPLING,
        "max_completion_tokens": {"type": "integer", "minimum": 1},
        "logprobs": {"type": "boolean"},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
        "add_generation_prompt": {"type": "boolean"},
    },
    ("messages",),
)

GENERATE: Final = object_schema(
    {
        "text": {"oneOf": [_str, {"type": "array", "items": _str, "minItems": 1, "maxItems": 256}]},
        "input_ids": {"oneOf": [_ids, {"type": "array", "items": _ids, "minItems": 1, "maxItems": 256}]},
        "sampling_params": object_schema(
            {
                "max_new_tokens": _SAMPLING["max_tokens"],
                **{k: _SAMPLING[k] for k in _SHARED_SAMPLING},
                "sampling_seed": _SAMPLING["seed"],
            },
            (),
        ),
        "rid": _str,
        "return_logprob": {"type": "boolean"},
        "top_logprobs_num": {"type": "integer", "minimum": 0, "maximum": 20},
        "logprob_start_len": {"type": "integer", "minimum": -1},
        "stream": {"type": "boolean"},
    },
    (),
)
"""SGLang's ``/generate`` body (exactly one of ``text`` and ``input_ids``)."""

# ---------------------------------------------------------------- for the OpenAPI document

FIELD_DOCS: Final[dict[str, str]] = {
    "weight_version": 'The version label to declare: any JSON value (null and "initial" included). '
    "On an update it is declared only once every tensor is in place; omit it to keep the current label.",
    "allow_unpaused": "Update while generation runs (async RL); requests report the versions they saw. "
    "Default false: an update needs a paused worker (409 not_paused).",
    "reset_prefix_cache": "Drop the prefix cache after loading; default true unless allow_unpaused. "
    "true together with allow_unpaused is a 400 (conflicting_options).",
    "dry_run": "Validate the source as the update would (paths, headers, sizes, checksums, names, "
    "shapes, dtypes; a broadcast's group and metadata; shared-memory handles) and write nothing. "
    "Legal in every state, changes no state; answers the digest the worker would hold after it.",
    "epoch": "The fleet epoch this declaration commits (an integer >= 0). Lower than the worker's "
    "current epoch is a 409 stale_epoch: an epoch never goes backwards.",
    "expected_digest": "Declare only if the weights held have this content digest (lowercase hex), "
    "else 409 digest_mismatch and nothing changes.",
    "not_after": "Declare only if this request is read by then: unix seconds (a number > 0) by the worker's "
    "clock (the clock route reads it), compared when the declaration takes effect. Later is "
    "a 409 commit_expired and nothing changes (a fleet commit that arrives after its coordinator gave up "
    "on it).",
    "session": "Stream this update into the open update session (begin_weight_update): nothing is "
    "committed until end_weight_update. Without a session: 409 no_session.",
    "hashes": "The xxh3-64 (16 hex digits) of every tensor, in order, for a per-tensor or flat stream: "
    "verified before the update commits. Without them the bytes are reported unverified.",
    "delta": "A sparse delta of the named tensors instead of their full bytes (vLLM's sparse_nccl shape "
    "or weightsync's packed one), checked, applied all or nothing and undone on failure.",
    "delta.counts": "Changed elements per tensor (vLLM's num_updates_list).",
    "delta.stream": "sparse: per tensor its int32 indices then its values, one broadcast each (vLLM); "
    "packed: the same bytes in buckets after a handshake (weightsync's trainer).",
    "delta.stream_id": "The packed stream's id (its size and the go are in the group's store).",
    "delta.base": "The base the worker must hold ({digest, version?}); otherwise 409 base_mismatch.",
    "delta.target": "The target the delta makes ({version, digest}), as the trainer computed it.",
    "delta.target_hashes": "The xxh3-64 of each tensor after the delta: the worker's digest at once.",
    "delta.base_linear": "Each tensor's linear digest before the delta (weightsync-linear/1).",
    "delta.target_linear": "Each tensor's linear digest after it: the write is verified in O(changed).",
    "packing.flat": "A flat stream: the tensors' bytes concatenated in order (vLLM's packed stream, "
    "SGLang's flattened_bucket).",
    "packing.flat_bucket_bytes": "With flat: cut the stream into broadcasts closing after the tensor that "
    "takes them past this size; omitted: one broadcast of everything.",
    "weights": 'release_memory: "offload" (default: kept in host memory, restored as they were), '
    '"discard" (freed: the worker holds no version\'s weights until an update) or "keep". '
    "resume_memory: true (default) restores offloaded weights; discarded ones need an update.",
    "kv_cache": "Release (release_memory) or restore (resume_memory) the KV cache; default true. "
    "A restored KV cache is empty.",
    "delta_path": "Absolute path of a delta checkpoint directory (weightsync-delta.json beside its "
    "payload). It applies only to the exact base it names (digest, declared version, names, shapes, "
    "dtypes), else 409 base_mismatch; applied all or nothing and verified before commit.",
    "model_path": "Absolute path of a safetensors file, or of a directory with model.safetensors.index.json.",
    "allow_partial": "Accept a checkpoint with only some of the served tensors (default false).",
    "allow_dtype_cast": "Cast tensors whose dtype differs from the served one (default false: 400).",
    "relabel": "Declare weight_version even where the checkpoint's manifest names another version "
    "(default false: 409 version_mismatch).",
    "names": "Tensor names, in the order the trainer broadcasts them.",
    "dtypes": "One torch dtype name per tensor (e.g. bfloat16).",
    "shapes": "One shape per tensor.",
    "group_name": "The weight-update group, as created by init_weights_update_group.",
    "packing": "weightsync's packed stream: bucket size and a stream id; omit for one broadcast per tensor.",
    "tensors": "Shared-memory or CUDA-IPC handles of the new tensors, one per name.",
    "tensors.name": "The served tensor this one replaces.",
    "tensors.dtype": "Its torch dtype name (e.g. bfloat16); must match the served dtype.",
    "tensors.shape": "Its shape; must match the served shape.",
    "tensors.handle": 'Where its bytes are: {"shm": a POSIX shared-memory segment named weightsync_*, '
    '"offset": its byte offset in the segment} (a {"cuda_ipc": ...} handle is a 501 for now).',
    "packing.bucket_bytes": "Size in bytes (>= 1) of the buckets small tensors are packed into; "
    "the same value the trainer packs with.",
    "packing.stream_id": "The key under which the trainer put this stream's manifest (chunk sizes) and, "
    "after the last chunk, its tensor hashes in the group's store; unique per update.",
    "stream_id": "The key under which every trainer rank put its manifest (message sizes) and, after "
    "its last message, its pieces' hashes in the group's store; unique per update.",
    "plan": "This worker's part of the sharded transfer plan (weightsync.plan_part/2, or /1): the "
    "messages it receives, from which trainer rank, and the box of each tensor each piece fills.",
    "master_address": "Address of the trainer's (rank 0) TCPStore, reachable from every worker.",
    "master_port": "Port of the trainer's TCPStore.",
    "rank_offset": "This worker's first rank in the group (the trainer is rank 0).",
    "world_size": "Ranks in the group: 1 + every worker's world size.",
    "backend": "nccl (GPU tensors, the default) or gloo (CPU tensors).",
    "timeout_s": "Seconds to wait for the group to form before failing (the worker survives).",
    "receiver": "inline (default): the worker joins the group (weightsync's packed stream; plans on "
    "nccl); process (gloo only): a helper process joins it and receives foreign per-tensor and flat "
    "streams and sharded plans, so a sender of more bytes than declared cannot abort the worker.",
    "rendezvous": "How the trainer formed the group, so the worker meets it there: process_group (default: "
    "weightsync's trainer, SGLang's and OpenRLHF's init_custom_process_group, the store prefixed by the "
    "group's name); default_group (the trainer's own torch.distributed.init_process_group); vllm_stateless "
    "(vLLM's StatelessProcessGroup + PyNcclCommunicator, nccl only).",
    "mode": "keep: freeze running requests; wait: let them finish; abort: abort them. Default keep.",
    "clear_cache": "Also drop the prefix cache (reported only if it really happened).",
    "request_id": "The id of an in-flight completion.",
    "allow_load_digest": "Report the digest the last load took in the served memory itself when nothing "
    "wrote the weights since (scope load_in_place) instead of hashing them again (default false).",
    "method": "An engine method on the worker's allow-list (others are a 400).",
    "args": "Positional arguments of the method.",
    "kwargs": "Keyword arguments of the method.",
}

ERROR: Final = {
    "type": "object",
    "properties": {
        "status": {"type": "string", "enum": ["error"]},
        "code": {"type": "string", "description": "Stable, machine-readable reason."},
        "message": {"type": "string", "description": "For people."},
        "details": {"type": "object", "description": "Extra facts (e.g. the state, the field)."},
    },
    "required": ["status", "code", "message"],
}

ERROR_REPLIES: Final[dict[int, tuple[str, tuple[str, ...]]]] = {
    400: ("Invalid request; nothing changed.", (
        "invalid_json", "not_an_object", "too_deep", "wrong_type", "missing_field", "unknown_field",
        "invalid_value", "conflicting_options", "weights_mismatch", "unsupported_dtype",
        "corrupt_checkpoint", "checksum_mismatch", "not_a_file", "symlink_loop", "read_failed",
    )),
    401: ("Missing or wrong bearer token.", ("unauthorized",)),
    403: ("Cross-site request refused: a foreign Origin, or a Host that is not this worker.",
          ("forbidden_origin", "forbidden_host")),
    404: ("Unknown route, or a named thing that does not exist.",
          ("unknown_route", "path_not_found", "unknown_group", "unknown_request")),
    409: ("Not legal in the current state; nothing changed.",
          ("not_paused", "weights_torn", "cache_in_use", "illegal_state", "digest_mismatch",
           "stale_epoch")),
    413: ("Body larger than the server's limit.", ("payload_too_large",)),
    415: ("The body is not declared as JSON (send Content-Type: application/json).",
          ("unsupported_media_type",)),
    500: ("The engine failed; weights_torn means the update failed after writing began and the worker "
          "is torn (paused, resume refused) until a complete update succeeds.",
          ("engine_failure", "load_failed", "weights_torn", "internal_error")),
    501: ("This engine does not support the command.", ("not_supported",)),
    503: ("The engine is not available.", ("engine_unavailable",)),
}  # fmt: skip


COMPLETION_DOCS: Final[dict[str, str]] = {
    "model": "Accepted for OpenAI compatibility and ignored: the worker serves one model.",
    "user": "Accepted for OpenAI compatibility and ignored (an end-user id).",
    "prompt": "Text, or an array of token ids (each >= 0), or a batch: an array of either; not empty.",
    "messages": "The conversation, rendered by the engine's chat template (text content only).",
    "max_tokens": "Most tokens to generate (>= 1, default 16).",
    "max_completion_tokens": "As max_tokens (OpenAI's newer name).",
    "temperature": "Sampling temperature (>= 0, default 0: greedy; OpenAI and vLLM default to 1).",
    "top_p": "Nucleus sampling: the smallest set of most likely tokens holding this mass (default 1: off).",
    "top_k": "Sample among the k most likely tokens (default 0 or -1: off).",
    "min_p": "Drop tokens less likely than min_p times the most likely one (default 0: off).",
    "repetition_penalty": "vLLM's repetition penalty over prompt and output tokens (default 1: off).",
    "n": "Samples per prompt (default 1); choices are prompt-major.",
    "stop": "Stop string(s): generation ends when the text ends with one, which is left out of the text.",
    "stop_token_ids": "Token ids that end generation (kept in token_ids).",
    "seed": "Seed of the sampler, for a reproducible completion (a signed 64-bit integer; default none); "
    "the j-th of n samples takes seed + j.",
    "ignore_eos": "Keep generating past the end-of-sequence token.",
    "logprobs": "Completions: how many alternatives to report per token beside the sampled one (0: the "
    "sampled token only). Chat: true to report them (top_logprobs says how many). Log-probabilities of "
    "the raw distribution of the forward pass that chose the token (vLLM's default).",
    "top_logprobs": "Chat: alternatives per token, with logprobs: true.",
    "prompt_logprobs": "vLLM's: the log-probability of every prompt token, with this many alternatives.",
    "return_token_ids": "vLLM's: add prompt_token_ids to every choice (token_ids are always there).",
    "return_tokens_as_token_ids": 'vLLM\'s: spell tokens in logprobs as "token_id:N".',
    "stream": "Answer as server-sent events ending with data: [DONE]; every event is stamped.",
    "stream_options": "Options of a stream.",
    "stream_options.include_usage": "Send a last event with the usage (no choices) before [DONE].",
    "messages.role": "system, developer, user, assistant or tool.",
    "messages.content": "Text, or an array of text parts ({type: text, text}).",
    "messages.name": "Accepted and not rendered by the template.",
    "add_generation_prompt": "Chat: open the assistant's turn after the messages (default true).",
    "request_id": "Your id for this completion, to abort it with /engine/abort_request "
    "(with several sequences, the i-th is <request_id>-<i>).",
}

GENERATE_DOCS: Final[dict[str, str]] = {
    "text": "One prompt, or a batch (the reply is then a list).",
    "input_ids": "One prompt's token ids, or a batch of them.",
    "sampling_params": "SGLang's sampling parameters (temperature defaults to 1, as in SGLang).",
    "sampling_params.max_new_tokens": "Most tokens to generate (default 16).",
    "sampling_params.temperature": "Sampling temperature (>= 0; default 1).",
    "sampling_params.top_p": "Nucleus sampling (default 1: off).",
    "sampling_params.top_k": "Sample among the k most likely tokens (default -1: off).",
    "sampling_params.min_p": "Drop tokens less likely than min_p times the most likely (default 0).",
    "sampling_params.repetition_penalty": "Repetition penalty (default 1: off).",
    "sampling_params.stop": "Stop string(s), left out of the text.",
    "sampling_params.stop_token_ids": "Token ids that end generation.",
    "sampling_params.ignore_eos": "Keep generating past the end-of-sequence token.",
    "sampling_params.n": "Samples per prompt (the reply is then a list).",
    "sampling_params.sampling_seed": "Seed of the sampler (the j-th of n samples takes seed + j).",
    "rid": "Your id for the request (abort it with /engine/abort_request).",
    "return_logprob": "Report meta_info.output_token_logprobs ([logprob, token_id, null] per token).",
    "top_logprobs_num": "Alternatives per token in meta_info.output_top_logprobs.",
    "logprob_start_len": "With return_logprob, report input_token_logprobs from this prompt position (-1: none).",
    "stream": "Answer as server-sent events, each the whole object so far, ending with data: [DONE].",
}

COMPLETION_ERRORS: Final[dict[int, tuple[str, tuple[str, ...]]]] = {
    400: ("Invalid request.", (
        "invalid_json", "not_an_object", "too_deep", "wrong_type", "missing_field", "unknown_field",
        "invalid_value",
    )),
    401: ERROR_REPLIES[401],
    403: ERROR_REPLIES[403],
    413: ERROR_REPLIES[413],
    415: ERROR_REPLIES[415],
    500: ("The engine failed while generating.", ("engine_failure", "internal_error")),
    501: ("A known field this engine does not implement, at a value that asks for it.", ("not_supported",)),
    503: ERROR_REPLIES[503],
}  # fmt: skip
"""The error replies of ``/v1/completions``."""


def documented(schema: dict[str, Any], docs: dict[str, str] = FIELD_DOCS, _at: str = "") -> dict[str, Any]:
    """``schema`` with a ``description`` on every field ``docs`` knows (a copy: :data:`BODIES`
    stays the plain schema the fuzz tests draw from).  The pass recurses into nested objects
    and array ``items``; a nested field is looked up by its dotted path (``packing.stream_id``,
    ``tensors.name`` for a field of each item of ``tensors``)."""
    if schema.get("type") == "array" and isinstance(schema.get("items"), dict):
        return {**schema, "items": documented(schema["items"], docs, _at)}
    if schema.get("type") != "object" or "properties" not in schema:
        return schema
    props = {}
    for name, sub in schema["properties"].items():
        path = f"{_at}{name}"
        props[name] = {
            **documented(sub, docs, f"{path}."),
            **({"description": docs[path]} if path in docs else {}),
        }
    return {**schema, "properties": props}


def error_responses(
    replies: dict[int, tuple[str, tuple[str, ...]]] = ERROR_REPLIES,
) -> dict[str, Any]:
    """The OpenAPI ``responses`` of the error replies a route may give (by default those of
    every admin route)."""
    return {
        str(status): {
            "description": f"{text} Codes: {', '.join(codes)}.",
            "content": {"application/json": {"schema": ERROR}},
        }
        for status, (text, codes) in replies.items()
    }


MODEL_TAINTS: Final = {
    "type": "object",
    "properties": {
        "taints": {
            "type": "array",
            "items": {"type": "string", "minLength": 1, "maxLength": 256},
            "maxItems": 256,
            "description": "Dynamo 1.6.1's routing taints, replacing the last ones ([] clears them); none may "
            "start with Dynamo's reserved prefix dynamo.topology/.",
        }
    },
    "required": ["taints"],
    "additionalProperties": False,
}
"""``POST /engine/update/model_taints``' body (Dynamo's ``dynamo/common/model_taints.py``)."""
