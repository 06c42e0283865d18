"""``weightsync router``: a version-aware router in front of a fleet of workers."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Final

from weightsync.edge import arguments
from weightsync.fleet import cli_shell

WORKER_API_KEY_ENV: Final = "WEIGHTSYNC_WORKER_API_KEY"


def add_parser(sub: Any) -> None:
    """Add ``router`` to the top-level subparsers ``sub``."""
    p = sub.add_parser(
        "router",
        help="route completions to workers by committed weight version; run fleet updates",
        description="Serve /v1/completions in front of the workers, routing each request to a worker "
        "that serves a committed (version, epoch, digest) allowed by the request's freshness policy, "
        "and /fleet/* admin routes that run fleet transactions (rolling with max_unavailable).  "
        "See docs/router.md.  Exit status 2 for bad arguments.",
    )
    cli_shell.add_worker_argument(p)
    cli_shell.add_journal_argument(
        p,
        "the fleet journal file (default: $WEIGHTSYNC_FLEET_JOURNAL, the fleet commands' default; "
        "without either, in memory: no recovery, and a warning at start)",
    )
    p.add_argument(
        "--follow-journal",
        action="store_true",
        help="the journal has another writer (a RayFleet driver, weightsync fleet update): take no lease, "
        "re-read its commits at every poll, refuse fleet updates (409 journal_followed); needs --journal",
    )
    arguments.add_bind_arguments(p, 8100, "an --api-key is")
    arguments.add_api_key_argument(p, "bearer token clients must send; required beyond loopback")
    arguments.add_api_key_argument(
        p,
        "bearer token the workers expect",
        flag="--worker-api-key",
        env=WORKER_API_KEY_ENV,
        otherwise="--api-key",
    )
    p.add_argument(
        "--version-policy",
        default="any",
        metavar="POLICY",
        help="default freshness: any | latest | min-epoch:N | max-staleness:K (default any)",
    )
    p.add_argument("--poll-interval-s", type=float, default=0.5, help="how often every worker is polled")
    cli_shell.add_initial_source_argument(
        p, "checkpoint a rollback restores before the journal has a committed one"
    )
    arguments.add_allowed_host_argument(
        p, "Host name a loopback request may carry besides loopback names (repeatable; '*' for any)"
    )
    arguments.add_log_arguments(
        p, "every fencing, admission, rolling batch, transaction step, rollback and refusal"
    )
    p.set_defaults(func=_router)

    demo = sub.add_parser(
        "router-demo",
        help="a fleet of three reference workers behind the router, rolling updates under load",
        description="Start three reference workers and a router, keep four clients sending "
        "completions, and move the fleet through rolling updates (max_unavailable=1).  Exit 0 when "
        "no request failed and every worker ended on the last epoch.",
    )
    demo.add_argument("--steps", type=int, default=2, help="rolling updates to run")
    demo.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    from weightsync.router.demo import run_router_demo

    return run_router_demo(steps=args.steps)


def _router(args: argparse.Namespace) -> int:
    from weightsync.core.errors import InvalidRequest, WeightSyncError
    from weightsync.edge.origin import is_loopback_host
    from weightsync.router.app import create_router_app
    from weightsync.router.policy import parse_policy
    from weightsync.router.service import Router

    try:
        args.api_key = arguments.api_key_argument("--api-key", args.api_key)
        args.worker_api_key = arguments.api_key_argument(
            "--worker-api-key", args.worker_api_key, WORKER_API_KEY_ENV
        )
        if not is_loopback_host(args.host) and not args.api_key:
            raise InvalidRequest(
                f"refusing to bind {args.host}: beyond loopback an API key is required "
                "(--api-key or WEIGHTSYNC_API_KEY)",
                code="api_key_required",
            )
        if not (0.01 <= args.poll_interval_s <= 60):
            raise InvalidRequest("--poll-interval-s must be between 0.01 and 60", code="invalid_value")
        policy = parse_policy(args.version_policy, "--version-policy")
        router = Router(
            args.worker,
            journal=args.journal or os.environ.get(cli_shell.JOURNAL_ENV) or None,
            worker_api_key=args.worker_api_key or args.api_key,
            poll_interval_s=args.poll_interval_s,
            default_policy=policy,
            initial_source=args.initial_source,
            follow_journal=args.follow_journal,
        )
        app = create_router_app(router, api_key=args.api_key, allowed_hosts=args.allowed_host)
    except WeightSyncError as exc:
        print(f"weightsync router: {exc.code}: {exc.message}", file=sys.stderr)
        return 2
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(
        f"weightsync router serving on http://{host}:{args.port} over {len(router.urls)} workers", flush=True
    )
    try:
        _serve(app, args.host, args.port, args.log_level, args.log_format)
    except KeyboardInterrupt:
        return 130
    return 0


def _serve(app: Any, host: str, port: int, log_level: str, log_format: str) -> None:
    import uvicorn

    from weightsync.edge.logs import server_config
    from weightsync.router.app import KEEP_ALIVE_S

    # uvloop and httptools when installed (uvicorn's "auto"), and no access log: every
    # completion passes through here, and the loop and parser are most of a hop's cost.
    config = server_config(
        app,
        host,
        port,
        log_level,
        log_format,
        timeout_graceful_shutdown=3,
        timeout_keep_alive=KEEP_ALIVE_S,
        loop="auto",
        http="auto",
        access_log=False,
    )
    uvicorn.Server(config).run()  # on a fresh loop from that factory
