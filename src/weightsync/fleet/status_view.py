"""The ``weightsync fleet status`` view: what each worker reports, beside what the journal
committed for it.

Per worker: its version, epoch, digest, whether its label describes its weights
(``version_current``), its state and in-flight update, its routing taints (Dynamo's
``model_taints``: a router routes nothing to it), its last error — and with a journal
the committed version, epoch and digest, and whether the worker holds exactly that
(``holds_commit``).  Pure functions of the replies and the rows: no I/O here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from weightsync.fleet.events import short_digest
from weightsync.fleet.records import CommittedRow
from weightsync.fleet.result import WorkerStatus

__all__ = ["status_json", "status_lines"]

Committed = Mapping[str, CommittedRow | None] | None

_HEAD = ["worker", "version", "epoch", "digest", "current", "state", "in-flight", "taints", "last error"]
_JOURNAL_HEAD = ["committed version", "epoch", "digest", "holds commit"]


def holds_commit(status: WorkerStatus, row: CommittedRow | None) -> bool | None:
    """Whether the worker reports exactly its committed (version, epoch, digest), with a
    label that describes its weights; ``None`` when it did not answer or has no commit."""
    if status.reply is None or row is None:
        return None
    return (
        status.get("version_declared") is True
        and status.get("version_current") is True
        and (status.get("version"), status.get("epoch"), status.get("digest"))
        == (row.version, row.epoch, row.digest)
    )


def status_json(statuses: Sequence[WorkerStatus], committed: Committed = None) -> dict[str, Any]:
    """``{"workers": [...]}``: each worker's :meth:`WorkerStatus.to_json` with
    ``version_current``, and with a journal ``committed`` (its row, or ``None``) and
    ``holds_commit``."""
    workers = []
    for s in statuses:
        out = s.to_json()
        out["version_current"] = s.get("version_current")
        out["taints"] = s.get("taints")
        if committed is not None:
            row = committed.get(s.url)
            out["committed"] = (
                None
                if row is None
                else {
                    "version": row.version,
                    "epoch": row.epoch,
                    "digest": row.digest,
                    "source": row.source,
                }
            )
            out["holds_commit"] = holds_commit(s, row)
        workers.append(out)
    return {"workers": workers}


def _yes(value: Any) -> str:
    return "-" if value is None else "yes" if value else "no"


def _cells(status: WorkerStatus, committed: Committed) -> list[str]:
    if status.reply is None:
        cells = [status.url, "-", "-", "-", "-", "-", "-", "-", status.last_error or "-"]
    else:
        state = "torn" if status.get("torn") else "paused" if status.get("paused") else "running"
        cells = [
            status.url,
            json.dumps(status.get("version")) if status.get("version_declared") else "undeclared",
            str(status.get("epoch")) if status.get("epoch") is not None else "-",
            short_digest(status.get("digest")),
            _yes(status.get("version_current")),
            state,
            "yes" if status.get("update_in_flight") else "no",
            ",".join(map(str, status.get("taints") or [])) or "-",
            status.last_error or "-",
        ]
    if committed is not None:
        row = committed.get(status.url)
        if row is None:
            cells += ["-", "-", "-", "-"]
        else:
            cells += [json.dumps(row.version), str(row.epoch), short_digest(row.digest)]
            cells.append(_yes(holds_commit(status, row)))
    return cells


def status_lines(statuses: Sequence[WorkerStatus], committed: Committed = None) -> list[str]:
    """The table, one line per worker under a header; the journal's columns with ``committed``."""
    rows = [_HEAD + (_JOURNAL_HEAD if committed is not None else [])]
    rows += [_cells(s, committed) for s in statuses]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
