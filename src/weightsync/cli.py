"""Command line: ``weightsync serve | demo | diagram | checkpoint``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any


def _diagram(_: argparse.Namespace) -> int:
    from weightsync.core.diagram import render_mermaid

    sys.stdout.write(render_mermaid())
    return 0


def _reference_config(name: str) -> Any:
    from weightsync.engines.reference import ModelConfig

    configs = {
        "default": ModelConfig,
        "tiny": ModelConfig.tiny,
        "qwen2.5-0.5b": ModelConfig.qwen2_5_0_5b,
    }
    return configs[name]()


def _initial_version(text: str) -> Any:
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
            _reference_config(args.model_config),
            tensor_parallel_size=args.tensor_parallel_size,
            allowed_weight_dirs=args.allowed_weight_dir or None,
        )
    else:
        from weightsync.engines.vllm.serve import build_engine

        engine = build_engine(args)
    version = UNDECLARED if args.initial_version is None else Declared(_initial_version(args.initial_version))
    controller = Controller(
        engine, version=version, require_version=args.require_version, session_timeout_s=args.session_timeout,
        clock=worker_clock(),
    )  # fmt: skip
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
    )


def _check_engine_installed(engine: str) -> None:
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


def _check_tensor_parallel(args: argparse.Namespace) -> None:
    from weightsync.core.errors import InvalidRequest

    if args.engine == "reference":
        from weightsync.engines.reference.tp_layout import check_tp_size

        check_tp_size(_reference_config(args.model_config), args.tensor_parallel_size)
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


def _serve(args: argparse.Namespace) -> int:
    import time

    from weightsync.core.errors import WeightSyncError
    from weightsync.edge.arguments import TEST_CLOCK_OFFSET, api_key_argument, worker_clock
    from weightsync.serve.server import bind, bound_url, check_exposure, serve

    try:
        args.api_key = api_key_argument("--api-key", args.api_key)
        check_exposure(args.host, args.api_key, args.allowed_weight_dir)
        if args.initial_version is not None:
            _initial_version(args.initial_version)
        _check_engine_installed(args.engine)
        _check_tensor_parallel(args)
        if worker_clock() is not time.time:
            print(f"weightsync serve: this worker's clock is shifted by ${TEST_CLOCK_OFFSET} (for tests only)",
                  file=sys.stderr)  # fmt: skip
        # Bound before the engine starts: a busy port is an error at once, and the address
        # is announced only once the server really listens on it.
        sock = bind(args.host, args.port)
    except WeightSyncError as exc:
        print(f"weightsync serve: {exc.message}", file=sys.stderr)
        return 2

    def announce() -> None:
        # What the engine and the server built to start lives as long as the process: kept
        # out of the collector's full passes, which otherwise walk it all during updates.
        gc.freeze()
        print(f"weightsync worker ({args.engine}) serving on {bound_url(sock)}", flush=True)

    async def run() -> None:
        # The engine is built on the server's own event loop (vLLM's client binds to it).
        app = build_worker_app(args)
        await serve(
            app,
            args.host,
            args.port,
            log_level=args.log_level,
            log_format=args.log_format,
            sock=sock,
            on_started=announce,
        )

    try:
        asyncio.run(run())
    except KeyboardInterrupt:  # Ctrl-C after uvicorn's graceful shutdown: exit quietly
        return 130
    return 0


def _checkpoint(args: argparse.Namespace) -> int:
    """Write the reference engine's seeded weights, perturbed with ``--seed``, as a checkpoint."""
    import torch

    from weightsync.engines.reference.model import CausalLM
    from weightsync.trainer.checkpoint import save_checkpoint

    weights = CausalLM(_reference_config(args.model_config), slots=1).weights()
    gen = torch.Generator().manual_seed(args.seed)
    new = {}
    for name, t in weights.items():  # what a training step does, large enough to change outputs
        scale = float(t.float().std()) or 0.1
        noise = torch.randn(t.shape, generator=gen) * (0.5 * scale)
        new[name] = (t.float() + noise).to(t.dtype)
    try:
        with _progress_reporter("weightsync checkpoint") as report:
            path = save_checkpoint(
                new, args.out, version=args.version, overwrite=args.overwrite, progress=report
            )
    except FileExistsError:
        print(f"weightsync checkpoint: {args.out} exists (pass --overwrite to replace it)", file=sys.stderr)
        return 2
    print(path)
    return 0


def _delta(args: argparse.Namespace) -> int:
    """Write the delta checkpoint from ``--base`` to ``--target`` (prints its absolute path)."""
    from weightsync.core.errors import WeightSyncError
    from weightsync.trainer.delta import delta_between_checkpoints

    try:
        path = delta_between_checkpoints(args.base, args.target, args.out, encoding=args.encoding)
    except FileExistsError:
        print(f"weightsync delta: {args.out} exists", file=sys.stderr)
        return 2
    except (WeightSyncError, ValueError) as exc:
        print(f"weightsync delta: {getattr(exc, 'message', exc)}", file=sys.stderr)
        return 2
    print(path)
    return 0


@contextlib.contextmanager
def _progress_reporter(prog: str, every_s: float = 2.0) -> Iterator[Callable[[int, int, str], None]]:
    """A ``progress(done, total, what)`` callback for long CLI work, reporting on stderr: a
    bar in a terminal, else a plain line at most every ``every_s`` seconds and one at the end
    (so logs and CI output show it too).  stdout is left to the command's result."""
    import time

    start = time.monotonic()
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        bar = Progress(
            TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
            TimeElapsedColumn(), console=Console(stderr=True), transient=True,
        )  # fmt: skip
        task = bar.add_task(prog, total=None)

        def update_bar(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total, description=f"{prog}: {what}")

        with bar:
            yield update_bar
        return

    last = [start, -1]

    def line(done: int, total: int, what: str) -> None:
        now = time.monotonic()
        pct = 100 * done // total if total else 100
        if pct != last[1] and (now - last[0] >= every_s or done >= total):
            last[:] = [now, pct]
            print(f"{prog}: {pct}% ({what}), {now - start:.1f} s", file=sys.stderr, flush=True)

    yield line


def _demo(args: argparse.Namespace) -> int:
    from weightsync.demo import run_demo

    return run_demo(steps=args.steps)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default after its help, except where there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "%(default)" in text or action.default in (None, False, [], argparse.SUPPRESS):
            return text
        if "key" in action.dest or "token" in action.dest:  # a secret read from the environment
            return text
        return f"{text} (default: %(default)s)"


def _use_formatter(parser: argparse.ArgumentParser) -> None:
    """Every command's ``--help``, subcommands' included, shows defaults the same way."""
    parser.formatter_class = _HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _use_formatter(child)


def build_parser() -> argparse.ArgumentParser:
    from weightsync import __version__
    from weightsync.edge.arguments import (
        add_allowed_host_argument,
        add_api_key_argument,
        add_bind_arguments,
        add_log_arguments,
    )
    from weightsync.edge.dialects import VLLM_VERSIONS

    parser = argparse.ArgumentParser(
        prog="weightsync", description="weight-update control plane for RL inference"
    )
    parser.add_argument("--version", action="version", version=f"weightsync {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    diagram = sub.add_parser("diagram", help="print the state machine as Mermaid")
    diagram.set_defaults(func=_diagram)

    serve = sub.add_parser("serve", help="serve the admin routes and /v1/completions over an engine")
    serve.add_argument("--engine", choices=["reference", "vllm"], default="reference",
                       help="the engine behind the routes: the built-in torch reference engine, or vLLM")  # fmt: skip
    add_bind_arguments(
        serve, 8000, "an --api-key and --allowed-weight-dir are", "TCP port (0 picks a free one)"
    )
    add_api_key_argument(serve, "bearer token every request must carry")
    serve.add_argument(
        "--allowed-weight-dir", action="append", default=[], metavar="DIR",
        help="directory checkpoints may be loaded from (repeatable; required beyond loopback)",
    )  # fmt: skip
    serve.add_argument("--model-config", choices=["default", "tiny", "qwen2.5-0.5b"], default="default",
                       help="reference engine shape")  # fmt: skip
    serve.add_argument("--tensor-parallel-size", type=int, default=1, metavar="T",
                       help="reference engine: serve with T tensor-parallel processes over gloo")  # fmt: skip
    serve.add_argument("--model", help="vLLM: model directory")
    serve.add_argument(
        "--require-version", action="store_true",
        help="refuse an update that omits weight_version (400 version_required), so the label "
        "always describes the weights held",
    )  # fmt: skip
    serve.add_argument(
        "--session-timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="abandon an update session when nothing of it arrives for this long (default: %(default)s)",
    )
    serve.add_argument(
        "--initial-version", help="declare this version at start (a JSON value, or a plain string)"
    )
    add_allowed_host_argument(
        serve,
        "Host name a request arriving over loopback may carry besides loopback names, e.g. a "
        "local reverse proxy's (repeatable; '*' for any)",
    )
    serve.add_argument("--max-body-bytes", type=int, default=16 << 20,
                       help="largest request body accepted (bigger is 413)")  # fmt: skip
    add_log_arguments(serve, "every pause, resume, update, declaration and refusal")
    serve.add_argument(
        "--dialect", choices=["vllm", "sglang"], default=None,
        help="answer the paths vLLM and SGLang both serve (/update_weight_version, /server_info) in "
        "this one's shape, and with vllm vLLM's replies with vLLM's keys only (default: both "
        "dialects, each request in its own shape; see docs/dialects.md)",
    )  # fmt: skip
    serve.add_argument(
        "--auto-pause-updates", action="store_true",
        help="let vLLM's /start_weight_update begin on a serving worker (as TRL's client sends it): "
        "the worker pauses (mode wait) for the update and resumes after /finish_weight_update",
    )  # fmt: skip
    serve.add_argument(
        "--vllm-version", choices=list(VLLM_VERSIONS), default=VLLM_VERSIONS[-1],
        help="the vLLM release whose RL API the vLLM routes mirror where releases differ: 0.33 refuses "
        "new generation requests with 503 while paused by /pause in mode abort or wait (until /resume), "
        "0.32 queues them (default: %(default)s)",
    )  # fmt: skip
    serve.add_argument(
        "--max-logprobs", type=int, default=20, metavar="N",
        help="the most log-probability alternatives per token a generation request may ask for "
        "(logprobs, top_logprobs, top_logprobs_num, prompt_logprobs), as vLLM's --max-logprobs: "
        "-1 for no bound; with --engine vllm also vLLM's own (default: %(default)s)",
    )  # fmt: skip
    serve.add_argument("--vllm-arg", action="append", default=[], metavar="KEY=VALUE",
                       help="vLLM: extra engine argument (JSON value), repeatable")  # fmt: skip
    serve.add_argument(
        "--chat-template", metavar="FILE_OR_TEMPLATE",
        help="vLLM: the chat template of /v1/chat/completions, a file or the Jinja template itself (as "
        "vLLM's --chat-template), instead of the one in the model's tokenizer",
    )  # fmt: skip
    serve.add_argument(
        "--vllm-delta-base", choices=["none", "copy"], default="none",
        help="vLLM: keep a checkpoint-form copy of the weights in host memory so the worker takes "
        "deltas (one host copy of the model, and a host copy of every tensor each full load); "
        "default none: deltas are 501",
    )  # fmt: skip
    serve.set_defaults(func=_serve)

    checkpoint = sub.add_parser(
        "checkpoint", help="write a checkpoint the reference engine can load (prints its absolute path)"
    )
    checkpoint.add_argument("--out", required=True, metavar="DIR", help="directory to create")
    checkpoint.add_argument("--model-config", choices=["default", "tiny", "qwen2.5-0.5b"], default="default",
                            help="reference engine shape (must match the worker's)")  # fmt: skip
    checkpoint.add_argument("--seed", type=int, default=1, help="seed of the perturbation")
    checkpoint.add_argument("--version", help="version label recorded in the checkpoint's manifest")
    checkpoint.add_argument("--overwrite", action="store_true", help="replace DIR if it exists")
    checkpoint.set_defaults(func=_checkpoint)

    delta = sub.add_parser(
        "delta", help="write the delta checkpoint between two checkpoints (prints its path)"
    )
    delta.add_argument("--base", required=True, metavar="DIR", help="the checkpoint the workers hold")
    delta.add_argument("--target", required=True, metavar="DIR", help="the checkpoint they should hold")
    delta.add_argument("--out", required=True, metavar="DIR", help="directory to create")
    delta.add_argument("--encoding", choices=["sparse", "xor"], default="sparse",
                       help="sparse: changed indices and new values; xor: changed indices and old^new bits")  # fmt: skip
    delta.set_defaults(func=_delta)

    demo = sub.add_parser("demo", help="run an end-to-end RL-style loop on the reference engine")
    demo.add_argument("--steps", type=int, default=3, help="training steps to run")
    demo.set_defaults(func=_demo)

    from weightsync.fleet.cli import add_parser as add_fleet_parser

    add_fleet_parser(sub)
    __import__("weightsync.planner").planner.add_parser(sub)
    __import__("weightsync.router.cli").router.cli.add_parser(sub)
    _use_formatter(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
