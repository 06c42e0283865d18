"""The coordinator's journal: every phase of every transaction, on disk before it acts.

SQLite from the standard library, in WAL mode with ``synchronous=FULL``: a row that
``record`` returned from is on disk.  Three tables:

* ``txn``: one row per transaction: its current phase and its *spec* (JSON: version,
  policy, per-worker source path, expected digest, epoch, and each worker's previous
  committed source, version, epoch and digest, which is what a rollback restores);
* ``event``: the append-only history (phase changes and per-worker steps);
* ``committed``: per worker, the source, version, epoch and digest of the last fleet
  commit, so the next transaction knows where to roll back to.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from pathlib import Path
from typing import Any

from weightsync.core.errors import InvalidRequest

_SCHEMA = """
CREATE TABLE IF NOT EXISTS txn (
    id INTEGER PRIMARY KEY AUTOINCREMENT, created REAL NOT NULL, phase TEXT NOT NULL, spec TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS event (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, txn INTEGER NOT NULL, at REAL NOT NULL,
    phase TEXT NOT NULL, worker TEXT, what TEXT NOT NULL, detail TEXT
);
CREATE TABLE IF NOT EXISTS committed (
    worker TEXT PRIMARY KEY, path TEXT, version TEXT NOT NULL, epoch INTEGER NOT NULL,
    digest TEXT, txn INTEGER NOT NULL
);
"""


class Journal:
    """A journal file (``":memory:"`` keeps it in memory: no recovery possible).

    ``synchronous="FULL"`` (default) survives power loss; ``"NORMAL"`` survives a killed
    coordinator process (WAL) but may lose the last steps on an OS crash.  Raises
    ``InvalidRequest`` (``bad_journal``) when ``path`` cannot be opened as a writable SQLite
    journal (not a database, a directory, a device), or, with ``must_exist``, when it is not
    an existing file (recovery reads a journal: it never creates an empty one).
    """

    def __init__(
        self, path: str | Path = ":memory:", *, synchronous: str = "FULL", must_exist: bool = False
    ) -> None:
        if synchronous not in ("FULL", "NORMAL"):
            raise ValueError(f"synchronous must be FULL or NORMAL, got {synchronous!r}")
        self.path = str(path)
        db: sqlite3.Connection | None = None
        if must_exist and (self.path == ":memory:" or not os.path.isfile(self.path)):
            raise InvalidRequest(
                f"{self.path!r} is not an existing journal file", code="bad_journal", path=self.path
            )
        try:
            # SQLite would open a device or FIFO and create its side files next to it
            # (``/dev/null-journal``): only a regular file, or a new one, is a journal.
            if self.path != ":memory:" and os.path.exists(self.path) and not os.path.isfile(self.path):
                raise OSError(f"{self.path!r} is not a regular file")
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(f"PRAGMA synchronous={synchronous}")
            db.executescript(_SCHEMA)
            # A journal that cannot take a write lock is refused now, before any worker is touched.
            db.execute("BEGIN IMMEDIATE")
            db.execute("COMMIT")
        except (sqlite3.Error, OSError) as exc:
            if db is not None:
                db.close()
            raise InvalidRequest(
                f"{self.path!r} is not a usable journal: {exc}", code="bad_journal", path=self.path
            ) from None
        self._db = db

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write(self, statements: list[tuple[str, tuple[Any, ...]]]) -> int | None:
        cur = self._db.cursor()
        cur.execute("BEGIN IMMEDIATE")
        try:
            for sql, params in statements:
                cur.execute(sql, params)
            last = cur.lastrowid
            cur.execute("COMMIT")
        except BaseException:
            cur.execute("ROLLBACK")
            raise
        return last

    def begin(self, phase: str, spec: dict[str, Any]) -> int:
        """Open a transaction in ``phase``; return its id."""
        now = time.time()
        cur = self._db.cursor()
        cur.execute("BEGIN IMMEDIATE")
        try:
            cur.execute(
                "INSERT INTO txn (created, phase, spec) VALUES (?, ?, ?)", (now, phase, json.dumps(spec))
            )
            txn = int(cur.lastrowid or 0)
            cur.execute(
                "INSERT INTO event (txn, at, phase, worker, what) VALUES (?, ?, ?, NULL, 'begin')",
                (txn, now, phase),
            )
            cur.execute("COMMIT")
        except BaseException:
            cur.execute("ROLLBACK")
            raise
        return txn

    def record(self, txn: int, phase: str, spec: dict[str, Any] | None = None) -> None:
        """Move ``txn`` to ``phase`` (and replace its spec when given), durably."""
        statements: list[tuple[str, tuple[Any, ...]]] = [
            ("UPDATE txn SET phase = ? WHERE id = ?", (phase, txn)),
            (
                "INSERT INTO event (txn, at, phase, worker, what) VALUES (?, ?, ?, NULL, 'phase')",
                (txn, time.time(), phase),
            ),
        ]
        if spec is not None:
            statements.append(("UPDATE txn SET spec = ? WHERE id = ?", (json.dumps(spec), txn)))
        self._write(statements)

    def note(self, txn: int, phase: str, worker: str, what: str, detail: Any = None) -> None:
        """Append a per-worker step to the history."""
        self._write(
            [
                (
                    "INSERT INTO event (txn, at, phase, worker, what, detail) VALUES (?, ?, ?, ?, ?, ?)",
                    (txn, time.time(), phase, worker, what, json.dumps(detail)),
                )
            ]
        )

    def set_committed(
        self, txn: int, worker: str, path: str | None, version: Any, epoch: int, digest: str | None
    ) -> None:
        """Remember ``worker``'s committed source (what the next rollback goes back to)."""
        self._write(
            [
                (
                    "INSERT OR REPLACE INTO committed (worker, path, version, epoch, digest, txn) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    (worker, path, json.dumps(version), epoch, digest, txn),
                )
            ]
        )

    def committed(self, worker: str) -> dict[str, Any] | None:
        """The last committed source of ``worker``: ``path``, ``version``, ``epoch``, ``digest``."""
        row = self._db.execute(
            "SELECT path, version, epoch, digest FROM committed WHERE worker = ?", (worker,)
        ).fetchone()
        if row is None:
            return None
        return {"path": row[0], "version": json.loads(row[1]), "epoch": row[2], "digest": row[3]}

    def last_epoch(self) -> int:
        """The highest epoch ever committed (0 before any commit)."""
        row = self._db.execute("SELECT MAX(epoch) FROM committed").fetchone()
        return int(row[0] or 0)

    def transaction(self, txn: int) -> tuple[str, dict[str, Any]]:
        """``(phase, spec)`` of ``txn``."""
        row = self._db.execute("SELECT phase, spec FROM txn WHERE id = ?", (txn,)).fetchone()
        if row is None:
            raise KeyError(txn)
        return str(row[0]), json.loads(row[1])

    def unfinished(self, terminal: frozenset[str]) -> tuple[int, str, dict[str, Any]] | None:
        """The newest transaction whose phase is not in ``terminal``, or ``None``."""
        for txn, phase, spec in self._db.execute("SELECT id, phase, spec FROM txn ORDER BY id DESC"):
            if phase not in terminal:
                return int(txn), str(phase), json.loads(spec)
            return None
        return None

    def events(self, txn: int) -> list[tuple[str, str | None, str]]:
        """``(phase, worker, what)`` of every step of ``txn``, in order."""
        return [
            (str(p), w, str(x))
            for p, w, x in self._db.execute(
                "SELECT phase, worker, what FROM event WHERE txn = ? ORDER BY seq", (txn,)
            )
        ]
