"""What each phase sends, as data: every script driven by hand, reply by reply, no HTTP.

Each test names the calls a phase makes (route and body) and what a reply or an error at
each point leads to; one test sends a script through the real fan-out and client to check
that a call's body is exactly what reaches the worker.
"""

from __future__ import annotations

import asyncio
import json
import time as time_module
from typing import Any

import httpx
import pytest

from weightsync.core.errors import EngineUnavailable, IllegalState, InvalidRequest, NotSupported
from weightsync.fleet import calls
from weightsync.fleet.calls import Call, InDoubt, Note, Repush, Rolled, Script
from weightsync.fleet.clocks import CLOCK_MARGIN_S, CLOCK_READ_S, Expires, Expiry, ReadClock
from weightsync.fleet.disk_channel import DiskChannel
from weightsync.fleet.fanout import Fanout
from weightsync.fleet.records import CommittedRow, Held, TransactionSpec, WorkerRecord

U = "http://a:80"
OLD, NEW = "0" * 16, "1" * 16
T = 1767225600.5
"""A deadline (unix seconds, the coordinator's clock)."""
BEHIND = -60.0
"""How far the worker's clock runs behind the coordinator's, as ``drive`` answers :class:`Expires`."""


def theirs(step: Expires) -> Expiry:
    """The expiry of a declaration to a worker whose clock runs :data:`BEHIND`, read exactly."""
    return Expiry(step.deadline + BEHIND, step.deadline + CLOCK_MARGIN_S)


def drive(script: Script[Any], *answers: Any) -> tuple[list[Any], Any]:
    """Play ``script``, answering each call (and re-push) with the next of ``answers`` — a
    reply, or an error thrown in where it asked — and each :class:`Expires` by :func:`theirs`.
    Returns every step it yielded and its value; raises what it raises."""
    queue, steps = list(answers), []
    answer: Any = None
    while True:
        try:
            step = script.throw(answer) if isinstance(answer, Exception) else script.send(answer)
        except StopIteration as stop:
            assert not queue, f"answers left over: {queue}"
            return steps, stop.value
        steps.append(step)
        answer = queue.pop(0) if isinstance(step, Call | Repush) else None
        answer = theirs(step) if isinstance(step, Expires) else answer


def routes(steps: list[Any]) -> list[str]:
    return [s.route for s in steps if isinstance(s, Call)]


def spec(previous: Held | None = None, source: str | None = "/ckpt/new", **kw: Any) -> TransactionSpec:
    kw.setdefault("epoch", 5)
    kw.setdefault("expected_digest", NEW)
    return TransactionSpec("v1", (WorkerRecord(U, source, previous),), pause_mode="wait", **kw)


def holding(version: Any, epoch: int | None, digest: str | None, **kw: Any) -> dict[str, Any]:
    return {
        "version": version,
        "version_declared": True,
        "epoch": epoch,
        "digest": digest,
        "torn": False,
        **kw,
    }


def test_a_call_names_an_admin_route_or_is_refused() -> None:
    assert Call(U, "get_weight_version").body == {}
    with pytest.raises(ValueError, match="admin route"):
        Call(U, "get_weight_versoin")


def test_prepare_reads_the_state_then_sends_the_channels_dry_run() -> None:
    channel = DiskChannel({U: "/ckpt/new"})
    before, dry = {"epoch": 3}, {"digest": NEW}
    steps, value = drive(calls.prepare(U, channel.dry_run), before, dry)
    assert (
        steps
        == [
            Call(U, "get_weight_version"),
            ReadClock(U),  # what the commit's expiry is sent by
            Call(U, "update_weights_from_disk", {"model_path": "/ckpt/new", "dry_run": True}),
            Note(U, "dry run ok", f"digest {NEW[:12]}"),
        ]
    )
    assert value == (before, dry)


def test_prepare_dry_runs_the_initial_source_and_refuses_one_that_cannot_restore_the_worker() -> None:
    """Failed on the previous code: the initial source was never compared with what the
    workers hold, so a wrong one was found only by a rollback that loaded other weights."""
    channel = DiskChannel({U: "/ckpt/new"})
    before, dry = {"digest": OLD, "torn": False}, {"digest": NEW}
    steps, _ = drive(calls.prepare(U, channel.dry_run, "/ckpt/old"), before, dry, {"digest": OLD})
    assert steps[-1] == Call(U, "update_weights_from_disk", {"model_path": "/ckpt/old", "dry_run": True})
    with pytest.raises(IllegalState) as err:
        drive(calls.prepare(U, channel.dry_run, "/ckpt/wrong"), before, dry, {"digest": NEW})
    assert err.value.code == "initial_source_mismatch" and "/ckpt/wrong" in err.value.message
    torn = {"digest": OLD, "torn": True}  # a torn worker holds nothing a rollback must match
    steps, _ = drive(calls.prepare(U, channel.dry_run, "/ckpt/wrong"), torn, dry)
    assert routes(steps) == ["get_weight_version", "update_weights_from_disk"]


def test_a_dry_run_that_cannot_be_built_fails_that_worker_when_its_script_runs() -> None:
    channel = DiskChannel({})
    script = calls.prepare(U, channel.dry_run)  # built: nothing asked yet
    assert next(script) == Call(U, "get_weight_version")
    assert script.send({}) == ReadClock(U)
    with pytest.raises(KeyError):
        script.send(None)


def test_apply_pauses_in_the_transactions_mode_then_the_disk_channel_loads_with_a_fresh_cache() -> None:
    steps, _ = drive(calls.pause_to_load(U, "wait"), {"paused": True})
    assert steps == [Call(U, "pause_generation", {"mode": "wait"}), Note(U, "paused", "wait")]

    sent: list[Call] = []

    async def fan(urls: Any, call: Any) -> Any:
        sent.extend(call(u) for u in urls)
        return {}, {}

    asyncio.run(DiskChannel({U: "/ckpt/new", "http://b:80": "/b/new"}).apply([U], fan, 0.0))
    assert sent == [
        Call(U, "update_weights_from_disk", {"model_path": "/ckpt/new", "reset_prefix_cache": True})
    ]


def test_verify_asks_for_the_load_digest_unless_live_and_accepts_only_the_expected_one() -> None:
    steps, reply = drive(calls.attest(U, NEW, False), {"match": True, "digest": NEW})
    assert steps == [Call(U, "verify_weights", {"allow_load_digest": True})] and reply["digest"] == NEW
    steps, _ = drive(calls.attest(U, NEW, True), {"match": True, "digest": NEW})
    assert steps == [Call(U, "verify_weights")]
    with pytest.raises(IllegalState) as err:
        drive(calls.attest(U, NEW, False), {"match": True, "digest": OLD})
    assert err.value.code == "digest_mismatch" and "expected" in err.value.message
    with pytest.raises(IllegalState) as err:
        drive(calls.attest(U, NEW, False), {"match": False, "digest": NEW, "recorded_digest": OLD})
    assert err.value.code == "digest_mismatch" and "outside the control plane" in err.value.message
    with pytest.raises(IllegalState):
        drive(calls.attest(U, None, False), {"match": True, "digest": NEW})  # nothing to attest against


def test_verify_falls_back_for_an_older_worker_and_one_that_cannot_attest() -> None:
    older = InvalidRequest("no such field", code="unknown_field")
    steps, _ = drive(calls.attest(U, NEW, False), older, {"match": True, "digest": NEW})
    assert routes(steps) == ["verify_weights", "verify_weights"] and steps[1].body == {}
    cannot = NotSupported("no digests here", code="not_supported")
    steps, _ = drive(calls.attest(U, NEW, False), cannot, {"digest": NEW})
    assert routes(steps) == ["verify_weights", "get_weight_version"]
    down = EngineUnavailable("down", code="unreachable")
    with pytest.raises(EngineUnavailable):  # no answer is not "cannot attest"
        drive(calls.attest(U, NEW, False), down)


def test_commit_declares_version_epoch_and_digest_expiring_in_the_workers_clock_then_reads_it_back() -> None:
    steps, back = drive(calls.declare(U, "v1", 5, NEW, T), {}, holding("v1", 5, NEW))
    assert steps == [
        Expires(U, T),
        Call(U, "set_weight_version", {"weight_version": "v1", "epoch": 5, "expected_digest": NEW,
                                        "not_after": T + BEHIND}),
        Call(U, "get_weight_version"),
    ]  # fmt: skip
    assert back["epoch"] == 5
    steps, _ = drive(calls.declare(U, "v1", None, None, T), {}, holding("v1", None, OLD))
    assert steps[1].body == {"weight_version": "v1", "not_after": T + BEHIND}  # no epoch, no guard


def test_a_commit_that_got_no_answer_is_in_doubt_until_its_expiry_on_this_clock_before_it_fails() -> None:
    timeout = EngineUnavailable("no answer in time", code="timeout")
    script = calls.declare(U, "v1", 5, NEW, T)
    assert script.send(None) == Expires(U, T)
    assert script.send(Expiry(T + BEHIND, T + 0.25)).body["not_after"] == T + BEHIND
    assert script.throw(timeout) == InDoubt(U, T + 0.25)  # the coordinator's clock, not the worker's
    with pytest.raises(EngineUnavailable):
        script.send(None)  # then its error, as without the note


@pytest.mark.parametrize(
    ("error", "in_doubt"),
    [
        (EngineUnavailable("no answer in time", code="timeout"), True),
        (EngineUnavailable("connection lost", code="unreachable"), True),
        (RuntimeError("a bug on this side"), True),
        (EngineUnavailable("refused to connect", code="unreachable", sent=False), False),
        (EngineUnavailable("no time left", code="timeout", sent=False), False),
        (IllegalState("holds another digest", code="digest_mismatch"), False),
        (IllegalState("expired", code="commit_expired"), False),
    ],
)
def test_only_a_commit_that_may_still_reach_its_worker_is_in_doubt(error: Exception, in_doubt: bool) -> None:
    assert calls.unanswered(error) is in_doubt
    steps: list[Any] = []
    with pytest.raises(type(error)):
        drive_until_error(calls.declare(U, "v1", 5, NEW, T), error, steps)
    assert (InDoubt(U, T + CLOCK_MARGIN_S) in steps) is in_doubt
    with pytest.raises(type(error)):  # the worker's clock could not be read: nothing was sent
        script = calls.declare(U, "v1", 5, NEW, T)
        assert script.send(None) == Expires(U, T)
        script.throw(error)


def drive_until_error(script: Script[Any], error: Exception, steps: list[Any]) -> None:
    """Throw ``error`` in at the script's first call; collect every step until it raises."""
    step = script.send(None)
    while isinstance(step, Expires):
        steps.append(step)
        step = script.send(theirs(step))
    steps.append(step)
    step = script.throw(error)
    while True:
        steps.append(step)
        step = script.send(None)


def test_a_rollback_can_be_made_to_wait_first() -> None:
    prev = Held("v0", True, 4, OLD, True, False, "/ckpt/old")
    steps, _ = drive(
        calls.first(calls.Settle(U), calls.roll_back(U, spec(prev, rollback_epoch=6), False, T)),
        {}, holding("v0", 4, OLD), {}, holding("v0", 6, OLD),
    )  # fmt: skip
    assert steps[0] == calls.Settle(U) and routes(steps)[0] == "pause_generation"


@pytest.mark.parametrize(
    "back",
    [holding("v0", 5, NEW), holding("v1", 4, NEW), holding("v1", 5, OLD), holding("v1", 5, NEW, torn=True),
     {**holding("v1", 5, NEW), "version_declared": False}],
)  # fmt: skip
def test_a_declaration_that_does_not_read_back_exactly_is_not_a_commit(back: dict[str, Any]) -> None:
    with pytest.raises(IllegalState) as err:
        drive(calls.declare(U, "v1", 5, NEW, T), {"status": "ok"}, back)
    assert err.value.code == "commit_not_read_back"


def test_resume_resumes_a_worker_that_holds_the_commit_and_nothing_else() -> None:
    steps, _ = drive(calls.resume_committed(U, spec(), T), holding("v1", 5, NEW), {})
    assert steps == [
        Call(U, "get_weight_version"),
        Call(U, "resume_generation"),
        Note(U, "serving", "version 'v1', epoch 5"),
    ]


def test_resume_brings_a_worker_that_lost_the_commit_onto_it_first() -> None:
    restarted = holding("v0", None, OLD)
    steps, _ = drive(
        calls.resume_committed(U, spec(), T), restarted, {}, {"digest": NEW}, {}, holding("v1", 5, NEW), {}
    )
    assert steps[1] == Note(U, "does not hold the commit", "bringing it onto it")
    assert steps[2:6] == [
        Call(U, "pause_generation", {"mode": "wait"}),
        Call(U, "update_weights_from_disk", {"model_path": "/ckpt/new", "reset_prefix_cache": True}),
        Expires(U, T),
        Call(U, "set_weight_version", {"weight_version": "v1", "epoch": 5, "expected_digest": NEW,
                                        "not_after": T + BEHIND}),
    ]  # fmt: skip
    assert routes(steps)[-2:] == ["get_weight_version", "resume_generation"]
    with pytest.raises(IllegalState) as err:
        drive(calls.resume_committed(U, spec(source=None), T), restarted, {})
    assert err.value.code == "no_restore_source"


def test_a_worker_never_prepared_is_not_touched_by_a_rollback() -> None:
    assert drive(calls.roll_back(U, spec(), False, T)) == ([], None)


def test_a_rollback_reloads_a_changed_worker_and_redeclares_under_the_rollback_epoch() -> None:
    prev = Held("v0", True, 4, OLD, False, False, "/ckpt/old")
    steps, row = drive(
        calls.roll_back(U, spec(prev, rollback_epoch=6), False, T),
        {}, holding("v1", 5, NEW), {"digest": OLD}, {}, holding("v0", 6, OLD), {},
    )  # fmt: skip
    assert steps[:4] == [
        Call(U, "pause_generation", {"mode": "wait"}),
        Call(U, "get_weight_version"),
        Call(U, "update_weights_from_disk", {"model_path": "/ckpt/old", "reset_prefix_cache": True}),
        Rolled(U),
    ]
    assert steps[4:6] == [
        Expires(U, T),
        Call(U, "set_weight_version", {"weight_version": "v0", "epoch": 6, "expected_digest": OLD,
                                        "not_after": T + BEHIND}),
    ]  # fmt: skip
    assert routes(steps)[-1] == "resume_generation" and steps[-1] == Note(U, "restored", "epoch 6")
    assert row == CommittedRow("/ckpt/old", "v0", 6, OLD)


def test_a_rollback_leaves_the_weights_of_an_unchanged_worker_and_keeps_a_paused_one_paused() -> None:
    prev = Held("v0", True, 4, OLD, True, False, "/ckpt/old")
    steps, _ = drive(
        calls.roll_back(U, spec(prev, rollback_epoch=6), False, T), {}, holding("v0", 4, OLD), {},
        holding("v0", 6, OLD),
    )  # fmt: skip
    assert routes(steps) == [
        "pause_generation",
        "get_weight_version",
        "set_weight_version",
        "get_weight_version",
    ]
    assert steps[-1] == Note(U, "unchanged", "epoch 6")


def test_a_rollback_with_nothing_to_restore_from_leaves_the_worker_paused_unless_the_channel_repushes() -> (
    None
):
    prev = Held("v0", True, 4, OLD, False, False, None)
    with pytest.raises(IllegalState) as err:
        drive(calls.roll_back(U, spec(prev, rollback_epoch=6), False, T), {}, holding("v1", 5, NEW))
    assert err.value.code == "no_rollback_source"
    steps, _ = drive(
        calls.roll_back(U, spec(prev, rollback_epoch=6), True, T),
        {}, holding("v0", 4, OLD), {"digest": OLD}, {}, holding("v0", 6, OLD), {},
    )  # fmt: skip
    assert steps[2:4] == [Repush(U), Rolled(U)]  # re-pushed even though it holds the old digest
    with pytest.raises(IllegalState) as err:
        drive(
            calls.roll_back(U, spec(prev, rollback_epoch=6), True, T),
            {},
            holding("v1", 5, NEW),
            {"digest": NEW},
        )
    assert err.value.code == "digest_mismatch" and "stays paused" in err.value.message


def test_the_fanout_sends_each_call_as_the_clients_method_and_throws_a_refusal_in_where_it_asked() -> None:
    seen: list[tuple[str, Any]] = []

    def worker(request: httpx.Request) -> httpx.Response:
        route, body = request.url.path.rsplit("/", 1)[-1], json.loads(request.content or b"{}")
        seen.append((route, body))
        if route == "verify_weights" and "allow_load_digest" in body:
            return httpx.Response(400, json={"status": "error", "code": "unknown_field", "message": "old"})
        return httpx.Response(200, json={"status": "ok", "match": True, "digest": NEW})

    fanout = Fanout(
        api_key=None, transport=httpx.MockTransport(worker), retries=0, backoff_s=0.0, max_backoff_s=0.0,
        heartbeat_s=5.0, emit=lambda *a, **k: None, beat=lambda: None,
    )  # fmt: skip

    async def play() -> Any:
        try:
            await fanout.follow(calls.one(calls.pause(U, "keep")), 1e9)
            return await fanout.follow(calls.attest(U, NEW, False), 1e9)
        finally:
            await fanout.close()

    reply = asyncio.run(play())
    assert reply["digest"] == NEW
    assert seen == [
        ("pause_generation", {"mode": "keep", "clear_cache": False}),  # the method's default rides along
        ("verify_weights", {"allow_load_digest": True}),
        ("verify_weights", {}),
    ]


class Ticking:
    """A stand-in for the fan-out module's ``time``: ``time()`` steps through ``ticks`` (then
    stays on the last), ``monotonic()`` is the real one."""

    def __init__(self, *ticks: float) -> None:
        self.ticks = list(ticks)

    def time(self) -> float:
        return self.ticks.pop(0) if len(self.ticks) > 1 else self.ticks[0]

    monotonic = staticmethod(time_module.monotonic)


def clocked(clock: Any, seen: list[tuple[str, Any]]) -> httpx.MockTransport:
    """A worker whose ``clock`` route answers ``clock`` (``"none"``: it has no such route)."""

    def worker(request: httpx.Request) -> httpx.Response:
        route, body = request.url.path.rsplit("/", 1)[-1], json.loads(request.content or b"{}")
        seen.append((route, body))
        if route == "clock" and clock == "none":
            return httpx.Response(404, json={"status": "error", "code": "unknown_route", "message": "old"})
        if route == "clock":
            return httpx.Response(200, json={"status": "ok", "clock": clock})
        return httpx.Response(200, json={"status": "ok", **holding("v1", 5, NEW)})

    return httpx.MockTransport(worker)


def fanout_over(transport: httpx.MockTransport) -> Fanout:
    return Fanout(
        api_key=None, transport=transport, retries=0, backoff_s=0.0, max_backoff_s=0.0,
        heartbeat_s=5.0, emit=lambda *a, **k: None, beat=lambda: None,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("clock", "sent"),
    [(40.0, 49.5), ("none", 110.0), (None, 110.0), ("noon", 110.0), (True, 110.0), (-5.0, 110.0)],
    ids=["60s-behind", "no-clock-route", "null", "not-a-number", "bool", "before-1970"],
)
def test_the_fanout_sends_a_declaration_its_expiry_by_the_workers_clock_read_first_when_unknown(
    monkeypatch: pytest.MonkeyPatch, clock: Any, sent: float
) -> None:
    """The worker's clock says 40.0 in a round trip from 100.0 to 100.5 on the coordinator's:
    it runs 60 to 60.5 s behind, so a deadline of 110.0 is sent as 49.5 (the lowest offset:
    never later), and a worker that reports no usable clock is sent 110.0 as it is."""
    seen: list[tuple[str, Any]] = []
    monkeypatch.setattr("weightsync.fleet.fanout.time", Ticking(100.0, 100.5))
    fanout = fanout_over(clocked(clock, seen))
    steps: list[Any] = []

    async def aside(step: Any) -> None:
        steps.append(step)

    async def play() -> Any:
        try:
            return await fanout.follow(calls.declare(U, "v1", 5, NEW, 110.0), 1e9, aside)
        finally:
            await fanout.close()

    assert asyncio.run(play())["epoch"] == 5
    assert [r for r, _ in seen] == ["clock", "set_weight_version", "get_weight_version"]
    assert seen[1][1]["not_after"] == sent and steps == []


def test_the_fanout_reads_a_clock_again_only_once_its_reading_is_old(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, Any]] = []
    ticking = Ticking(100.0, 100.0)
    monkeypatch.setattr("weightsync.fleet.fanout.time", ticking)
    fanout = fanout_over(clocked(1000.0, seen))

    async def expiries() -> list[Expiry]:
        try:
            await fanout.follow(calls.one(calls.state(U)), 1e9)  # a state read is no clock reading
            out = [await fanout.expiry(Expires(U, 120.0), 1e9)]  # none yet: read first
            ticking.ticks = [100.0 + CLOCK_READ_S]
            out.append(await fanout.expiry(Expires(U, 120.0), 1e9))  # as old as may be: kept
            ticking.ticks = [100.0 + CLOCK_READ_S + 1, 101.0 + CLOCK_READ_S]
            out.append(await fanout.expiry(Expires(U, 170.0), 1e9))  # older: read again
            return out
        finally:
            await fanout.close()

    first, kept, again = asyncio.run(expiries())
    assert [r for r, _ in seen] == ["get_weight_version", "clock", "clock"]
    assert first == Expiry(1020.0, 120.0 + CLOCK_MARGIN_S)
    assert kept == Expiry(1020.0, 120.0 + CLOCK_MARGIN_S)
    assert again == Expiry(170.0 + 1000.0 - (101.0 + CLOCK_READ_S), 170.0 + CLOCK_MARGIN_S)


def test_a_clock_read_at_prepare_is_what_the_commit_is_sent_by(monkeypatch: pytest.MonkeyPatch) -> None:
    """A :class:`ReadClock` step reads the clock then; a declaration within
    :data:`CLOCK_READ_S` of it needs no read of its own (so a worker stopped after it
    verified is sent its commit), and a worker that answers the read with an error fails."""
    seen: list[tuple[str, Any]] = []
    monkeypatch.setattr("weightsync.fleet.fanout.time", Ticking(100.0, 100.5))
    fanout = fanout_over(clocked(40.0, seen))

    async def play() -> Any:
        try:
            await fanout.follow(calls.first(ReadClock(U), calls.one(calls.state(U))), 1e9)
            return await fanout.follow(calls.declare(U, "v1", 5, NEW, 110.0), 1e9)
        finally:
            await fanout.close()

    asyncio.run(play())
    assert [r for r, _ in seen] == ["clock", "get_weight_version", "set_weight_version", "get_weight_version"]
    assert seen[2][1]["not_after"] == 49.5

    def refusing(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"status": "error", "code": "engine_unavailable", "message": "no"})

    broken = fanout_over(httpx.MockTransport(refusing))

    async def refused() -> Any:
        try:
            return await broken.follow(calls.first(ReadClock(U), calls.one(calls.state(U))), 1e9)
        finally:
            await broken.close()

    with pytest.raises(EngineUnavailable):
        asyncio.run(refused())
