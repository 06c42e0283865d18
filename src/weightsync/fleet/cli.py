"""``weightsync fleet update | status | recover``: a thin shell over :mod:`weightsync.fleet`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING, Any

from .result import PAUSE_MODES, POLICIES

if TYPE_CHECKING:
    from .coordinator import Event, FleetCoordinator, WorkerStatus
    from .journal import Journal


def add_parser(sub: Any) -> None:
    """Add ``fleet`` and its subcommands to the top-level subparsers ``sub``."""
    fleet = sub.add_parser("fleet", help="run weight updates across many workers as transactions")
    commands = fleet.add_subparsers(dest="fleet_command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--worker", action="append", required=True, metavar="URL", help="worker base URL (repeat)"
        )
        p.add_argument(
            "--api-key", default=os.environ.get("WEIGHTSYNC_API_KEY"), help="workers' bearer token"
        )
        p.add_argument("--json", action="store_true", help="print one JSON object last")

    update = commands.add_parser(
        "update",
        help="one transaction: prepare, apply, verify, commit",
        description="Run one fleet transaction from a disk checkpoint.  Exit status: 0 when the "
        "version was committed (on every worker, or with --policy fence on at least --min-workers "
        "of them: the fenced workers are named in the result), 1 when it was aborted or rolled "
        'back, 2 for bad arguments.  --json prints one object last, with "committed" and "ok".',
    )
    common(update)
    update.add_argument(
        "--from-disk", required=True, metavar="PATH", help="checkpoint path, as workers see it"
    )
    update.add_argument("--version", required=True, help="version to declare (JSON value, or a plain string)")
    update.add_argument(
        "--policy", choices=POLICIES, default="rollback",
        help="on a failure: roll every worker back, or fence the failing ones off",
    )  # fmt: skip
    update.add_argument(
        "--min-workers", type=int, help="fence: commit when at least K verified (default: majority)"
    )
    update.add_argument(
        "--pause-mode", choices=PAUSE_MODES, default="keep", help="how workers pause their requests"
    )
    update.add_argument(
        "--deadline-s", type=float, default=600.0, help="the transaction's deadline (at most 86400)"
    )
    update.add_argument("--journal", help="SQLite journal file (default: in memory, no recovery)")
    update.set_defaults(func=_update)

    status = commands.add_parser(
        "status",
        help="each worker's version, epoch, digest and state",
        description='A table (or with --json one object {"workers": [...]}) of each worker\'s '
        "version, epoch, digest, paused/torn, in-flight update and last error: the error code of "
        'a worker that did not answer, "torn" for a torn one, else none.  Exit 1 when a worker '
        "did not answer.",
    )
    common(status)
    status.set_defaults(func=_status)

    recover = commands.add_parser("recover", help="finish or roll back a transaction whose coordinator died")
    common(recover)
    recover.add_argument("--journal", required=True, help="the update's journal file (must exist)")
    recover.set_defaults(func=_recover)


def _version(text: str) -> Any:
    try:
        return json.loads(text)
    except RecursionError:
        from weightsync.core.errors import InvalidRequest

        raise InvalidRequest("--version is nested too deeply", code="invalid_value") from None
    except ValueError:
        return text


def _printer(args: argparse.Namespace) -> Any:
    def show(event: Event) -> None:
        print(event.line(), file=sys.stderr if args.json else sys.stdout, flush=True)

    return show


def _coordinator(args: argparse.Namespace, journal: Journal | str | None) -> FleetCoordinator:
    from .coordinator import FleetCoordinator

    return FleetCoordinator(args.worker, journal=journal, api_key=args.api_key, on_event=_printer(args))


def _finish(args: argparse.Namespace, result: Any) -> int:
    if args.json:
        print(json.dumps(result.to_json() if result is not None else None))
    elif result is not None:
        done = (
            "" if result.phase == "committed" else " (committed)" if result.committed else " (not committed)"
        )
        print(f"{result.phase}{done}: version {json.dumps(result.version)}, epoch {result.epoch}")
        for w in result.workers:
            print(f"  {w.url}: {w.outcome}" + (f" ({w.code})" if w.code else ""))
    else:
        print("nothing to recover")
    return 0 if result is None or result.ok else 1


def _update(args: argparse.Namespace) -> int:
    from weightsync.core.errors import WeightSyncError

    try:
        result = _coordinator(args, args.journal).update_sync(
            args.from_disk,
            _version(args.version),
            policy=args.policy,
            min_workers=args.min_workers,
            pause_mode=args.pause_mode,
            deadline_s=args.deadline_s,
        )
    except WeightSyncError as exc:
        print(f"weightsync fleet update: {exc.code}: {exc.message}", file=sys.stderr)
        return 2
    return _finish(args, result)


def _recover(args: argparse.Namespace) -> int:
    from weightsync.core.errors import WeightSyncError

    try:
        from .journal import Journal

        result = _coordinator(args, Journal(args.journal, must_exist=True)).recover_sync()
    except WeightSyncError as exc:
        print(f"weightsync fleet recover: {exc.code}: {exc.message}", file=sys.stderr)
        return 2
    return _finish(args, result)


def _cell(status: WorkerStatus) -> list[str]:
    if status.reply is None:
        return [status.url, "-", "-", "-", "-", "-", status.last_error or "-"]
    state = "torn" if status.get("torn") else "paused" if status.get("paused") else "running"
    digest = status.get("digest")
    return [
        status.url,
        json.dumps(status.get("version")) if status.get("version_declared") else "undeclared",
        str(status.get("epoch")) if status.get("epoch") is not None else "-",
        digest[:12] if isinstance(digest, str) else "unknown",
        state,
        "yes" if status.get("update_in_flight") else "no",
        status.last_error or "-",
    ]


def _status(args: argparse.Namespace) -> int:
    from weightsync.core.errors import WeightSyncError

    try:
        statuses = _coordinator(args, None).status()
    except WeightSyncError as exc:
        print(f"weightsync fleet status: {exc.code}: {exc.message}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"workers": [s.to_json() for s in statuses]}))
    else:
        rows = [["worker", "version", "epoch", "digest", "state", "in-flight", "last error"]]
        rows += [_cell(s) for s in statuses]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return 0 if all(s.error is None for s in statuses) else 1
