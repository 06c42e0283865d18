"""The coordinator's journal: every step of every transaction, on disk before it acts.

SQLite from the standard library, in WAL mode with ``synchronous=FULL``: a row that a
method returned from is on disk.  The file says which schema it holds
(``PRAGMA user_version``); anything else — another program's database, an older journal,
a damaged file — is refused with ``InvalidRequest`` (``bad_journal``) before a worker is
touched.  Tables:

* ``txn``: one row per transaction: its phase, its :class:`~.records.TransactionSpec` and
  its :class:`~._decide.Progress` (versioned JSON);
* ``event``: the append-only history (phase changes and per-worker steps);
* ``committed``: per worker, the :class:`~.records.CommittedRow` of its last fleet commit
  (source, version, epoch and digest: what the next rollback restores), written in the
  same write as the phase (or by :meth:`Journal.adopt`, transaction 0);
* ``meta``: the highest epoch this journal ever issued (``issued_epoch``);
* ``lease``: the one coordinator allowed to write (holder, expiry).
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Final

from weightsync.core.errors import IllegalState, InvalidRequest
from weightsync.core.validation import strict_loads
from weightsync.fleet._decide import Progress
from weightsync.fleet.records import SCHEMA, CommittedRow, TransactionSpec, bad_journal

MAX_EPOCH: Final = 2**63 - 1

_TABLES: Final = {"txn", "event", "committed", "meta", "lease"}
_SCHEMA_SQL: Final = """
CREATE TABLE txn (
    id INTEGER PRIMARY KEY AUTOINCREMENT, created REAL NOT NULL, phase TEXT NOT NULL,
    spec TEXT NOT NULL, progress TEXT NOT NULL
);
CREATE TABLE event (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, txn INTEGER NOT NULL, at REAL NOT NULL,
    phase TEXT NOT NULL, worker TEXT, what TEXT NOT NULL, detail TEXT
);
CREATE TABLE committed (
    worker TEXT PRIMARY KEY, source TEXT, version TEXT NOT NULL, epoch INTEGER NOT NULL,
    digest TEXT, txn INTEGER NOT NULL
);
CREATE TABLE meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE lease (one INTEGER PRIMARY KEY CHECK (one = 1), holder TEXT NOT NULL,
    host TEXT NOT NULL, pid INTEGER NOT NULL, token TEXT NOT NULL, expires REAL NOT NULL);
"""


class Journal:
    """A journal file (``":memory:"`` keeps it in memory: no recovery possible), every table
    and row of it validated when it is opened (:meth:`check`) and again on each read.

    ``synchronous="FULL"`` (default) survives power loss; ``"NORMAL"`` survives a killed
    coordinator (WAL) but may lose the last steps on an OS crash.  Raises ``InvalidRequest``
    (``bad_journal``) when ``path`` is not a usable journal of this schema (another
    database, damaged, a directory or device), or, with ``must_exist``, not an existing file.
    """

    def __init__(
        self, path: str | Path = ":memory:", *, synchronous: str = "FULL", must_exist: bool = False
    ) -> None:
        if synchronous not in ("FULL", "NORMAL"):
            raise ValueError(f"synchronous must be FULL or NORMAL, got {synchronous!r}")
        self.path = str(path)
        if must_exist and (self.path == ":memory:" or not os.path.isfile(self.path)):
            raise InvalidRequest(
                f"{self.path!r} is not an existing journal file", code="bad_journal", path=self.path
            )
        db: sqlite3.Connection | None = None
        try:
            # SQLite would open a device or FIFO and create side files next to it: only a
            # regular file, or a new one, is a journal.
            if self.path != ":memory:" and os.path.exists(self.path) and not os.path.isfile(self.path):
                raise OSError(f"{self.path!r} is not a regular file")
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=10)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(f"PRAGMA synchronous={synchronous}")
            db.execute("BEGIN IMMEDIATE")
            tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            tables.discard("sqlite_sequence")
            version = db.execute("PRAGMA user_version").fetchone()[0]
            db.execute("COMMIT")
            if not tables and version == 0:
                sql = _SCHEMA_SQL.replace("CREATE TABLE", "CREATE TABLE IF NOT EXISTS")
                db.executescript(f"BEGIN IMMEDIATE; {sql} PRAGMA user_version = {SCHEMA}; COMMIT;")
            else:
                if version != SCHEMA or tables != _TABLES:
                    raise bad_journal(
                        f"{self.path!r} is not a weightsync fleet journal of schema {SCHEMA} "
                        f"(schema {version}, tables {sorted(tables)})"
                    )
        except (sqlite3.Error, OSError) as exc:
            if db is not None:
                db.close()
            raise InvalidRequest(
                f"{self.path!r} is not a usable journal: {exc}", code="bad_journal", path=self.path
            ) from None
        except InvalidRequest:
            if db is not None:
                db.close()
            raise
        self._db = db
        self._token = uuid.uuid4().hex
        try:  # a journal is read whole before anyone acts on it: damage is found here
            self.check()
        except InvalidRequest:
            db.close()
            raise

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ writing

    def _write(self, statements: Iterable[tuple[str, tuple[Any, ...]]]) -> int:
        cur = self._db.cursor()
        try:
            cur.execute("BEGIN IMMEDIATE")
            last = 0
            for sql, params in statements:
                cur.execute(sql, params)
                last = int(cur.lastrowid or last)
            cur.execute("COMMIT")
        except sqlite3.Error as exc:
            if self._db.in_transaction:
                cur.execute("ROLLBACK")
            raise bad_journal(f"{self.path!r}: the journal refused a write: {exc}") from None
        except BaseException:
            if self._db.in_transaction:
                cur.execute("ROLLBACK")
            raise
        return last

    def begin(self, spec: TransactionSpec, progress: Progress) -> int:
        """Open a transaction at ``progress``; return its id."""
        now = time.time()
        cur = self._db.cursor()
        cur.execute("BEGIN IMMEDIATE")
        try:
            cur.execute(
                "INSERT INTO txn (created, phase, spec, progress) VALUES (?, ?, ?, ?)",
                (now, progress.phase, json.dumps(spec.to_json()), json.dumps(progress.to_json())),
            )
            txn = int(cur.lastrowid or 0)
            cur.execute(
                "INSERT INTO event (txn, at, phase, worker, what) VALUES (?, ?, ?, NULL, 'begin')",
                (txn, now, progress.phase),
            )
            cur.execute("COMMIT")
        except BaseException:
            cur.execute("ROLLBACK")
            raise
        return txn

    def record(
        self,
        txn: int,
        spec: TransactionSpec,
        progress: Progress,
        committed: Iterable[tuple[str, CommittedRow]] = (),
    ) -> None:
        """Move ``txn`` to ``progress`` with ``spec``, and record ``committed`` workers, in
        one durable write (the commit point is one write, never half of one)."""
        statements: list[tuple[str, tuple[Any, ...]]] = [
            (
                "UPDATE txn SET phase = ?, spec = ?, progress = ? WHERE id = ?",
                (progress.phase, json.dumps(spec.to_json()), json.dumps(progress.to_json()), txn),
            ),
            (
                "INSERT INTO event (txn, at, phase, worker, what) VALUES (?, ?, ?, NULL, ?)",
                (txn, time.time(), progress.phase, progress.trigger),
            ),
        ]
        statements += [_committed(worker, row, txn) for worker, row in committed]
        self._write(statements)

    def adopt(self, committed: Iterable[tuple[str, CommittedRow]]) -> None:
        """Record ``committed`` as those workers' last commits outside any transaction
        (``weightsync fleet adopt``; their ``txn`` is 0), in one durable write."""
        self._write([_committed(worker, row, 0) for worker, row in committed])

    def note(self, txn: int, phase: str, worker: str | None, what: str, detail: Any = None) -> None:
        """Append a step to the history."""
        self._write(
            [
                (
                    "INSERT INTO event (txn, at, phase, worker, what, detail) VALUES (?, ?, ?, ?, ?, ?)",
                    (txn, time.time(), phase, worker, what, json.dumps(detail)),
                )
            ]
        )

    def issue_epoch(self, floor: int = 0) -> int:
        """Issue the next fleet epoch (one more than every epoch issued before and ``floor``).

        Raises ``IllegalState`` (``epoch_exhausted``) when no epoch is left below 2^63.
        """
        cur = self._db.cursor()
        cur.execute("BEGIN IMMEDIATE")
        try:
            row = cur.execute("SELECT value FROM meta WHERE key = 'issued_epoch'").fetchone()
            if row is not None and type(row[0]) is not int:
                raise bad_journal(f"the journal's issued epoch is not an integer: {str(row[0])[:60]!r}")
            epoch = max(int(row[0]) if row else 0, floor) + 1
            if epoch > MAX_EPOCH:
                raise IllegalState("this journal has issued every epoch there is", code="epoch_exhausted")
            cur.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('issued_epoch', ?)", (epoch,))
            cur.execute("COMMIT")
        except BaseException:
            cur.execute("ROLLBACK")
            raise
        return epoch

    # ------------------------------------------------------------------ the lease

    def acquire(self, ttl_s: float = 30.0) -> None:
        """Become the journal's one writer for ``ttl_s`` (renew with :meth:`renew`).

        Raises ``IllegalState`` (``journal_locked``, 409) naming the holder when another
        coordinator holds a live lease.  A lease whose holder died on this host, or whose
        time ran out, is taken over.
        """
        host, pid, now = socket.gethostname(), os.getpid(), time.time()
        cur = self._db.cursor()
        cur.execute("BEGIN IMMEDIATE")
        try:
            row = cur.execute("SELECT holder, host, pid, token, expires FROM lease").fetchone()
            if row is not None:
                _lease_row(row)
            if row is not None and row[3] != self._token and row[4] > now and _alive(row[1], row[2]):
                raise IllegalState(
                    f"{self.path!r} is held by another coordinator ({row[0]}, lease for "
                    f"{row[4] - now:.0f} s more): one journal has one writer",
                    code="journal_locked",
                    holder=row[0],
                )
            cur.execute(
                "INSERT OR REPLACE INTO lease (one, holder, host, pid, token, expires) "
                "VALUES (1, ?, ?, ?, ?, ?)",
                (f"pid {pid} on {host}", host, pid, self._token, now + ttl_s),
            )
            cur.execute("COMMIT")
        except BaseException:
            cur.execute("ROLLBACK")
            raise

    def renew(self, ttl_s: float = 30.0) -> None:
        self._write([("UPDATE lease SET expires = ? WHERE token = ?", (time.time() + ttl_s, self._token))])

    def release(self) -> None:
        self._write([("DELETE FROM lease WHERE token = ?", (self._token,))])

    # ------------------------------------------------------------------ reading

    def _rows(self, sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
        """Every row of a read; a file damaged under it is ``bad_journal``, never a traceback."""
        try:
            return self._db.execute(sql, params).fetchall()
        except sqlite3.Error as exc:
            raise bad_journal(f"{self.path!r}: the journal could not be read: {exc}") from None

    def committed(self, worker: str) -> CommittedRow | None:
        """The last committed source of ``worker``, or ``None``.  Raises ``InvalidRequest``
        (``bad_journal``) when its row is damaged."""
        rows = self._rows(
            "SELECT worker, source, version, epoch, digest FROM committed WHERE worker = ?", (worker,)
        )
        return CommittedRow.from_columns(*rows[0]) if rows else None

    def members(self) -> dict[str, CommittedRow]:
        """Every worker's last commit (the fleet's membership), by URL."""
        rows = self._rows("SELECT worker, source, version, epoch, digest FROM committed ORDER BY worker")
        return {r[0]: CommittedRow.from_columns(*r) for r in rows}

    def committed_specs(self) -> list[TransactionSpec]:
        """The spec of every transaction that committed (``committed`` or ``fenced``), oldest first."""
        sql = "SELECT spec, progress FROM txn WHERE phase IN ('committed', 'fenced') ORDER BY id"
        return [_load(spec, progress)[0] for spec, progress in self._rows(sql)]

    def rolled_back_specs(self) -> list[TransactionSpec]:
        """The spec of every transaction that rolled back (``rolled_back`` or
        ``rollback_failed``: its rollback epoch re-committed what the workers held), oldest first."""
        sql = "SELECT spec, progress FROM txn WHERE phase IN ('rolled_back', 'rollback_failed') ORDER BY id"
        return [_load(spec, progress)[0] for spec, progress in self._rows(sql)]

    def check(self) -> None:
        """Read every table and validate every row (the ``committed`` rows, every
        transaction's spec and progress, the history, the issued epoch and the lease).

        Raises ``InvalidRequest`` (``bad_journal``) naming the first damage found."""
        for row in self._rows("SELECT worker, source, version, epoch, digest FROM committed"):
            CommittedRow.from_columns(*row)
        for txn, phase, spec, progress in self._rows("SELECT id, phase, spec, progress FROM txn"):
            if type(txn) is not int or not isinstance(phase, str):
                raise bad_journal(f"transaction row {str(txn)[:30]} has a damaged id or phase")
            loaded = _load(spec, progress)
            if loaded[1].phase != phase:
                raise bad_journal(
                    f"transaction {txn} says phase {phase[:60]!r} beside progress at {loaded[1].phase!r}"
                )
        for row in self._rows("SELECT txn, at, phase, worker, what FROM event"):
            if not _event_row(row):
                raise bad_journal(f"an event row of transaction {str(row[0])[:30]} is damaged")
        self.issued_epoch()
        for row in self._rows("SELECT holder, host, pid, token, expires FROM lease"):
            _lease_row(row)

    def issued_epoch(self) -> int:
        """The highest epoch this journal ever issued (0 before any)."""
        rows = self._rows("SELECT value FROM meta WHERE key = 'issued_epoch'")
        if rows and (type(rows[0][0]) is not int or not 0 <= rows[0][0] <= MAX_EPOCH):
            raise bad_journal(f"the journal's issued epoch is not an integer: {str(rows[0][0])[:60]!r}")
        return int(rows[0][0]) if rows else 0

    def transaction(self, txn: int) -> tuple[TransactionSpec, Progress]:
        rows = self._rows("SELECT spec, progress FROM txn WHERE id = ?", (txn,))
        if not rows:
            raise KeyError(txn)
        return _load(rows[0][0], rows[0][1])

    def unfinished(self) -> list[tuple[int, TransactionSpec, Progress]]:
        """Every transaction that has not reached a terminal phase, oldest first."""
        from weightsync.fleet._state import TERMINAL

        out = []
        for txn, phase, spec, progress in self._rows("SELECT id, phase, spec, progress FROM txn ORDER BY id"):
            if not isinstance(phase, str) or type(txn) is not int:
                raise bad_journal(f"transaction row {str(txn)[:30]} has a damaged id or phase")
            if phase not in TERMINAL:
                out.append((txn, *_load(spec, progress)))
        return out

    def events(self, txn: int) -> list[tuple[str, str | None, str]]:
        """``(phase, worker, what)`` of every step of ``txn``, in order."""
        rows = self._rows("SELECT txn, at, phase, worker, what FROM event WHERE txn = ? ORDER BY seq", (txn,))
        if not all(_event_row(r) for r in rows):
            raise bad_journal(f"an event row of transaction {txn} is damaged")
        return [(r[2], r[3], r[4]) for r in rows]


def _committed(worker: str, row: CommittedRow, txn: int) -> tuple[str, tuple[Any, ...]]:
    return (
        "INSERT OR REPLACE INTO committed (worker, source, version, epoch, digest, txn) VALUES (?, ?, ?, ?, ?, ?)",
        (worker, row.source, json.dumps(row.version), row.epoch, row.digest, txn),
    )


def _load(spec: Any, progress: Any) -> tuple[TransactionSpec, Progress]:
    try:
        return TransactionSpec.from_json(strict_loads(spec)), Progress.from_json(strict_loads(progress))
    except (ValueError, TypeError, RecursionError) as exc:
        raise bad_journal(f"a transaction row is not JSON: {str(exc)[:200]}") from None


def _event_row(row: Any) -> bool:
    txn, at, phase, worker, what = row
    return (
        type(txn) is int
        and type(at) in (int, float)
        and isinstance(phase, str)
        and (worker is None or isinstance(worker, str))
        and isinstance(what, str)
    )


def _lease_row(row: Any) -> None:
    holder, host, pid, token, expires = row
    if not (
        isinstance(holder, str) and isinstance(host, str) and type(pid) is int
        and isinstance(token, str) and type(expires) in (int, float)
    ):  # fmt: skip
        raise bad_journal("the journal's lease row is damaged")


def _alive(host: str, pid: int) -> bool:
    """Whether a lease's holder may still be running (only a pid on this host can be checked)."""
    if host != socket.gethostname():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
