"""``weightsync fleet update | status | recover | adopt | pause | resume``: a thin shell over
:mod:`weightsync.fleet`.

The journal is ``--journal PATH``, or the file ``$WEIGHTSYNC_FLEET_JOURNAL`` names; ``update``,
``recover`` and ``adopt`` refuse to run without one (``journal_required``, exit 2): a
throwaway in-memory journal would commit epochs no later journal knows.

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

JOURNAL_ENV = "WEIGHTSYNC_FLEET_JOURNAL"
_JOURNAL_HELP = f"SQLite journal file (default: ${JOURNAL_ENV})"

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
    update.add_argument("--journal", help=_JOURNAL_HELP + "; created when missing; one is required")
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
        "version, epoch, digest, whether its label describes its weights (version_current), "
        "paused/torn, in-flight update and last error: the error code of a worker that did not "
        'answer, "torn" for a torn one, else none.  With --journal (or $WEIGHTSYNC_FLEET_JOURNAL) '
        "also the version, epoch and digest the journal committed for it and whether it holds "
        "exactly that (holds_commit).  Exit 1 when a worker did not answer.",
    )
    common(status)
    status.add_argument("--journal", help=_JOURNAL_HELP + "; must exist; read only")
    status.set_defaults(func=_status)

    recover = commands.add_parser("recover", help="finish or roll back a transaction whose coordinator died")
    common(recover)
    recover.add_argument("--journal", help=_JOURNAL_HELP + "; the update's journal (must exist)")
    recover.add_argument("--initial-source", metavar="PATH", help="as for update")
    recover.set_defaults(func=_recover)

    adopt = commands.add_parser(
        "adopt",
        help="take the state the workers hold into the journal (the way out of untrusted_epoch)",
        description="Check that every worker answers, none is torn or mid-update, each one's label "
        "describes its weights and all hold one version and digest; then issue an epoch above "
        "every worker's, declare it on every worker (read back) and record them as committed.  "
        "Nothing is declared when a check fails.  Exit 0 when adopted, 1 when a check failed or "
        "a worker did not take it, 2 for bad arguments or a bad or locked journal.",
    )
    common(adopt)
    adopt.add_argument("--journal", help=_JOURNAL_HELP + "; created when missing")
    adopt.add_argument(
        "--source", metavar="PATH",
        help="checkpoint the workers hold (absolute, as workers see it): checked on every worker, "
        "recorded as what a rollback restores",
    )  # fmt: skip
    adopt.set_defaults(func=_adopt)

    for name, what in (("pause", "pause every worker (no transaction)"), ("resume", "resume every worker")):
        p = commands.add_parser(name, help=what, description=f"{what[0].upper()}{what[1:]}; prints each "
                                "worker's state after.  Exit 1 when a worker failed.")  # fmt: skip
        common(p)
        if name == "pause":
            p.add_argument(
                "--mode", choices=PAUSE_MODES, default="keep", help="how workers pause their requests"
            )
        else:
            p.add_argument(
                "--allow-mislabelled", action="store_true",
                help="also resume a worker whose label does not describe its weights (refused by "
                "default: version_not_current, it stays paused)",
            )  # fmt: skip
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


def _journal_path(args: argparse.Namespace, required: bool = True) -> str | None:
    """``--journal``, else ``$WEIGHTSYNC_FLEET_JOURNAL``.  Raises ``InvalidRequest``
    (``journal_required``) when ``required`` and neither names one."""
    from weightsync.core.errors import InvalidRequest

    path = args.journal or os.environ.get(JOURNAL_ENV) or None
    if path is None and required:
        raise InvalidRequest(
            f"weightsync fleet {args.fleet_command} needs a journal: --journal PATH (or ${JOURNAL_ENV}); "
            "use the same file for every command on this fleet",
            code="journal_required",
        )
    return path


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
        coordinator = _coordinator(args, _journal_path(args), initial)
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
        coordinator = _coordinator(args, Journal(_journal_path(args), must_exist=True), initial)
        results = _shielded(coordinator.recover_sync)
    except WeightSyncError as exc:
        OUT.print(f"weightsync fleet recover: {exc.code}: {exc.message}", err=True)
        return 2
    return _finish(args, results, "nothing to recover")


def _adopt(args: argparse.Namespace) -> int:
    import asyncio

    from weightsync.core.errors import WeightSyncError
    from weightsync.fleet.adoption import adopt

    try:
        source = _absolute("--source", args.source)
        coordinator = _coordinator(args, _journal_path(args))
        done = asyncio.run(adopt(coordinator, source))
    except WeightSyncError as exc:
        OUT.print(f"weightsync fleet adopt: {exc.code}: {exc.message}", err=True)
        return 2 if exc.code in _ARGUMENT_CODES else 1
    if args.json:
        OUT.print(json.dumps(done.to_json()))
    else:
        OUT.print(
            f"adopted version {json.dumps(done.version)}, epoch {done.epoch}, digest {done.digest[:12]}"
        )
        for w in done.workers:
            OUT.print(f"  {w.url}: {'adopted' if w.error is None else w.error.code}")
        OUT.print(f"next: {done.next_step}")
    return 0 if done.ok else 1


_ARGUMENT_CODES = frozenset(
    {"invalid_value", "bad_journal", "journal_locked", "journal_required", "unfinished_transaction",
     "bad_worker_url", "duplicate_worker", "no_workers"}
)  # fmt: skip


def _status(args: argparse.Namespace) -> int:
    return _statuses(args, lambda coordinator: coordinator.status(), with_journal=True)


def _pause_or_resume(args: argparse.Namespace) -> int:
    import asyncio

    def work(coordinator: FleetCoordinator) -> list[WorkerStatus]:
        if args.fleet_command == "pause":
            return asyncio.run(coordinator.pause(args.mode))
        return asyncio.run(coordinator.resume(allow_mislabelled=args.allow_mislabelled))

    return _statuses(args, work)


def _statuses(
    args: argparse.Namespace,
    work: Callable[[FleetCoordinator], list[WorkerStatus]],
    with_journal: bool = False,
) -> int:
    """Print each worker's state after ``work`` (with the journal's committed rows for
    ``status``); exit 1 when a worker failed, 2 when the command was refused before any
    worker was asked."""
    from weightsync.core.errors import WeightSyncError
    from weightsync.fleet.status_view import status_json, status_lines

    committed = None
    try:
        path = _journal_path(args, required=False) if with_journal else None
        coordinator = _coordinator(args, None)
        if path is not None:
            from weightsync.fleet.journal import Journal

            with Journal(path, must_exist=True) as journal:
                committed = {u: journal.committed(u) for u in coordinator.workers}
        statuses = work(coordinator)
    except WeightSyncError as exc:
        OUT.print(f"weightsync fleet {args.fleet_command}: {exc.code}: {exc.message}", err=True)
        return 2
    if args.json:
        OUT.print(json.dumps(status_json(statuses, committed)))
    else:
        for line in status_lines(statuses, committed):
            OUT.print(line)
    for s in statuses if not args.json else []:
        if s.error is not None and s.error.code == "version_not_current":
            OUT.print(f"{s.url}: {s.error.message}", err=True)
    return 0 if all(s.error is None for s in statuses) else 1
