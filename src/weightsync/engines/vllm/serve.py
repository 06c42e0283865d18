"""``weightsync serve --engine vllm``: build the vLLM engine from command-line options."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from weightsync.engines.vllm.delta import DELTA_BASE_ENV
from weightsync.engines.vllm.engine import VllmEngine

CPU_DEFAULTS: dict[str, Any] = {"enforce_eager": True, "gpu_memory_utilization": 0.3}


def engine_args(pairs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs (VALUE as JSON, else a string) into engine arguments."""
    out: dict[str, Any] = dict(CPU_DEFAULTS)
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep:
            raise SystemExit(f"--vllm-arg expects KEY=VALUE, got {pair!r}")
        try:
            out[key.replace("-", "_")] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.replace("-", "_")] = raw
    return out


def build_engine(args: argparse.Namespace) -> VllmEngine:
    if not args.model:
        raise SystemExit("weightsync serve --engine vllm needs --model DIR")
    if getattr(args, "vllm_delta_base", "none") == "copy":  # read by the worker extension in vLLM's processes
        os.environ[DELTA_BASE_ENV] = "copy"
    given = engine_args(args.vllm_arg)
    if getattr(args, "max_logprobs", None) is not None:  # serve --max-logprobs is vLLM's too
        given.setdefault("max_logprobs", args.max_logprobs)
    return VllmEngine.from_engine_args(
        args.model,
        allowed_weight_dirs=args.allowed_weight_dir or None,
        chat_template=chat_template(getattr(args, "chat_template", None)),
        **given,
    )


def chat_template(given: str | None) -> str | None:
    """``--chat-template``: a file's text, or the template itself, as vLLM's server reads it."""
    if given is None:
        return None
    from vllm.renderers.chat_utils import load_chat_template

    try:
        return load_chat_template(given)
    except Exception as exc:  # a file that cannot be read, or a name of no template vLLM ships
        raise SystemExit(f"--chat-template: {exc}") from None
