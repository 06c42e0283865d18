"""``weightsync fleet adopt | add``: who the journal counts as the fleet's members.

``adopt`` takes the state a running fleet holds into the journal; ``add`` brings workers
(new ones, or members that fell behind) onto the fleet's committed version by the journal's
chain of deltas or a full checkpoint, proves it by digest, resumes them and records them as
members (:mod:`weightsync.fleet.admission`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from weightsync.fleet.cli_shell import (
    ARGUMENT_CODES,
    JOURNAL_HELP,
    OUT,
    absolute,
    add_command,
    add_journal_argument,
    coordinator,
    journal_path,
    shielded,
)
from weightsync.fleet.result import PAUSE_MODES

if TYPE_CHECKING:
    from weightsync.core.errors import WeightSyncError
    from weightsync.fleet.result import Brought


def add_membership_parsers(commands: Any) -> None:
    """Add ``adopt`` and ``add`` to the ``fleet`` subcommands."""
    adopt = add_command(
        commands,
        "adopt",
        _adopt,
        help="take the state the workers hold into the journal (the way out of untrusted_epoch)",
        description="Check that every worker answers, none is torn or mid-update, each one's label "
        "describes its weights and all hold one version and digest; then issue an epoch above "
        "every worker's, declare it on every worker (read back) and record them as committed.  "
        "Nothing is declared when a check fails.  Exit 0 when adopted, 1 when a check failed or "
        "a worker did not take it, 2 for bad arguments or a bad or locked journal.",
    )
    add_journal_argument(adopt, JOURNAL_HELP + "; created when missing")
    adopt.add_argument(
        "--source",
        metavar="PATH",
        help="checkpoint the workers hold (absolute, as workers see it): checked on every worker, "
        "recorded as what a rollback restores",
    )

    add = add_command(
        commands,
        "add",
        _add,
        help="join workers at the fleet's committed version (new ones, or members that fell behind)",
        description="Bring each --worker onto the version the journal committed last: pause it, take "
        "it along the journal's chain of deltas (each checked against its base) or load a full "
        "checkpoint the journal knows when that is cheaper or no chain reaches it, declare the "
        "committed version at the committed epoch guarded by its digest, read it back, resume it "
        "and record it as a member.  A worker that already holds the commit is only resumed.  Exit 0 "
        "when every worker was admitted, 1 when one could not be (it stays paused, unrecorded), 2 "
        "for bad arguments, a bad or locked journal, an unfinished transaction or nothing committed.",
    )
    add_journal_argument(add, JOURNAL_HELP + "; the fleet's journal (must exist)")
    add.add_argument(
        "--pause-mode", choices=PAUSE_MODES, default="keep", help="how a worker pauses its requests"
    )
    add.add_argument("--deadline-s", type=float, default=600.0, help="how long the catch-up may take")


def _adopt(args: argparse.Namespace) -> int:
    import asyncio

    from weightsync.core.errors import WeightSyncError
    from weightsync.fleet.adoption import adopt

    try:
        source = absolute("--source", args.source)
        fleet = coordinator(args, journal_path(args))
        done = asyncio.run(adopt(fleet, source))
    except WeightSyncError as exc:
        OUT.print(f"weightsync fleet adopt: {exc.code}: {exc.message}", err=True)
        return 2 if exc.code in ARGUMENT_CODES else 1
    _report(done, args.json, "adopted", lambda e: e.code)
    return 0 if done.ok else 1


def _add(args: argparse.Namespace) -> int:
    import asyncio

    from weightsync.core.errors import WeightSyncError
    from weightsync.fleet.admission import admit
    from weightsync.fleet.journal import Journal

    try:
        path = journal_path(args)
        assert path is not None
        fleet = coordinator(args, Journal(path, must_exist=True))
        done = shielded(lambda: asyncio.run(admit(fleet, args.pause_mode, args.deadline_s)))
    except WeightSyncError as exc:
        OUT.print(f"weightsync fleet add: {exc.code}: {exc.message}", err=True)
        return 2 if exc.code in ARGUMENT_CODES | {"nothing_committed"} else 1
    _report(done, args.json, "committed", lambda e: f"{e.code}: {e.message}", took="admitted")
    if OUT.lost:
        return 3
    return 0 if done.ok else 1


def _report(
    done: Brought, as_json: bool, what: str, error: Callable[[WeightSyncError], str], took: str | None = None
) -> None:
    """Print a membership command's result: its JSON, or the commit, each worker's outcome
    (``took`` when it took it, else ``error`` of its error) and the next step."""
    if as_json:
        OUT.print(json.dumps(done.to_json()))
        return
    OUT.print(f"{what} version {json.dumps(done.version)}, epoch {done.epoch}, digest {done.digest[:12]}")
    for w in done.workers:
        OUT.print(f"  {w.url}: {(took or what) if w.error is None else error(w.error)}")
    OUT.print(f"next: {done.next_step}")
