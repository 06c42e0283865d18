"""What vLLM's server says about itself, as a weightsync worker says it: the reply of vLLM's
``GET /server_info`` (``vllm/entrypoints/serve/dev/server_info/api_router.py``).

A trainer reads it before it updates: TRL's ``VLLMClient.init_communicator`` refuses a
server whose ``vllm_config.weight_transfer_config`` is null, and GRPO reads
``model_config.logprobs_mode``.  A worker has no ``VllmConfig``; it reports the parts a
trainer reads, each true of the worker (see docs/dialects.md).
"""

from __future__ import annotations

from typing import Any, Final

from weightsync.core.errors import InvalidRequest

CONFIG_FORMATS: Final = ("text", "json")
"""vLLM's ``config_format`` values; ``text`` (vLLM's default) renders the config as one string."""

TRANSFER_BACKEND: Final = "nccl"
"""The weight-transfer backend a worker reports: vLLM's stock one, whose shapes (per-tensor and
packed, over nccl or gloo) the vLLM dialect reads; the ``weightsync`` backend works as well."""

LOGPROBS_MODE: Final = "raw_logprobs"
"""vLLM's default ``logprobs_mode``, reported as is: a worker does not post-process logprobs."""


def vllm_config(
    model: str, world_size: int, dtype: str | None = None, max_model_len: int | None = None
) -> dict[str, Any]:
    """The parts of a ``VllmConfig`` a trainer reads, for a worker serving ``model`` on
    ``world_size`` ranks of one data-parallel replica, without LoRA; ``dtype`` and
    ``max_model_len`` where the engine says them (TRL 1.16's AsyncGRPO reads
    ``model_config.dtype``)."""
    model_config: dict[str, Any] = {
        "model": model,
        "served_model_name": model,
        "logprobs_mode": LOGPROBS_MODE,
    }
    if dtype is not None:
        model_config["dtype"] = f"torch.{dtype}"  # vLLM's JSON config stringifies a torch.dtype
    if max_model_len is not None:
        model_config["max_model_len"] = max_model_len
    return {
        "model_config": model_config,
        "parallel_config": {
            "tensor_parallel_size": world_size,
            "pipeline_parallel_size": 1,
            "data_parallel_size": 1,
            "world_size": world_size,
        },
        "lora_config": None,
        "weight_transfer_config": {"backend": TRANSFER_BACKEND},
    }


def render(config: dict[str, Any]) -> str:
    """``config`` as vLLM's text format spells a config: ``name=value`` pairs."""
    return ", ".join(f"{name}={value!r}" for name, value in config.items())


def server_info(
    model: str,
    world_size: int,
    config_format: str,
    dtype: str | None = None,
    max_model_len: int | None = None,
) -> dict[str, Any]:
    """The body of ``GET /server_info?config_format=…``; raises ``InvalidRequest``
    (``invalid_value``, ``query.config_format``) for a format vLLM does not have."""
    if config_format not in CONFIG_FORMATS:
        raise InvalidRequest(
            f"config_format must be one of {list(CONFIG_FORMATS)}",
            code="invalid_value",
            field="query.config_format",
        )
    config = vllm_config(model, world_size, dtype, max_model_len)
    return {
        "vllm_config": config if config_format == "json" else render(config),
        "vllm_env": {},
        "system_env": {},
    }
