"""``weightsync fleet update | status | recover | adopt | add | pause | resume``: a thin shell over
:mod:`weightsync.fleet`.

The journal is ``--journal PATH``, or the file ``$WEIGHTSYNC_FLEET_JOURNAL`` names; ``update``,
``recover``, ``adopt`` and ``add`` refuse to run without one (``journal_required``, exit 2): a
throwaway in-memory journal would commit epochs no later journal knows.

A transaction, once begun, is finished: a closed stdout (``| head``, a dropped ssh
session) or a hangup only silences the output; the transaction still commits or rolls
back, and the exit status is then non-zero (3) so the caller knows it did not see the end.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from weightsync.core.requests import MAX_TIMEOUT_S
from weightsync.fleet.cli_membership import add_membership_parsers
from weightsync.fleet.cli_shell import JOURNAL_ENV, OUT
from weightsync.fleet.cli_shell import JOURNAL_HELP as _JOURNAL_HELP
from weightsync.fleet.cli_shell import absolute as _absolute
from weightsync.fleet.cli_shell import add_command as _add_command
from weightsync.fleet.cli_shell import add_initial_source_argument as _add_initial_source_argument
from weightsync.fleet.cli_shell import add_journal_argument as _add_journal_argument
from weightsync.fleet.cli_shell import coordinator as _coordinator
from weightsync.fleet.cli_shell import journal_path as _journal_path
from weightsync.fleet.cli_shell import shielded as _shielded
from weightsync.fleet.result import PAUSE_MODES, POLICIES

if TYPE_CHECKING:
    from weightsync.fleet.coordinator import FleetCoordinator
    from weightsync.fleet.result import WorkerStatus


def add_parser(sub: Any) -> None:
    """Add ``fleet`` and its subcommands to the top-level subparsers ``sub``."""
    fleet = sub.add_parser("fleet", help="run weight updates across many workers as transactions")
    commands = fleet.add_subparsers(dest="fleet_command", required=True)

    update = _add_command(
        commands,
        "update",
        _update,
        help="one transaction: prepare, apply, verify, commit",
        description="Run one fleet transaction from a disk checkpoint or a delta.  Exit status: 0 when the "
        "version was committed (on every worker, or with --policy fence on at least --min-workers "
        "of them: the fenced workers are named in the result), 1 when it was aborted or rolled "
        "back (or its rollback failed: phase rollback_failed), 2 for bad arguments (a relative path, a bad or locked journal, an unfinished "
        "transaction: run `weightsync fleet recover`), 3 when the output was closed or the terminal "
        'hung up (the transaction still finished).  --json prints one object last, with "committed", '
        '"ok", "fleet" (where the fleet now is) and "next_step".',
    )
    source = update.add_mutually_exclusive_group(required=True)
    source.add_argument("--from-disk", metavar="PATH", help="checkpoint path, as workers see it")
    source.add_argument(
        "--from-delta",
        metavar="DIR",
        help="delta checkpoint (weightsync delta), as workers see it: every worker must hold its base; "
        "a rollback restores the base from a checkpoint the journal (or --initial-source) knows",
    )
    update.add_argument(
        "--version",
        help="version to declare (JSON value, or a plain string); required with --from-disk, with "
        "--from-delta the delta's target version (the default)",
    )
    update.add_argument(
        "--relabel",
        action="store_true",
        help="declare --version even where the checkpoint's manifest names another version (else the "
        "transaction is refused at prepare: version_mismatch)",
    )
    update.add_argument(
        "--policy",
        choices=POLICIES,
        default="rollback",
        help="on a failure: roll every worker back, or fence the failing ones off",
    )
    update.add_argument(
        "--min-workers", type=int, help="fence: commit when at least K verified (default: majority)"
    )
    update.add_argument(
        "--pause-mode", choices=PAUSE_MODES, default="keep", help="how workers pause their requests"
    )
    update.add_argument(
        "--deadline-s",
        type=float,
        default=600.0,
        help=f"the transaction's deadline (at most {MAX_TIMEOUT_S:g})",
    )
    update.add_argument(
        "--max-unavailable", type=int, metavar="K", help="rolling update: batches of K workers (default: all)"
    )
    _add_journal_argument(update, _JOURNAL_HELP + "; created when missing; one is required")
    _add_initial_source_argument(
        update,
        "checkpoint the workers hold now (absolute, as workers see it): what a rollback "
        "restores before the journal has a committed one",
    )

    status = _add_command(
        commands,
        "status",
        _status,
        workers_required=False,
        help="each worker's version, epoch, digest and state",
        description='A table (or with --json one object {"workers": [...]}) of each worker\'s '
        "version, epoch, digest, whether its label describes its weights (version_current), "
        "paused/torn, in-flight update and last error: the error code of a worker that did not "
        'answer, "torn" for a torn one, else none.  With --journal (or $WEIGHTSYNC_FLEET_JOURNAL) '
        "also the version, epoch and digest the journal committed for it and whether it holds "
        "exactly that (holds_commit); with --journal alone, of every member the journal lists.  "
        "Exit 1 when a worker did not answer.",
    )
    _add_journal_argument(status, _JOURNAL_HELP + "; must exist; read only")

    recover = _add_command(
        commands, "recover", _recover, help="finish or roll back a transaction whose coordinator died"
    )
    _add_journal_argument(recover, _JOURNAL_HELP + "; the update's journal (must exist)")
    _add_initial_source_argument(recover, "as for update")

    add_membership_parsers(commands)

    for name, what in (("pause", "pause every worker (no transaction)"), ("resume", "resume every worker")):
        p = _add_command(
            commands,
            name,
            _pause_or_resume,
            help=what,
            description=f"{what[0].upper()}"
            f"{what[1:]}; prints each worker's state after.  Exit 1 when a worker failed.",
        )
        if name == "pause":
            p.add_argument(
                "--mode", choices=PAUSE_MODES, default="keep", help="how workers pause their requests"
            )
        else:
            p.add_argument(
                "--allow-mislabelled",
                action="store_true",
                help="also resume a worker whose label does not describe its weights (refused by "
                "default: version_not_current, it stays paused)",
            )


def _version(text: str) -> Any:
    from weightsync.edge.arguments import version_argument

    return version_argument("--version", text)


def _describe(result: Any) -> list[str]:
    done = "" if result.phase == "committed" else " (committed)" if result.committed else " (not committed)"
    lines = [f"transaction {result.txn}: {result.phase}{done}, version {json.dumps(result.version)}"]
    message = result.message or ""
    if message and not any(message.startswith(f"{w.url}: ") for w in result.workers):
        lines.append(f"  {message}")  # what the phase does not say (a recovery, a delta already taken)
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
    from weightsync.core.errors import InvalidRequest, WeightSyncError

    try:
        _absolute("--from-disk", args.from_disk)
        _absolute("--from-delta", args.from_delta)
        initial = _absolute("--initial-source", args.initial_source)
        coordinator = _coordinator(args, _journal_path(args), initial)
        if args.version is None and args.from_disk is not None:
            raise InvalidRequest("--from-disk needs --version", code="invalid_value")
        version = None if args.version is None else _version(args.version)
        run = coordinator.update_sync if args.from_disk is not None else coordinator.update_from_delta_sync
        options = {
            "policy": args.policy, "min_workers": args.min_workers, "max_unavailable": args.max_unavailable,
            "pause_mode": args.pause_mode, "deadline_s": args.deadline_s,
        }  # fmt: skip
        if args.relabel and args.from_disk is not None:
            options["relabel"] = True
        elif args.relabel:
            raise InvalidRequest(
                "--relabel goes with --from-disk (a delta names its own target)", code="invalid_value"
            )
        result = _shielded(lambda: run(args.from_disk or args.from_delta, version, **options))
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


def _status(args: argparse.Namespace) -> int:
    return _statuses(args, lambda coordinator: coordinator.status(), with_journal=True)


def _members(path: str | None) -> list[str]:
    """The workers the journal at ``path`` lists as members, for a status without ``--worker``.
    Raises ``InvalidRequest`` when there is no journal to read them from, or no member in it."""
    from weightsync.core.errors import InvalidRequest
    from weightsync.fleet.journal import Journal

    if path is None:
        raise InvalidRequest(
            "name the workers (--worker URL, repeated) or the fleet's journal (--journal J, or "
            f"${JOURNAL_ENV}) to list its members",
            code="missing_field",
        )
    with Journal(path, must_exist=True) as journal:
        members = sorted(journal.members())
    if not members:
        raise InvalidRequest(
            f"the journal {path} lists no member yet: name the workers with --worker URL",
            code="missing_field",
        )
    return members


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
        if not args.worker:
            args.worker = _members(path)
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
