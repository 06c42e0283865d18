"""The conformance state machine every engine and transport runs (zarr's ``testing/stateful``
is the model).

:class:`WeightSyncStateMachine` drives a worker through a :class:`Harness` — in process
through the controller, or over HTTP — with random declares, pauses, resumes, updates
(valid, refused and tearing) and malformed requests, and after every step compares the
worker's reply with :class:`~weightsync.testing.model.PureModel`.  Invariants checked:

* declared never reverts; omission of ``weight_version`` preserves the declaration;
* a refused command changes neither the state nor the weights;
* update success with a version ⇒ the snapshot reports it and the weights are the new ones;
* no update while running without ``allow_unpaused``;
* declare never calls the engine (where the harness can count engine calls);
* torn ⇒ paused, and resume is refused.

To run it against your engine, subclass :class:`Harness` and call :func:`run_state_machine`.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Callable, Hashable
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from weightsync.core.controller import Controller
from weightsync.core.errors import WeightSyncError
from weightsync.core.routes import dispatch

from .fake import ScriptableEngine
from .model import OMITTED, PureModel
from .strategies import bad_bodies, json_values, pause_bodies, update_flags

UPDATE_KINDS = ("ok", "invalid", "tear")


class Harness(abc.ABC):
    """How the state machine reaches one worker.  One instance per hypothesis example."""

    invalid_code: str = "weights_mismatch"
    """The error code the worker answers to an ``invalid`` update."""

    update_kinds: tuple[str, ...] = UPDATE_KINDS
    """The update kinds this harness can produce (drop ``tear`` if it cannot inject one)."""

    @abc.abstractmethod
    def call(self, route: str, body: Any) -> tuple[int, dict[str, Any]]:
        """Send ``body`` to admin ``route``; return the HTTP-style status and the reply."""

    @abc.abstractmethod
    def update_request(self, kind: str, tag: str) -> tuple[str, dict[str, Any]]:
        """Route and source fields of an update of ``kind``: ``ok`` (loads weights ``tag``),
        ``invalid`` (refused before writing, code ``weights_mismatch``) or ``tear``
        (fails after writing began)."""

    @abc.abstractmethod
    def fingerprint(self) -> Hashable:
        """A value that changes whenever the served weights change."""

    def fingerprint_for(self, tag: str) -> Hashable | None:
        """The fingerprint after an ``ok`` update with ``tag``, or ``None`` if unknown."""
        return None

    def engine_calls(self) -> int | None:
        """How many engine calls were made so far, or ``None`` if the harness cannot see."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the worker."""


class ControllerHarness(Harness):
    """Drives a :class:`Controller` in process through :func:`dispatch` (the HTTP code path)."""

    def __init__(self, engine: Any | None = None) -> None:
        self.engine = engine if engine is not None else ScriptableEngine()
        self.loop = asyncio.new_event_loop()
        self.controller = Controller(self.engine)

    def call(self, route: str, body: Any) -> tuple[int, dict[str, Any]]:
        try:
            return 200, self.loop.run_until_complete(dispatch(self.controller, route, body))
        except WeightSyncError as exc:
            return exc.http_status, exc.to_reply()

    def update_request(self, kind: str, tag: str) -> tuple[str, dict[str, Any]]:
        path = {"ok": f"ok:{tag}", "invalid": "invalid", "tear": "tear"}[kind]
        return "update_weights_from_disk", {"model_path": path}

    def fingerprint(self) -> Hashable:
        return self.engine.fingerprint()  # type: ignore[no-any-return]

    def fingerprint_for(self, tag: str) -> Hashable:
        return self.engine.fingerprint_for(tag)  # type: ignore[no-any-return]

    def engine_calls(self) -> int:
        return len(self.engine.calls)

    def close(self) -> None:
        self.loop.close()


class WeightSyncStateMachine(RuleBasedStateMachine):
    """Set ``make_harness`` (a zero-argument callable) on a subclass, or use :func:`run_state_machine`."""

    make_harness: Callable[[], Harness] = ControllerHarness

    def __init__(self) -> None:
        super().__init__()
        self.harness = type(self).make_harness()
        status, reply = self.harness.call("get_weight_version", {})
        assert status == 200, reply
        self.model = PureModel.from_reply(reply)  # a reused worker need not be fresh
        self.tags = 0

    @initialize()
    def start_fingerprint(self) -> None:
        expected = self.harness.fingerprint_for("init")
        self.initial_fingerprint = self.harness.fingerprint()
        if expected is not None and not self.model.torn:
            assert self.initial_fingerprint == expected

    def teardown(self) -> None:
        self.harness.close()

    # ------------------------------------------------------------------ helpers

    def _expect(self, route: str, body: Any, code: str | None) -> dict[str, Any]:
        before = self.harness.fingerprint()
        status, reply = self.harness.call(route, body)
        if code is None:
            assert status == 200 and reply["status"] == "ok", (route, body, status, reply)
        else:
            assert status >= 400 and reply["status"] == "error", (route, body, status, reply)
            assert reply["code"] == code, (route, body, reply, code)
            if code != "weights_torn":
                assert self.harness.fingerprint() == before, "a refused command changed the weights"
        return reply

    # ------------------------------------------------------------------ rules

    @rule(value=json_values())
    def declare(self, value: Any) -> None:
        calls = self.harness.engine_calls()
        self.model.declare(value)
        reply = self._expect("set_weight_version", {"weight_version": value}, None)
        assert reply["version"] == value and reply["version_declared"] is True
        if calls is not None:
            assert self.harness.engine_calls() == calls, "declare called the engine"

    @rule(body=pause_bodies())
    def pause(self, body: dict[str, Any]) -> None:
        self._expect("pause_generation", body, self.model.pause())

    @rule()
    def resume(self) -> None:
        self._expect("resume_generation", {}, self.model.resume())

    @rule(data=st.data(), version=st.just(OMITTED) | json_values(max_leaves=2), flags=update_flags())
    def update(self, data: st.DataObject, version: Any, flags: dict[str, Any]) -> None:
        kind = data.draw(st.sampled_from(self.harness.update_kinds), label="kind")
        self.tags += 1
        tag = f"t{self.tags}"
        route, body = self.harness.update_request(kind, tag)
        body = {**body, **flags}
        if version is not OMITTED:
            body["weight_version"] = version
        allow = flags.get("allow_unpaused", False)
        reset = flags.get("reset_prefix_cache", not allow)
        code = self.model.update(kind, tag, version, allow, reset, self.harness.invalid_code)
        reply = self._expect(route, body, code)
        if code is None:
            assert reply["version_declared"] is (version is not OMITTED)
            expected = self.harness.fingerprint_for(tag)
            if expected is not None:
                assert self.harness.fingerprint() == expected

    @rule(case=bad_bodies())
    def malformed(self, case: tuple[str, Any]) -> None:
        route, body = case
        status, reply = self.harness.call(route, body)
        assert status == 400 and reply["status"] == "error", (route, body, status, reply)

    # ------------------------------------------------------------------ invariants

    @invariant()
    def reports_match_model(self) -> None:
        status, reply = self.harness.call("get_weight_version", {})
        assert status == 200
        reply.pop("status")
        assert reply == self.model.reply(), (reply, self.model)
        if reply["torn"]:
            assert reply["paused"]


def run_state_machine(
    make_harness: Callable[[], Harness], *, max_examples: int = 100, stateful_step_count: int = 30
) -> None:
    """Run :class:`WeightSyncStateMachine` against harnesses from ``make_harness``."""
    machine = type("Machine", (WeightSyncStateMachine,), {"make_harness": staticmethod(make_harness)})
    run_state_machine_as_test(
        machine,
        settings=settings(max_examples=max_examples, stateful_step_count=stateful_step_count, deadline=None),
    )
