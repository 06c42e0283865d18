"""A transaction's advice tells a dead worker from a paused one, and names commands that work
where it is read: the ``weightsync fleet`` commands from the CLI, the router's own routes from
the router (which holds the journal's lease, so ``weightsync fleet update`` beside it is
refused with ``journal_locked``).

Failed on the previous code: a worker that did not answer was called "paused", and the router
relayed advice naming the CLI commands its lease refuses."""

from __future__ import annotations

from typing import Any

import attrs

from weightsync.fleet.result import CLI_STEPS, RAY_STEPS, ROUTER_STEPS, TransactionResult, WorkerOutcome

_PAUSED = {
    "version": "v0",
    "epoch": 1,
    "digest": "d0",
    "paused": True,
    "torn": False,
    "update_in_flight": False,
}


def _result(*workers: WorkerOutcome, phase: str = "rolled_back") -> TransactionResult:
    return TransactionResult(1, phase, "v1", 1, None, "abort", workers, code="failed")


def _worker(url: str, outcome: str, holds: dict[str, Any] | None) -> WorkerOutcome:
    return WorkerOutcome(url, outcome, code="x", holds=holds)


def test_a_failed_worker_that_did_not_answer_is_called_unreachable_not_paused() -> None:
    result = _result(_worker("http://a", "failed", None), _worker("http://b", "rolled_back", _PAUSED))
    said = result.next_step
    assert "http://a did not answer (down or unreachable)" in said, said
    assert "paused" not in said.split("Check them")[0], said
    assert "Restart the unreachable ones first" in said


def test_a_failed_worker_that_answered_paused_is_called_paused() -> None:
    result = _result(_worker("http://a", "failed", _PAUSED))
    said = result.next_step
    assert "http://a stay(s) paused" in said and "did not answer" not in said, said


def test_advice_from_the_router_names_its_routes_and_never_a_journal_writing_command() -> None:
    results = [
        _result(_worker("http://a", "failed", None)),
        _result(_worker("http://a", "fenced", _PAUSED), phase="fenced"),
        _result(_worker("http://a", "unchanged", _PAUSED), phase="aborted"),
        _result(_worker("http://a", "rolled_back", _PAUSED)),
    ]
    for result in results:
        cli, routed = result.advice(CLI_STEPS), result.advice(ROUTER_STEPS)
        assert "`weightsync fleet update`" in cli, cli
        assert "weightsync fleet update" not in routed and "weightsync fleet resume" not in routed, routed
        assert "POST /fleet/update_weights_from_disk" in routed, routed
    assert result.next_step == result.advice(CLI_STEPS)


def test_the_routers_advice_sends_its_routes_in_sentences() -> None:
    """Through the router the advice names routes (sent, not run) inside whole sentences: no
    route stands where a verb should (``then `POST …` them onto a checkpoint``)."""
    from weightsync.fleet.result import CLI_STEPS, ROUTER_STEPS

    for steps, verb in ((CLI_STEPS, "run"), (ROUTER_STEPS, "send")):
        assert steps.verb == verb
        said = _result(_worker("http://a", "failed", _PAUSED)).advice(steps)
        assert f"({verb} {steps.update})" in said and f"then {steps.update} them" not in said


def _refused(code: str, policy: str = "rollback") -> TransactionResult:
    workers = (
        WorkerOutcome("http://a", "refused", code=code, holds=_PAUSED),
        _worker("http://b", "unchanged", _PAUSED),
    )
    return TransactionResult(1, "aborted", "v1", None, None, policy, workers, code="prepare_refused")


def test_a_prepare_refused_for_a_dead_worker_names_the_fence_policy_where_it_would_help() -> None:
    """Failed on the previous code: one dead worker made every update ``prepare_refused``
    with no hint that the fence policy commits the others."""
    said = _refused("unreachable").next_step
    assert "http://a did not answer" in said and "`--policy fence`" in said, said
    assert "fence" not in _refused("unreachable", policy="fence").next_step  # it was already the policy
    assert "fence" not in _refused("bad_checkpoint").next_step  # a refusal fencing would not fix


def test_no_way_back_names_each_interfaces_own_way_to_give_one() -> None:
    cli = _refused("no_rollback_source")
    assert "--initial-source" in cli.next_step and "`--policy fence`" in cli.next_step, cli.next_step
    router = cli.advice(ROUTER_STEPS)
    assert '"policy": "fence"' in router and "--policy" not in router, router
    ray = attrs.evolve(cli, steps=RAY_STEPS)
    said = ray.next_step
    assert "initial_source=" in said and "restore=" in said and 'policy="fence"' in said, said
    assert "weightsync fleet" not in said and "--" not in said, said  # no command line reaches an actor
    assert ray.to_json()["next_step"] == said and "steps" not in ray.to_json()


def test_a_ray_fleets_advice_names_its_methods_not_the_command_line() -> None:
    result = attrs.evolve(_result(_worker("http://w0.rl.ray:80", "failed", _PAUSED)), steps=RAY_STEPS)
    said = result.next_step
    assert "`RayFleet.status()`" in said and "`RayFleet.update(path, version)`" in said, said
    assert "weightsync fleet" not in said
    assert CLI_STEPS.status not in said


def test_every_interfaces_advice_reads_as_sentences_with_its_own_verbs() -> None:
    """Failed on the previous code: through the router a fleet whose commit a push made was
    told to "Give the update a router started with `--initial-source` …", a RayFleet's
    untrusted epoch to "restart those actors with this journal and these workers (it checks
    their digests agree)", and everyone to "then run the update again", routes and methods
    included."""
    sourceless, untrusted = _refused("no_rollback_source"), _refused("untrusted_epoch")
    untrusted = attrs.evolve(
        untrusted,
        workers=tuple(attrs.evolve(w, codes=(w.code,) if w.code else ()) for w in untrusted.workers),
    )
    routed = sourceless.advice(ROUTER_STEPS)
    assert "Restart the router with `--initial-source` naming a checkpoint" in routed, routed
    assert "Give the update a router" not in routed
    assert "Give the update `--initial-source`" in sourceless.advice(CLI_STEPS)
    for steps in (CLI_STEPS, ROUTER_STEPS, RAY_STEPS):
        said = untrusted.advice(steps)
        assert said.endswith(f"then {steps.verb} the update again ({steps.update})"), said
        assert "actors with this journal" not in said, said
    assert "stop the router and run `weightsync fleet adopt` with its journal" in untrusted.advice(
        ROUTER_STEPS
    )
