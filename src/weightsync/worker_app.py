"""The worker ``weightsync serve`` runs, for every front end that starts one (the command line,
a Ray actor): its flags, their checks, and the app they build (engine, controller, HTTP app).

:func:`serve_actions` lists the flags by keyword, so a Ray actor takes exactly ``serve``'s
arguments, with its names, choices and defaults (:mod:`weightsync.ray.arguments`).
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = [
    "add_serve_arguments", "build_worker_app", "check_engine_installed", "check_tensor_parallel",
    "initial_version", "reference_config", "serve_actions",
]  # fmt: skip


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``weightsync serve``'s flags to ``parser``."""
    from weightsync.edge.arguments import (
        add_allowed_host_argument,
        add_api_key_argument,
        add_bind_arguments,
        add_log_arguments,
    )
    from weightsync.edge.dialects import VLLM_VERSIONS

    parser.add_argument(
        "--engine",
        choices=["reference", "vllm"],
        default="reference",
        help="the engine behind the routes: the built-in torch reference engine, or vLLM",
    )
    add_bind_arguments(
        parser, 8000, "an --api-key and --allowed-weight-dir are", "TCP port (0 picks a free one)"
    )
    add_api_key_argument(parser, "bearer token every request must carry")
    parser.add_argument(
        "--allowed-weight-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="directory checkpoints may be loaded from (repeatable; required beyond loopback)",
    )
    parser.add_argument(
        "--model-config",
        choices=["default", "tiny", "qwen2.5-0.5b"],
        default="default",
        help="reference engine shape",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="T",
        help="reference engine: serve with T tensor-parallel processes over gloo",
    )
    parser.add_argument("--model", help="vLLM: model directory")
    parser.add_argument(
        "--require-version",
        action="store_true",
        help="refuse an update that omits weight_version (400 version_required), so the label "
        "always describes the weights held",
    )
    parser.add_argument(
        "--session-timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="abandon an update session when nothing of it arrives for this long (default: %(default)s)",
    )
    parser.add_argument(
        "--initial-version", help="declare this version at start (a JSON value, or a plain string)"
    )
    add_allowed_host_argument(
        parser,
        "Host name a request arriving over loopback may carry besides loopback names, e.g. a "
        "local reverse proxy's (repeatable; '*' for any)",
    )
    parser.add_argument(
        "--max-body-bytes", type=int, default=16 << 20, help="largest request body accepted (bigger is 413)"
    )
    add_log_arguments(parser, "every pause, resume, update, declaration and refusal")
    parser.add_argument(
        "--dialect",
        choices=["vllm", "sglang"],
        default=None,
        help="answer the paths vLLM and SGLang both serve (/update_weight_version, /server_info) in "
        "this one's shape, and with vllm vLLM's replies with vLLM's keys only (default: both "
        "dialects, each request in its own shape; see docs/dialects.md)",
    )
    parser.add_argument(
        "--auto-pause-updates",
        action="store_true",
        help="let vLLM's /start_weight_update begin on a serving worker (as TRL's client sends it): "
        "the worker pauses (mode wait) for the update and resumes after /finish_weight_update",
    )
    parser.add_argument(
        "--vllm-version",
        choices=list(VLLM_VERSIONS),
        default=VLLM_VERSIONS[-1],
        help="the vLLM release whose RL API the vLLM routes mirror where releases differ: 0.33 refuses "
        "new generation requests with 503 while paused by /pause in mode abort or wait (until /resume), "
        "0.32 queues them (default: %(default)s)",
    )
    parser.add_argument(
        "--max-logprobs",
        type=int,
        default=20,
        metavar="N",
        help="the most log-probability alternatives per token a generation request may ask for "
        "(logprobs, top_logprobs, top_logprobs_num, prompt_logprobs), as vLLM's --max-logprobs: "
        "-1 for no bound; with --engine vllm also vLLM's own (default: %(default)s)",
    )
    parser.add_argument(
        "--max-loras",
        type=int,
        default=0,
        metavar="N",
        help="serve up to N LoRA adapters beside the base, each a versioned slot loaded with vLLM's "
        "/v1/load_lora_adapter and chosen per request by `model` (a name no adapter has is refused); "
        "a load past N is 409 adapter_slots_full (default: 0, no adapters; see docs/lora.md)",
    )
    parser.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="vLLM: extra engine argument (JSON value), repeatable",
    )
    parser.add_argument(
        "--chat-template",
        metavar="FILE_OR_TEMPLATE",
        help="vLLM: the chat template of /v1/chat/completions, a file or the Jinja template itself (as "
        "vLLM's --chat-template), instead of the one in the model's tokenizer",
    )
    parser.add_argument(
        "--vllm-delta-base",
        choices=["none", "copy"],
        default="none",
        help="vLLM: keep a checkpoint-form copy of the weights in host memory so the worker takes "
        "deltas (one host copy of the model, and a host copy of every tensor each full load); "
        "default none: deltas are 501",
    )


def check_serve_arguments(args: argparse.Namespace, *, serving_http: bool) -> None:
    """``serve``'s own checks of its flags, before anything is built: the API key, the exposure
    rules when the worker serves HTTP, the initial version, the engine's install and the
    tensor parallelism.  Raises ``InvalidRequest`` naming what to change (``args.api_key``
    is replaced by the key read from where it points)."""
    from weightsync.core.errors import InvalidRequest
    from weightsync.edge.arguments import api_key_argument
    from weightsync.serve.server import check_exposure

    args.api_key = api_key_argument("--api-key", args.api_key)
    if serving_http:
        check_exposure(args.host, args.api_key, args.allowed_weight_dir)
    if args.initial_version is not None:
        initial_version(args.initial_version)
    check_engine_installed(args.engine)
    check_tensor_parallel(args)
    if args.max_logprobs < -1:
        raise InvalidRequest("--max-logprobs must be -1 (no bound) or a count >= 0", code="invalid_value")
    if args.max_loras < 0:
        raise InvalidRequest("--max-loras must be 0 (no adapters) or a count of slots", code="invalid_value")
    if args.max_loras and (args.engine != "reference" or args.tensor_parallel_size != 1):
        raise InvalidRequest(
            "--max-loras: LoRA adapters are served by the reference engine without tensor parallelism (for now)",
            code="invalid_value",
        )


def serve_actions() -> dict[str, argparse.Action]:
    """``serve``'s flags by argument name (``--model-config`` is ``model_config``), each with
    what its parser checks (type, choices, default)."""
    parser = _Recording(add_help=False)
    add_serve_arguments(parser)
    return {a.dest: a for a in parser.recorded}


class _Recording(argparse.ArgumentParser):
    """A parser that keeps the actions its ``add_argument`` made."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.recorded: list[argparse.Action] = []

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        self.recorded.append(action)
        return action


def reference_config(name: str) -> Any:
    from weightsync.engines.reference import ModelConfig

    configs = {
        "default": ModelConfig,
        "tiny": ModelConfig.tiny,
        "qwen2.5-0.5b": ModelConfig.qwen2_5_0_5b,
    }
    return configs[name]()


def initial_version(text: str) -> Any:
    """``--initial-version`` as a version value; raises ``InvalidRequest`` as the routes would."""
    from weightsync.edge.arguments import version_argument

    return version_argument("--initial-version", text)


def build_worker_app(args: argparse.Namespace) -> Any:
    """The worker app for ``serve``'s arguments (engine, controller, HTTP app)."""
    from weightsync.core import UNDECLARED, Controller, Declared
    from weightsync.core.engine import ParallelEngine
    from weightsync.edge.arguments import worker_clock
    from weightsync.serve import create_app

    if args.engine == "reference":
        from weightsync.engines.reference import build_engine as build_reference

        engine: Any = build_reference(
            reference_config(args.model_config),
            tensor_parallel_size=args.tensor_parallel_size,
            allowed_weight_dirs=args.allowed_weight_dir or None,
        )
    else:
        from weightsync.engines.vllm.serve import build_engine

        engine = build_engine(args)
    version = UNDECLARED if args.initial_version is None else Declared(initial_version(args.initial_version))
    controller = Controller(
        engine,
        version=version,
        require_version=args.require_version,
        session_timeout_s=args.session_timeout,
        clock=worker_clock(),
    )
    return create_app(
        controller,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        world_size=engine.world_size if isinstance(engine, ParallelEngine) else 1,
        allowed_hosts=args.allowed_host,
        dialect=args.dialect,
        auto_pause_updates=args.auto_pause_updates,
        vllm_version=args.vllm_version,
        max_logprobs=args.max_logprobs,
        max_loras=args.max_loras,
    )


def check_engine_installed(engine: str) -> None:
    import importlib.util

    from weightsync.core.errors import InvalidRequest

    try:
        missing = engine == "vllm" and importlib.util.find_spec("vllm") is None
    except (ImportError, ValueError):  # a broken or blocked install is a missing one here
        missing = True
    if missing:
        raise InvalidRequest(
            "--engine vllm needs vLLM, which is not installed here: install it with the vllm extra "
            "(from a clone: pip install '.[http,torch,vllm]'), or serve the reference engine",
            code="missing_extra",
        )


def check_tensor_parallel(args: argparse.Namespace) -> None:
    from weightsync.core.errors import InvalidRequest

    if args.engine == "reference":
        from weightsync.engines.reference.tp_layout import check_tp_size

        check_tp_size(reference_config(args.model_config), args.tensor_parallel_size)
    elif args.tensor_parallel_size != 1:
        raise InvalidRequest(
            "--tensor-parallel-size is for the reference engine; give vLLM --vllm-arg tensor_parallel_size=T",
            code="invalid_value",
        )
    if args.engine == "reference" and args.chat_template is not None:
        raise InvalidRequest(
            "--chat-template is for --engine vllm; the reference engine's template is fixed",
            code="invalid_value",
        )
