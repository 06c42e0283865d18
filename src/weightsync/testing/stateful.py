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
* torn ⇒ paused, and resume is refused, as while memory is released (where the harness
  :attr:`~Harness.releases_memory`); offloaded weights come back as they were;
* where the harness can observe the prefix cache (:meth:`Harness.prefix_cached`): a reply
  that claims a cache reset (an update's ``prefix_cache_reset``, ``flush_cache``'s
  ``flushed``, a pause's ``clear_cache``) left no prompt cached, and no prefix computed
  with old weights is served after an update.

Every failed check raises ``AssertionError`` naming the rule, the commands sent so far, and
both states.  To run it against your engine, subclass :class:`~weightsync.testing.harness.Harness`
and call :func:`run_state_machine`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from weightsync.core.engine import PrefixCacheProbe
from weightsync.testing.harness import PROMPTS, UPDATE_KINDS, ControllerHarness, Harness
from weightsync.testing.model import OMITTED, PureModel
from weightsync.testing.strategies import bad_bodies, json_values, pause_bodies, update_flags

__all__ = [
    "PROMPTS", "UPDATE_KINDS", "ControllerHarness", "Harness", "PrefixCacheProbe", "WeightSyncStateMachine",
    "run_state_machine",
]  # fmt: skip


class WeightSyncStateMachine(RuleBasedStateMachine):
    """Set ``make_harness`` (a zero-argument callable) on a subclass, or use :func:`run_state_machine`."""

    make_harness: Callable[[], Harness] = ControllerHarness

    def __init__(self) -> None:
        super().__init__()
        self.harness = type(self).make_harness()
        self.sent: list[str] = []  # every command so far, for failure messages
        self.warmed: set[str] = set()
        status, reply = self.harness.call("get_weight_version", {})
        assert status == 200, f"the worker does not answer get_weight_version: {status} {reply}"
        self.model = PureModel.from_reply(reply)  # a reused worker need not be fresh
        self.tags = 0

    @initialize()
    def start_fingerprint(self) -> None:
        expected = self.harness.fingerprint_for("init")
        self.initial_fingerprint = self.harness.fingerprint()
        if expected is not None and not self.model.torn:
            assert self.initial_fingerprint == expected, self._explain(
                "a fresh worker serves its initial weights",
                worker=f"fingerprint {self.initial_fingerprint!r}, expected {expected!r}",
            )

    def teardown(self) -> None:
        self.harness.close()

    # ------------------------------------------------------------------ helpers

    def _explain(self, rule: str, *, worker: Any, model: Any = None) -> str:
        """The failure message: the rule, the commands so far, the model's and the worker's state."""
        steps = "\n".join(f"  {i}. {s}" for i, s in enumerate(self.sent, 1)) or "  (none)"
        return (
            f"rule broken: {rule}\n"
            f"commands sent:\n{steps}\n"
            f"model expects: {self.model if model is None else model}\n"
            f"worker has:    {worker}"
        )

    def _send(self, route: str, body: Any) -> tuple[int, dict[str, Any]]:
        status, reply = self.harness.call(route, body)
        outcome = "ok" if status < 400 else f"{status} {reply.get('code')}"
        self.sent.append(f"{route} {json.dumps(body, sort_keys=True, default=repr)} -> {outcome}")
        return status, reply

    def _expect(self, route: str, body: Any, code: str | None) -> dict[str, Any]:
        before = self.harness.fingerprint()
        status, reply = self._send(route, body)
        if code is None:
            assert status == 200 and reply.get("status") == "ok", self._explain(
                f"{route} is legal here and must succeed", worker=f"HTTP {status} {reply}"
            )
        else:
            assert status >= 400 and reply.get("status") == "error" and reply.get("code") == code, (
                self._explain(f"{route} must be refused with code {code!r}", worker=f"HTTP {status} {reply}")
            )
            if code != "weights_torn":
                after = self.harness.fingerprint()
                assert after == before, self._explain(
                    "a refused command changes neither the state nor the weights",
                    worker=f"weights changed from {before!r} to {after!r}",
                )
        return reply

    def _check_serves(self, tag: Any, rule: str) -> None:
        """Assert the engine serves the weights ``tag`` names (when the harness can tell)."""
        expected = self.harness.fingerprint_for(tag)
        if expected is not None:
            got = self.harness.fingerprint()
            assert got == expected, self._explain(rule, worker=f"fingerprint {got!r}, expected {expected!r}")

    def _check_cache_empty(self, claim: str) -> None:
        """After ``claim`` (a reply that says the cache was reset), nothing may be served from it."""
        if not self.harness.observes_prefix_cache:
            return
        cached = sorted(p for p in self.warmed if self.harness.prefix_cached(p))
        assert not cached, self._explain(
            f"{claim} means no prompt is served from the prefix cache afterwards",
            model="prefix cache empty",
            worker=f"prompts still cached: {cached}",
        )
        self.warmed.clear()

    def _draw_update(self, data: st.DataObject, version: Any, extra: dict[str, Any]) -> tuple[Any, ...]:
        kind = data.draw(st.sampled_from(self.harness.update_kinds), label="kind")
        self.tags += 1
        route, body = self.harness.update_request(kind, f"t{self.tags}")
        label = {} if version is OMITTED else {"weight_version": version}
        return kind, f"t{self.tags}", route, {**body, **extra, **label}

    # ------------------------------------------------------------------ rules

    @rule(value=json_values())
    def declare(self, value: Any) -> None:
        calls = self.harness.engine_calls()
        code = self.model.declare(value)
        reply = self._expect("set_weight_version", {"weight_version": value}, code)
        assert code is not None or (
            reply.get("version") == value and reply.get("version_declared") is True
        ), self._explain("set_weight_version replies with the version it declared", worker=reply)
        if calls is not None:
            now = self.harness.engine_calls()
            assert now == calls, self._explain(
                "declare never calls the engine", worker=f"engine calls went from {calls} to {now}"
            )

    @rule(body=pause_bodies())
    def pause(self, body: dict[str, Any]) -> None:
        reply = self._expect("pause_generation", body, self.model.pause())
        if reply.get("clear_cache") is True:
            self._check_cache_empty("pause_generation replying clear_cache=true")

    @rule()
    def resume(self) -> None:
        self._expect("resume_generation", {}, self.model.resume())

    @rule(data=st.data(), version=st.just(OMITTED) | json_values(max_leaves=2), flags=update_flags())
    def update(self, data: st.DataObject, version: Any, flags: dict[str, Any]) -> None:
        kind, tag, route, body = self._draw_update(data, version, flags)
        allow = flags.get("allow_unpaused", False)
        reset = flags.get("reset_prefix_cache", not allow)
        code = self.model.update(
            kind, tag, version, allow, reset, self.harness.invalid_code, self.harness.unpaused_tear_code
        )
        reply = self._expect(route, body, code)
        if code is None:
            assert reply.get("version_declared") is (version is not OMITTED), self._explain(
                "an update declares a version exactly when it carries weight_version", worker=reply
            )
            self._check_serves(tag, f"an update that succeeds serves the new weights ({tag})")
            if reply.get("prefix_cache_reset") is True:
                self._check_cache_empty("an update replying prefix_cache_reset=true")
            else:
                self._check_cache_empty(
                    "an update that loaded new weights (old prefixes must not serve them)"
                )

    @rule()
    def begin_session(self) -> None:
        self._expect("begin_weight_update", {}, self.model.begin())

    @rule(data=st.data(), version=st.just(OMITTED) | json_values(max_leaves=2))
    def session_update(self, data: st.DataObject, version: Any) -> None:
        kind, tag, route, body = self._draw_update(data, version, {"session": True})
        code = self.model.session_update(kind, tag, version, self.harness.invalid_code)
        reply = self._expect(route, body, code)
        if code is None:
            assert reply.get("version_declared") is False, self._explain(
                "an update inside a session never declares (only the finish does)", worker=reply
            )

    @rule(version=st.just(OMITTED) | json_values(max_leaves=2))
    def finish_session(self, version: Any) -> None:
        wrote = self.model.session.wrote if self.model.session is not None else None
        body = {} if version is OMITTED else {"weight_version": version}
        code = self.model.finish(version)
        self._expect("end_weight_update", body, code)
        if code is None and wrote is not None:
            self._check_serves(wrote, f"a finished session serves the weights it streamed ({wrote})")
            self._check_cache_empty("a finished session (its cache reset was requested)")

    @rule()
    def abandon_session(self) -> None:
        self._expect("abort_weight_update", {}, self.model.abandon())

    @precondition(lambda self: self.harness.observes_prefix_cache and not self.model.paused)
    @rule(prompt=st.sampled_from(PROMPTS))
    def generate(self, prompt: str) -> None:
        self.harness.warm_cache(prompt)
        self.sent.append(f"(generate {prompt!r})")
        assert self.harness.prefix_cached(prompt), self._explain(
            "the probe sees a prompt the worker just served (check the harness)",
            model=f"{prompt!r} cached",
            worker=f"{prompt!r} not cached",
        )
        self.warmed.add(prompt)

    @precondition(lambda self: self.harness.releases_memory)
    @rule(weights=st.sampled_from(["offload", "discard", "keep"]), kv_cache=st.booleans())
    def release_memory(self, weights: str, kv_cache: bool) -> None:
        code = self.model.release(None if weights == "keep" else weights, kv_cache)
        self._expect("release_memory", {"weights": weights, "kv_cache": kv_cache}, code)
        self.model.weights = None if code is None and weights == "discard" else self.model.weights

    @precondition(lambda self: self.harness.releases_memory)
    @rule(weights=st.booleans(), kv_cache=st.booleans())
    def resume_memory(self, weights: bool, kv_cache: bool) -> None:
        was, body = self.model.memory, {"weights": weights, "kv_cache": kv_cache}
        self._expect("resume_memory", body, self.model.restore(weights, kv_cache))
        if was == "offloaded" and self.model.memory == "resident" and self.model.weights is not None:
            self._check_serves(self.model.weights, "offloaded weights come back as they were")

    @rule()
    def flush_cache(self) -> None:
        status, reply = self._send("flush_cache", {})
        # Legal in every state; an engine whose requests hold the cache may refuse (409).
        refused = status == 409 and reply.get("code") == "cache_in_use"
        assert refused or (status == 200 and reply.get("flushed") is True), self._explain(
            "flush_cache either really flushes or is refused with cache_in_use",
            worker=f"HTTP {status} {reply}",
        )
        if not refused:
            self._check_cache_empty("flush_cache replying flushed=true")

    @rule(case=bad_bodies())
    def malformed(self, case: tuple[str, Any]) -> None:
        route, body = case
        status, reply = self._send(route, body)
        assert status == 400 and reply.get("status") == "error", self._explain(
            "a malformed request is a 400 whatever the state", worker=f"HTTP {status} {reply}"
        )

    # ------------------------------------------------------------------ invariants

    @invariant()
    def reports_match_model(self) -> None:
        status, reply = self.harness.call("get_weight_version", {})
        assert status == 200, self._explain(
            "get_weight_version always answers", worker=f"HTTP {status} {reply}"
        )
        expected = self.model.reply()
        # Fields the model does not know (a digest, an epoch) are not its business.
        reported = {k: reply.get(k, "<missing>") for k in expected}
        assert reported == expected, self._explain(
            "get_weight_version reports what the commands so far imply", worker=reported
        )
        assert not reply["torn"] or reply["paused"], self._explain("torn implies paused", worker=reported)


def run_state_machine(
    make_harness: Callable[[], Harness],
    *,
    max_examples: int = 100,
    stateful_step_count: int = 30,
    shrink: bool = True,
) -> None:
    """Run :class:`WeightSyncStateMachine` against harnesses from ``make_harness``.

    A broken engine often breaks more than one rule; the run reports the first it finds
    (shrunk) as one ``AssertionError`` rather than an exception group of several.
    ``shrink=False`` reports it as found, without searching for the shortest run that breaks
    the rule: for a check that only needs to know a rule breaks (shrinking a run over HTTP can
    take minutes)."""
    machine = type("Machine", (WeightSyncStateMachine,), {"make_harness": staticmethod(make_harness)})
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=max_examples,
            stateful_step_count=stateful_step_count,
            deadline=None,
            report_multiple_bugs=False,
            phases=tuple(Phase) if shrink else tuple(p for p in Phase if p is not Phase.shrink),
        ),
    )
