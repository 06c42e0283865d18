"""``weightsync fleet update | status | recover | pause | resume``: a thin shell over
:mod:`weightsync.fleet`.

A transaction, once begun, is finished: a closed stdout (``| head``, a dropped ssh
session) or a hangup only silences the output; the transaction still commits or rolls
back, and the exit status is then non-zero (3) so the caller knows it did not see the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from weightsync.edge.arguments import add_api_key_argument, add_log_arguments, api_key_argument
from weightsync.fleet.result import PAUSE_MODES, POLICIES

if TYPE_CHECKING:
    from weightsync.fleet.coordinator import FleetCoordinator
    from weightsync.fleet.events import Event
    from weightsync.fleet.journal import Journal
    from weightsync.fleet.result import WorkerStatus


def add_parser(sub: Any) -> None:
    """Add ``fleet`` and its subcommands to the top-level subparsers ``sub``."""
    fleet = sub.add_parser("fleet", help="run weight updates across many workers as transactions")
    commands = fleet.add_subparsers(dest="fleet_command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--worker", action="append", required=True, metavar="URL", help="worker base URL (repeat)"
        )
        add_api_key_argument(p, "workers' bearer token")
        p.add_argument("--json", action="store_true", help="print one JSON object last")
        add_log_arguments(p, "every step of a transaction as it happens")

    update = commands.add_parser(
        "update",
        help="one transaction: prepare, apply, verify, commit",
        description="Run one fleet transaction from a disk checkpoint.  Exit status: 0 when the "
        "version was committed (on every worker, or with --policy fence on at least --min-workers "
        "of them: the fenced workers are named in the result), 1 when it was aborted or rolled "
        "back (or its rollback failed: phase rollback_failed), 2 for bad arguments (a relative path, a bad or locked journal, an unfinished "
        "transaction: run `weightsync fleet recover`), 3 when the output was closed or the terminal "
        'hung up (the transaction still finished).  --json prints one object last, with "committed", '
        '"ok", "fleet" (where the fleet now is) and "next_step".',
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
    update.add_argument(
        "--max-unavailable", type=int, metavar="K", help="rolling update: batches of K workers (default: all)"
    )
    update.add_argument("--journal", help="SQLite journal file (default: in memory, no recovery)")
    update.add_argument(
        "--initial-source",
        metavar="PATH",
        help="checkpoint the workers hold now (absolute, as workers see it): what a rollback "
        "restores before the journal has a committed one",
    )
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
    recover.add_argument("--initial-source", metavar="PATH", help="as for update")
    recover.set_defaults(func=_recover)

    for name, what in (("pause", "pause every worker (no transaction)"), ("resume", "resume every worker")):
        p = commands.add_parser(name, help=what, description=f"{what[0].upper()}{what[1:]}; prints each "
                                "worker's state after.  Exit 1 when a worker failed.")  # fmt: skip
        common(p)
        if name == "pause":
            p.add_argument(
                "--mode", choices=PAUSE_MODES, default="keep", help="how workers pause their requests"
            )
        p.set_defaults(func=_pause_or_resume)


def _version(text: str) -> Any:
    from weightsync.edge.arguments import version_argument

    return version_argument("--version", text)


class _Output:
    """Prints that never end a transaction: a closed stream is noted and then skipped."""

    def __init__(self) -> None:
        self.lost = False

    def print(self, text: str, *, err: bool = False) -> None:
        stream = sys.stderr if err else sys.stdout
        if self.lost and not err:
            return
        try:
            print(text, file=stream, flush=True)
        except (OSError, ValueError):  # BrokenPipeError, a closed file
            if not err:
                self.lost = True


OUT = _Output()


def _printer(args: argparse.Namespace) -> Any:
    """Each step as a line (stdout; stderr with ``--json``, which keeps stdout for the
    result), or with ``--log-format json`` as one JSON object; nothing above ``info``."""
    if args.log_level not in ("trace", "debug", "info"):
        return None

    def show(event: Event) -> None:
        if args.log_format == "json":
            OUT.print(json.dumps(event.to_log(), default=repr), err=bool(args.json))
        else:
            OUT.print(event.line(), err=bool(args.json))

    return show


def _coordinator(
    args: argparse.Namespace, journal: Journal | str | None, initial_source: str | None = None
) -> FleetCoordinator:
    from weightsync.fleet.coordinator import FleetCoordinator

    return FleetCoordinator(
        args.worker,
        journal=journal,
        api_key=api_key_argument("--api-key", args.api_key),
        on_event=_printer(args),
        initial_source=initial_source,
    )


def _absolute(flag: str, path: str | None) -> str | None:
    from weightsync.core.errors import InvalidRequest

    if path is not None and not os.path.isabs(path):
        raise InvalidRequest(
            f"{flag} {path!r} is relative: workers resolve it in their own directory; give an absolute path",
            code="invalid_value",
        )
    return path


def _shielded(work: Any) -> Any:
    """Run ``work()`` with SIGHUP noted instead of fatal (the transaction must finish)."""
    import signal

    hup = getattr(signal, "SIGHUP", None)
    if hup is None:
        return work()

    def note(signum: int, frame: Any) -> None:
        OUT.lost = True

    old = signal.signal(hup, note)
    try:
        return work()
    finally:
        signal.signal(hup, old)


def _describe(result: Any) -> list[str]:
    done = "" if result.phase == "committed" else " (committed)" if result.committed else " (not committed)"
    lines = [f"transaction {result.txn}: {result.phase}{done}, version {json.dumps(result.version)}"]
    fleet = result.fleet
    for v in fleet["versions"]:
        digest = str(v["digest"])[:12] if v["digest"] else "unknown"
        lines.append(
            f"  the fleet now serves version {json.dumps(v['version'])}, epoch {v['epoch']}, digest {digest} "
            f"on {len(v['workers'])} worker(s)"
        )
    if not fleet["versions"]:
        lines.append("  no worker is serving")
    for w in result.workers:
        codes = f" ({', '.join(w.codes)})" if w.codes else ""
        state = "serving" if w.serving else "unreachable" if w.holds is None else "paused"
        lines.append(f"  {w.url}: {w.outcome}, {state}{codes}")
    lines.append(f"next: {result.next_step}")
    return lines


def _finish(args: argparse.Namespace, results: list[Any], nothing: str = "") -> int:
    if args.json:
        body: Any = (
            [r.to_json() for r in results] if args.fleet_command == "recover" else results[0].to_json()
        )
        OUT.print(json.dumps(body))
    elif not results:
        OUT.print(nothing)
    for result in results if not args.json else []:
        for line in _describe(result):
            OUT.print(line)
    if OUT.lost:
        return 3
    return 0 if all(r.ok for r in results) else 1


def _update(args: argparse.Namespace) -> int:
    from weightsync.core.errors import WeightSyncError

    try:
        _absolute("--from-disk", args.from_disk)
        initial = _absolute("--initial-source", args.initial_source)
        coordinator = _coordinator(args, args.journal, initial)
        version = _version(args.version)
        result = _shielded(
            lambda: coordinator.update_sync(
                args.from_disk,
                version,
                policy=args.policy,
                min_workers=args.min_workers,
                max_unavailable=args.max_unavailable,
                pause_mode=args.pause_mode,
                deadline_s=args.deadline_s,
            )
        )
    except WeightSyncError as exc:
        OUT.print(f"weightsync fleet update: {exc.code}: {exc.message}", err=True)
        return 2
    return _finish(args, [result])


def _recover(args: argparse.Namespace) -> int:
    from weightsync.core.errors import WeightSyncError

    try:
        from weightsync.fleet.journal import Journal

        initial = _absolute("--initial-source", args.initial_source)
        coordinator = _coordinator(args, Journal(args.journal, must_exist=True), initial)
        results = _shielded(coordinator.recover_sync)
    except WeightSyncError as exc:
        OUT.print(f"weightsync fleet recover: {exc.code}: {exc.message}", err=True)
        return 2
    return _finish(args, results, "nothing to recover")


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
    return _statuses(args, lambda coordinator: coordinator.status())


def _pause_or_resume(args: argparse.Namespace) -> int:
    import asyncio

    def work(coordinator: FleetCoordinator) -> list[WorkerStatus]:
        pausing = args.fleet_command == "pause"
        return asyncio.run(coordinator.pause(args.mode) if pausing else coordinator.resume())

    return _statuses(args, work)


def _statuses(args: argparse.Namespace, work: Callable[[FleetCoordinator], list[WorkerStatus]]) -> int:
    """Print each worker's state after ``work``; exit 1 when a worker failed, 2 when the
    command was refused before any worker was asked."""
    from weightsync.core.errors import WeightSyncError

    try:
        statuses = work(_coordinator(args, None))
    except WeightSyncError as exc:
        OUT.print(f"weightsync fleet {args.fleet_command}: {exc.code}: {exc.message}", err=True)
        return 2
    _table(args, statuses)
    return 0 if all(s.error is None for s in statuses) else 1


def _table(args: argparse.Namespace, statuses: list[WorkerStatus]) -> None:
    if args.json:
        OUT.print(json.dumps({"workers": [s.to_json() for s in statuses]}))
    else:
        rows = [["worker", "version", "epoch", "digest", "state", "in-flight", "last error"]]
        rows += [_cell(s) for s in statuses]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            OUT.print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
