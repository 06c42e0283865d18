"""Command line: ``weightsync serve | demo | diagram | checkpoint``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import sys
from collections.abc import Callable, Iterator, Sequence


def _diagram(_: argparse.Namespace) -> int:
    from weightsync.core.diagram import render_mermaid

    sys.stdout.write(render_mermaid())
    return 0


def _serve(args: argparse.Namespace) -> int:
    import time

    from weightsync.core.errors import WeightSyncError
    from weightsync.edge.arguments import TEST_CLOCK_OFFSET, worker_clock
    from weightsync.serve.server import bind, bound_url, serve
    from weightsync.worker_app import build_worker_app, check_serve_arguments

    try:
        check_serve_arguments(args, serving_http=True)
        if worker_clock() is not time.time:
            print(
                f"weightsync serve: this worker's clock is shifted by ${TEST_CLOCK_OFFSET} (for tests only)",
                file=sys.stderr,
            )
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
    """Write the reference engine's seeded weights, perturbed with ``--seed`` (or as they are,
    with ``--initial``: what a fresh ``serve`` holds), as a checkpoint."""
    import torch

    from weightsync.engines.reference.model import CausalLM
    from weightsync.trainer.checkpoint import save_checkpoint
    from weightsync.worker_app import reference_config

    weights = CausalLM(reference_config(args.model_config), slots=1).weights()
    gen = torch.Generator().manual_seed(args.seed)
    new = {}
    for name, t in weights.items():  # what a training step does, large enough to change outputs
        if args.initial:
            new[name] = t.detach().clone()
            continue
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
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.percentage:>3.0f}%"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=True,
        )
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
    if args.rl:
        from weightsync.rl_demo import Settings, run_rl_demo

        steps = {} if args.steps is None else {"steps": args.steps}
        return run_rl_demo(Settings(seed=args.seed, **steps), as_json=args.json)
    if args.json:
        print("weightsync demo: --json goes with --rl", file=sys.stderr)
        return 2
    from weightsync.demo import run_demo

    return run_demo(steps=3 if args.steps is None else args.steps)


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
    from weightsync.worker_app import add_serve_arguments

    parser = argparse.ArgumentParser(
        prog="weightsync", description="weight-update control plane for RL inference"
    )
    parser.add_argument("--version", action="version", version=f"weightsync {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    diagram = sub.add_parser("diagram", help="print the state machine as Mermaid")
    diagram.set_defaults(func=_diagram)

    serve = sub.add_parser("serve", help="serve the admin routes and /v1/completions over an engine")
    add_serve_arguments(serve)
    serve.set_defaults(func=_serve)

    checkpoint = sub.add_parser(
        "checkpoint", help="write a checkpoint the reference engine can load (prints its absolute path)"
    )
    checkpoint.add_argument("--out", required=True, metavar="DIR", help="directory to create")
    checkpoint.add_argument(
        "--model-config",
        choices=["default", "tiny", "qwen2.5-0.5b"],
        default="default",
        help="reference engine shape (must match the worker's)",
    )
    checkpoint.add_argument("--seed", type=int, default=1, help="seed of the perturbation")
    checkpoint.add_argument(
        "--initial",
        action="store_true",
        help="write the weights a fresh `serve` of this --model-config holds (no perturbation): "
        "a fleet's first --initial-source",
    )
    checkpoint.add_argument("--version", help="version label recorded in the checkpoint's manifest")
    checkpoint.add_argument("--overwrite", action="store_true", help="replace DIR if it exists")
    checkpoint.set_defaults(func=_checkpoint)

    delta = sub.add_parser(
        "delta", help="write the delta checkpoint between two checkpoints (prints its path)"
    )
    delta.add_argument("--base", required=True, metavar="DIR", help="the checkpoint the workers hold")
    delta.add_argument("--target", required=True, metavar="DIR", help="the checkpoint they should hold")
    delta.add_argument("--out", required=True, metavar="DIR", help="directory to create")
    delta.add_argument(
        "--encoding",
        choices=["sparse", "xor"],
        default="sparse",
        help="sparse: changed indices and new values; xor: changed indices and old^new bits",
    )
    delta.set_defaults(func=_delta)

    demo = sub.add_parser("demo", help="run an end-to-end RL-style loop on the reference engine")
    demo.add_argument("--steps", type=int, help="training steps to run (default: 3; with --rl, 20)")
    demo.add_argument(
        "--rl",
        action="store_true",
        help="a policy-gradient loop that learns: rollouts through a router from two workers, one fleet "
        "transaction per step, stale samples dropped or corrected by their version stamps",
    )
    demo.add_argument("--seed", type=int, default=0, help="--rl: seed of the prompts and of the sampling")
    demo.add_argument("--json", action="store_true", help="--rl: print the figures as one JSON object")
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
