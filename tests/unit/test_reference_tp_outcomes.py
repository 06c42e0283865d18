"""How a tensor-parallel worker joins its ranks' answers to a plan: the update tears when any
rank wrote, including a rank that succeeded (its shards are in place) beside one that failed
before writing anything."""

from __future__ import annotations

import pytest

from weightsync.core.errors import EngineUnavailable, LoadFailed
from weightsync.engines.reference.tp_plan import joined_outcome

pytestmark = pytest.mark.unit


def refused(wrote: bool) -> dict:
    cause = EngineUnavailable("the helper died", code="peer_failed")
    err = LoadFailed("the helper died", wrote=wrote, cause=None if wrote else cause, code="peer_failed")
    return {"ok": False, "error": err.to_wire(), "broken": True}


def test_every_rank_succeeding_is_no_failure() -> None:
    assert joined_outcome([{"ok": True, "bytes": 10}, {"ok": True, "bytes": 10}], "s") is None


def test_a_rank_that_succeeded_beside_one_that_wrote_nothing_tears_the_worker() -> None:
    failure = joined_outcome([{"ok": True, "bytes": 10}, refused(wrote=False)], "s")
    assert failure is not None and failure.wrote and failure.code == "peer_failed"


def test_no_rank_having_written_is_a_clean_failure_with_the_ranks_cause() -> None:
    failure = joined_outcome([{"ok": True, "bytes": 0}, refused(wrote=False)], "s")
    assert failure is not None and not failure.wrote
    assert failure.cause is not None and failure.cause.code == "peer_failed"
    assert failure.reply_status == 503


def test_a_failed_rank_that_wrote_names_the_code() -> None:
    failure = joined_outcome([refused(wrote=False), refused(wrote=True)], "s")
    assert failure is not None and failure.wrote and "rank 1" in failure.message
