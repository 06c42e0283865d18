"""Catch-up's route: the cheapest chain of checked hops from the digest a worker holds to the
one wanted (a delta costs 1, a full checkpoint FULL_COST), the delta record's journal form, and
the expiry every declaration of a catch-up carries."""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

import pytest

from weightsync.core.errors import IllegalState, InvalidRequest
from weightsync.fleet.calls import Call
from weightsync.fleet.catchup import FULL_COST, Known, catch_up, route
from weightsync.fleet.clocks import Expires, Expiry
from weightsync.fleet.records import CommittedRow, DeltaRecord, TransactionSpec, WorkerRecord

W = "http://w:1"


def delta(base: str, target: str) -> DeltaRecord:
    return DeltaRecord(f"v-{base}", base, f"v-{target}", target, {W: f"/d/{base}-{target}"})


def test_a_worker_on_the_commit_needs_no_hop() -> None:
    assert route(Known((delta("a", "b"),)), "b", "b", W) == ()


def test_a_chain_of_deltas_from_the_held_digest_is_followed_in_order() -> None:
    known = Known((delta("b", "c"), delta("a", "b")), {"a": "/full/a"})
    hops = route(known, "a", "c", W)
    assert [(h.kind, h.path, h.digest, h.base) for h in hops] == [
        ("delta", "/d/a-b", "b", "v-a"),
        ("delta", "/d/b-c", "c", "v-b"),
    ]


def test_a_chain_longer_than_a_full_load_loses_to_the_checkpoint() -> None:
    digests = [f"d{i}" for i in range(FULL_COST + 2)]
    chain = tuple(delta(x, y) for x, y in itertools.pairwise(digests))
    known = Known(chain, {digests[-1]: "/full/last"})
    assert [h.kind for h in route(known, digests[0], digests[-1], W)] == ["disk"]
    assert [h.kind for h in route(known, digests[-3], digests[-1], W)] == ["delta", "delta"]


def test_a_torn_worker_loads_a_checkpoint_then_follows_deltas() -> None:
    known = Known((delta("a", "b"),), {"a": "/full/a"})
    assert [(h.kind, h.digest) for h in route(known, None, "b", W)] == [("disk", "a"), ("delta", "b")]


def test_no_known_way_is_refused_naming_the_worker() -> None:
    with pytest.raises(IllegalState) as info:
        route(Known((delta("a", "b"),)), "x", "c", W)
    assert info.value.code == "no_catch_up_route" and W in info.value.message


def test_a_worker_without_its_own_path_reads_the_one_most_workers_read() -> None:
    record = DeltaRecord("v0", "a", "v1", "b", {"http://1": "/s/d", "http://2": "/s/d", "http://3": "/x/d"})
    assert record.path_for("http://4") == "/s/d" and record.path_for("http://3") == "/x/d"


def test_a_delta_spec_round_trips_through_its_journal_form_and_needs_its_delta() -> None:
    spec = TransactionSpec("v1", [WorkerRecord(W)], kind="delta", delta=delta("a", "b"))
    assert TransactionSpec.from_json(spec.to_json()) == spec
    with pytest.raises(InvalidRequest):
        TransactionSpec("v1", [WorkerRecord(W)], kind="delta")
    with pytest.raises(InvalidRequest):
        TransactionSpec("v1", [WorkerRecord(W)], kind="disk", delta=delta("a", "b"))
    broken = spec.to_json()
    broken["delta"]["paths"] = {}
    with pytest.raises(InvalidRequest) as info:
        TransactionSpec.from_json(broken)
    assert info.value.code == "bad_journal"


def test_every_declaration_of_a_catch_up_asks_its_expiry_first_and_sends_it_in_the_workers_clock() -> None:
    """The relabel to a delta's base and the committed declaration both carry ``not_after``:
    the expiry the driver answered (:class:`Expires`: the coordinator's deadline in the
    worker's clock), never the coordinator's deadline as it is."""
    known = Known((delta("a", "b"),))
    row = CommittedRow(None, "v-b", 3, "b")
    script = catch_up(W, known, row, 1000.0)
    now = {"version": "other", "version_declared": True, "epoch": 1, "digest": "a", "torn": False}
    on_b = {"version": "v-b", "version_declared": True, "epoch": 3, "digest": "b", "torn": False}
    proof = {"digest": "a", "recorded_digest": "a", "match": True}  # verify_weights: it serves "a"
    # state, verify, pause, relabel, delta, state, declaration, read back, resume, state
    replies = iter([now, proof, {}, {}, {"digest": "b"}, {**now, "digest": "b"}, {}, on_b, {}, on_b])
    steps: list[Any] = []
    answer: Any = None
    with contextlib.suppress(StopIteration):
        while True:
            step = script.send(answer)
            steps.append(step)
            if isinstance(step, Expires):
                answer = Expiry(step.deadline - 60.0, step.deadline + 0.25)
            else:
                answer = next(replies) if isinstance(step, Call) else None
    declarations = [s for s in steps if isinstance(s, Call) and s.route == "set_weight_version"]
    assert [d.body for d in declarations] == [
        {"weight_version": "v-a", "expected_digest": "a", "not_after": 940.0},  # the base's label
        {"weight_version": "v-b", "epoch": 3, "expected_digest": "b", "not_after": 940.0},
    ]
    assert all(steps[steps.index(d) - 1] == Expires(W, 1000.0) for d in declarations)
