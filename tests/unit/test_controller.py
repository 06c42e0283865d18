"""The async controller with a scriptable engine: commits, refusals, tearing, concurrency."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import pytest

from weightsync.core import (
    UNDECLARED,
    Controller,
    Declared,
    DiskSource,
    IllegalState,
    InvalidRequest,
    LoadFailed,
    PauseMode,
    PauseRequest,
    UpdateRequest,
    WeightsTorn,
)
from weightsync.core.engine import cache_cleared
from weightsync.core.errors import CacheInUse
from weightsync.core.routes import dispatch
from weightsync.testing import ScriptableEngine


def update(path: str, version: Any = None, **flags: Any) -> UpdateRequest:
    return UpdateRequest(DiskSource(path), Declared(version) if version is not None else None, **flags)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_fresh_worker_is_undeclared_not_initial() -> None:
    snap = Controller(ScriptableEngine()).snapshot()
    assert snap.version is UNDECLARED and snap.to_reply()["version_declared"] is False
    assert Declared("initial") != UNDECLARED and Declared(None) != UNDECLARED


def test_update_commits_version_after_load_and_reset() -> None:
    async def main() -> None:
        engine = ScriptableEngine()
        c = Controller(engine)
        await c.pause(PauseRequest())
        out = await c.update(update("ok:a", "step-1"))
        assert out.declared and out.prefix_cache_reset
        assert c.snapshot().version == Declared("step-1")
        assert engine.fingerprint() == engine.fingerprint_for("a")
        assert [name for name, _ in engine.calls] == ["pause", "load_weights", "reset_prefix_cache"]

    run(main())


def test_update_without_version_preserves_declaration() -> None:
    async def main() -> None:
        c = Controller(ScriptableEngine(), version=Declared("v0"), paused=True)
        out = await c.update(update("ok:b"))
        assert not out.declared and c.snapshot().version == Declared("v0")

    run(main())


def test_update_while_running_is_refused_without_touching_the_engine() -> None:
    async def main() -> None:
        engine = ScriptableEngine()
        c = Controller(engine)
        with pytest.raises(IllegalState) as err:
            await c.update(update("ok:a", "v1"))
        assert err.value.code == "not_paused" and engine.calls == []
        assert c.snapshot().version is UNDECLARED and not c.snapshot().paused

    run(main())


def test_invalid_source_changes_nothing_and_keeps_its_code() -> None:
    async def main() -> None:
        engine = ScriptableEngine()
        c = Controller(engine, version=Declared("v0"), paused=True)
        before = c.snapshot()
        with pytest.raises(InvalidRequest) as err:
            await c.update(update("invalid", "v1"))
        assert err.value.code == "weights_mismatch"
        assert c.snapshot().version == before.version and not c.snapshot().torn
        assert engine.fingerprint() == engine.fingerprint_for("init")

    run(main())


def test_failure_after_writing_tears_and_refuses_resume_until_healed() -> None:
    async def main() -> None:
        engine = ScriptableEngine()
        c = Controller(engine, version=Declared("v0"), paused=True)
        with pytest.raises(WeightsTorn):
            await c.update(update("tear", "v1"))
        snap = c.snapshot()
        assert snap.torn and snap.paused and snap.version == Declared("v0")
        with pytest.raises(IllegalState) as err:
            await c.resume()
        assert err.value.code == "weights_torn"
        await c.update(update("ok:c", "v2"))
        assert not c.snapshot().torn and c.snapshot().paused
        await c.resume()
        assert not c.snapshot().paused

    run(main())


def test_unpaused_update_that_tears_pauses_the_engine() -> None:
    async def main() -> None:
        engine = ScriptableEngine()
        c = Controller(engine)
        with pytest.raises(WeightsTorn):
            await c.update(update("tear", allow_unpaused=True, reset_prefix_cache=False))
        assert c.snapshot().torn and not engine.running
        assert ("pause", PauseMode.ABORT) in engine.calls

    run(main())


@pytest.mark.parametrize("path", ["invalid", "nowhere"])
def test_unpaused_update_refused_before_writing_never_pauses_or_aborts(path: str) -> None:
    async def main() -> None:
        engine = ScriptableEngine()
        engine.requests.update({"rollout-1", "rollout-2"})
        c = Controller(engine, version=Declared("v0"))
        with pytest.raises(InvalidRequest):
            await c.update(update(path, "v1", allow_unpaused=True, reset_prefix_cache=False))
        snap = c.snapshot()
        assert not snap.torn and not snap.paused and snap.version == Declared("v0")
        assert engine.running and engine.requests == {"rollout-1", "rollout-2"}
        assert [name for name, _ in engine.calls] == ["load_weights"]

    run(main())


class _FailsWithoutCause(ScriptableEngine):
    """Reports a failure before writing that carries no narrower cause (a 500 such as
    ``read_failed``), or breaks the engine contract by raising outside the error family."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__()
        self.exc = exc

    async def load_weights(self, source: Any) -> Any:
        self.calls.append(("load_weights", source))
        raise self.exc


def test_unpaused_load_failure_without_writes_or_cause_is_a_500_that_keeps_rollouts() -> None:
    async def main() -> None:
        engine = _FailsWithoutCause(LoadFailed("disk read error", wrote=False, code="read_failed"))
        engine.requests.add("rollout")
        c = Controller(engine, version=Declared("v0"))
        with pytest.raises(LoadFailed) as err:
            await c.update(update("ok:a", "v1", allow_unpaused=True, reset_prefix_cache=False))
        assert err.value.code == "read_failed" and err.value.http_status == 500
        assert not c.snapshot().torn and not c.snapshot().paused
        assert engine.running and engine.requests == {"rollout"}

    run(main())


def test_engine_raising_outside_the_error_family_is_treated_as_torn() -> None:
    """A contract breach: the engine cannot say what it wrote, so the controller assumes the
    worst (torn, paused with abort).  Engines avoid it by raising only ``LoadFailed``."""

    async def main() -> None:
        engine = _FailsWithoutCause(KeyError("oops"))
        engine.requests.add("rollout")
        c = Controller(engine, version=Declared("v0"))
        with pytest.raises(WeightsTorn):
            await c.update(update("ok:a", "v1", allow_unpaused=True, reset_prefix_cache=False))
        assert c.snapshot().torn and c.snapshot().paused
        assert ("pause", PauseMode.ABORT) in engine.calls and not engine.requests

    run(main())


def test_cache_reset_that_did_not_happen_never_commits_the_version() -> None:
    async def main() -> None:
        engine = ScriptableEngine()
        engine.reset_results.append(False)
        c = Controller(engine, version=Declared("v0"), paused=True)
        with pytest.raises(WeightsTorn) as err:
            await c.update(update("ok:a", "v1"))
        assert err.value.code == "cache_reset_failed"
        assert c.snapshot().version == Declared("v0") and c.snapshot().torn

    run(main())


def test_flush_cache_reports_a_reset_that_did_not_happen() -> None:
    async def main() -> None:
        engine = ScriptableEngine()
        engine.reset_results.extend([True, False])
        c = Controller(engine)
        assert await c.flush_cache() is True
        with pytest.raises(IllegalState) as err:
            await c.flush_cache()
        assert err.value.code == "cache_in_use"

    run(main())


def test_an_engine_says_a_cache_reset_did_not_happen_by_raising_cache_in_use() -> None:
    async def main() -> None:
        engine = ScriptableEngine()
        engine.reset_results.extend([False, True, False])
        with pytest.raises(CacheInUse) as err:
            await engine.reset_prefix_cache()
        assert err.value.code == "cache_in_use" and err.value.http_status == 409
        assert await cache_cleared(engine.reset_prefix_cache()) is True
        assert await cache_cleared(engine.reset_prefix_cache()) is False

    run(main())


def test_a_paused_worker_reports_a_cache_clear_that_did_not_happen() -> None:
    async def main() -> None:
        engine = ScriptableEngine()
        c = Controller(engine, paused=True)
        engine.reset_results.append(False)
        result = await c.pause(PauseRequest(PauseMode.KEEP, clear_cache=True))
        assert result.was_paused and result.outcome.cache_cleared is False
        result = await c.pause(PauseRequest(PauseMode.KEEP, clear_cache=True))
        assert result.outcome.cache_cleared is True

    run(main())


def test_pause_is_idempotent_and_does_not_call_the_engine_twice() -> None:
    async def main() -> None:
        engine = ScriptableEngine()
        c = Controller(engine)
        first = await c.pause(PauseRequest(PauseMode.ABORT))
        second = await c.pause(PauseRequest(PauseMode.KEEP))
        assert not first.was_paused and second.was_paused
        assert [n for n, _ in engine.calls] == ["pause"]

    run(main())


def test_declare_during_a_slow_update_is_applied_after_it() -> None:
    async def main() -> None:
        engine = ScriptableEngine(load_delay=0.2)
        c = Controller(engine, paused=True)
        upd = asyncio.create_task(c.update(update("ok:a", "from-update")))
        await asyncio.sleep(0.05)
        assert c.snapshot().update_in_flight
        assert c.snapshot().version is UNDECLARED  # reads do not wait, and see the committed state
        decl = asyncio.create_task(c.declare(Declared("declared-later")))
        await asyncio.sleep(0.01)
        assert not decl.done()
        await asyncio.gather(upd, decl)
        assert c.snapshot().version == Declared("declared-later")
        assert not c.snapshot().update_in_flight

    run(main())


def test_a_declaration_that_expires_while_queued_behind_an_update_is_refused_when_it_runs() -> None:
    """``not_after`` is read when the declaration takes effect, not when it arrived: the
    update ends at least 0.5 s after ``not_after`` was set 0.2 s ahead, so it has expired."""

    async def main() -> None:
        engine = ScriptableEngine(load_delay=0.5)
        c = Controller(engine, paused=True)
        not_after = time.time() + 0.2
        upd = asyncio.create_task(c.update(update("ok:a", "from-update")))
        decl = asyncio.create_task(c.declare(Declared("late"), epoch=3, not_after=not_after))
        await upd
        with pytest.raises(IllegalState) as err:
            await decl
        assert err.value.code == "commit_expired" and err.value.details["not_after"] == not_after
        snap = c.snapshot()
        assert (snap.version, snap.epoch) == (Declared("from-update"), None)
        assert [(e.command, e.outcome) for e in c.journal] == [
            ("update", "ok"),
            ("declare", "commit_expired"),
        ]

    run(main())


def test_a_cancelled_caller_does_not_abandon_an_arrived_update() -> None:
    async def main() -> None:
        engine = ScriptableEngine(load_delay=0.1)
        c = Controller(engine, paused=True)
        task = asyncio.create_task(c.update(update("ok:a", "v1")))
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await c.declare(Declared("after"))  # queued behind the update
        assert engine.fingerprint() == engine.fingerprint_for("a")
        assert [e.command for e in c.journal] == ["update", "declare"]

    run(main())


def _replay(commands: list[tuple[str, Any]]) -> tuple[Any, bool, bool, str]:
    """Sequential meaning of a command list, written without the controller."""
    version: Any = UNDECLARED
    paused, torn, weights = False, False, "init"
    for name, arg in commands:
        if name == "declare":
            version = Declared(arg)
        elif name == "pause":
            paused = True
        elif name == "resume" and not torn:
            paused = False
        elif name == "update" and paused:
            path, v = arg
            if path == "tear":
                torn, weights = True, "torn"
            else:
                torn, weights = False, path[3:]
                if v is not None:
                    version = Declared(v)
    return version, paused, torn, weights


@pytest.mark.parametrize("seed", range(20))
def test_concurrent_commands_are_linearizable_in_arrival_order(seed: int) -> None:
    rng = random.Random(seed)

    async def main() -> None:
        engine = ScriptableEngine(load_delay=0.001)
        c = Controller(engine)
        commands: list[tuple[str, Any]] = []
        tasks = []
        for i in range(40):
            kind = rng.choice(["declare", "pause", "resume", "update", "update"])
            arg: Any = None
            if kind == "declare":
                arg = f"d{i}"
                coro: Any = c.declare(Declared(arg))
            elif kind == "pause":
                coro = c.pause(PauseRequest(rng.choice(list(PauseMode))))
            elif kind == "resume":
                coro = c.resume()
            else:
                arg = (rng.choice([f"ok:w{i}", "tear"]), rng.choice([None, f"u{i}"]))
                coro = c.update(update(arg[0], arg[1]))
            commands.append((kind, arg))
            tasks.append(asyncio.ensure_future(coro))  # arrival order = creation order
            if rng.random() < 0.3:
                await asyncio.sleep(0)
        await asyncio.gather(*tasks, return_exceptions=True)
        version, paused, torn, weights = _replay(commands)
        snap = c.snapshot()
        assert (snap.version, snap.paused, snap.torn) == (version, paused, torn)
        if weights != "torn":
            assert engine.fingerprint() == engine.fingerprint_for(weights)
        assert [e.seq for e in c.journal] == sorted(e.seq for e in c.journal)

    run(main())


def test_dispatch_answers_every_read_route() -> None:
    async def main() -> None:
        c = Controller(ScriptableEngine())
        assert (await dispatch(c, "get_weight_version", {}))["version_declared"] is False
        info = await dispatch(c, "weight_info", {})
        assert info["names"] == ["embed", "layer0", "layer1", "head"]
        assert (await dispatch(c, "liveness_probe", {}))["alive"] is True
        rpc = await dispatch(c, "engine_rpc", {"method": "weight_labels"})
        assert rpc["result"]["embed"] == "init"

    run(main())


class OldProtocolCacheEngine(ScriptableEngine):
    """An engine written against the older protocol: ``reset_prefix_cache`` returns ``False``
    for a reset that did not happen instead of raising ``CacheInUse``."""

    async def reset_prefix_cache(self) -> bool:  # type: ignore[override]
        self.calls.append(("reset_prefix_cache", None))
        return False


def test_a_reset_returning_false_is_never_taken_for_a_reset() -> None:
    async def main() -> None:
        engine = OldProtocolCacheEngine()
        c = Controller(engine, version=Declared("v0"), paused=True)
        with pytest.raises(CacheInUse) as err:
            await c.flush_cache()
        assert err.value.code == "cache_in_use" and "returned False" in err.value.message
        assert await cache_cleared(engine.reset_prefix_cache()) is False
        result = await c.pause(PauseRequest(PauseMode.KEEP, clear_cache=True))
        assert result.outcome.cache_cleared is False
        with pytest.raises(WeightsTorn) as torn:
            await c.update(update("ok:a", "v1"))
        assert torn.value.code == "cache_reset_failed"
        assert c.snapshot().version == Declared("v0") and c.snapshot().torn

    run(main())
