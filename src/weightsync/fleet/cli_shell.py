"""What every ``weightsync fleet`` command shares: its flags (the workers, the journal, the
initial source: ``weightsync router`` takes the same), the output that never ends a
transaction, the coordinator built from the arguments."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from weightsync.edge.arguments import add_api_key_argument, add_log_arguments, api_key_argument

if TYPE_CHECKING:
    from weightsync.fleet.coordinator import FleetCoordinator
    from weightsync.fleet.events import Event
    from weightsync.fleet.journal import Journal

JOURNAL_ENV = "WEIGHTSYNC_FLEET_JOURNAL"
JOURNAL_HELP = f"SQLite journal file (default: ${JOURNAL_ENV})"


def add_worker_argument(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    """Add ``--worker URL`` (repeated: one per worker; ``required`` unless the command can read
    the workers from the journal) to ``parser``."""
    parser.add_argument(
        "--worker",
        action="append",
        required=required,
        metavar="URL",
        help="worker base URL (repeat)" + ("" if required else "; default: the journal's members"),
    )


def add_journal_argument(parser: argparse.ArgumentParser, help: str) -> None:
    """Add ``--journal`` (the fleet's journal file; a fleet command reads it with
    :func:`journal_path`) to ``parser``."""
    parser.add_argument("--journal", help=help)


def add_initial_source_argument(parser: argparse.ArgumentParser, help: str) -> None:
    """Add ``--initial-source PATH`` (the checkpoint a rollback restores before the journal has
    a committed one; read with :func:`absolute` or as the router does) to ``parser``."""
    parser.add_argument("--initial-source", metavar="PATH", help=help)


def add_command(
    commands: Any,
    name: str,
    func: Callable[[argparse.Namespace], int],
    *,
    workers_required: bool = True,
    **texts: str,
) -> argparse.ArgumentParser:
    """Add the ``fleet`` subcommand ``name`` (``texts``: its ``help`` and ``description``),
    run by ``func``, with the flags every fleet command takes: the workers (``--worker`` may be
    left out when not ``workers_required``), their API key, ``--json`` and the log flags."""
    command: argparse.ArgumentParser = commands.add_parser(name, **texts)
    add_worker_argument(command, required=workers_required)
    add_api_key_argument(command, "workers' bearer token")
    command.add_argument("--json", action="store_true", help="print one JSON object last")
    add_log_arguments(command, "every step of a transaction as it happens")
    command.set_defaults(func=func)
    return command


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


def printer(args: argparse.Namespace) -> Any:
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


def coordinator(
    args: argparse.Namespace, journal: Journal | str | None, initial_source: str | None = None
) -> FleetCoordinator:
    from weightsync.fleet.coordinator import FleetCoordinator

    return FleetCoordinator(
        args.worker,
        journal=journal,
        api_key=api_key_argument("--api-key", args.api_key),
        on_event=printer(args),
        initial_source=initial_source,
    )


def journal_path(args: argparse.Namespace, required: bool = True) -> str | None:
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


def absolute(flag: str, path: str | None) -> str | None:
    from weightsync.core.errors import InvalidRequest

    if path is not None and not os.path.isabs(path):
        raise InvalidRequest(
            f"{flag} {path!r} is relative: workers resolve it in their own directory; give an absolute path",
            code="invalid_value",
        )
    return path


def shielded(work: Any) -> Any:
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


ARGUMENT_CODES = frozenset(
    {"invalid_value", "bad_journal", "journal_locked", "journal_required", "unfinished_transaction",
     "bad_worker_url", "duplicate_worker", "no_workers"}
)  # fmt: skip
