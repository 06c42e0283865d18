"""``weightsync.ray.RayFleet`` on a real local Ray cluster: fleet transactions over worker
actors from disk and from a trainer actor's push, an actor killed as apply or as commit
starts, an actor Ray restarts after a commit (behind a router) admitted onto the commit, a
driver killed mid-transaction and a new driver recovering from the same journal.

The tests share two named actors and one journal, and run in file order: each leaves the
fleet on one committed version for the next."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed (make test installs it)")

from tests.helpers import TINY, free_port  # noqa: E402
from tests.integration.test_http import wait_until  # noqa: E402
from tests.ray_cluster import SMALL, FleetDriver, PushTrainer, local_cluster, new_weights  # noqa: E402
from weightsync.engines.reference import ReferenceEngine  # noqa: E402
from weightsync.fleet import Journal  # noqa: E402
from weightsync.fleet.events import Event  # noqa: E402
from weightsync.fleet.result import TransactionResult  # noqa: E402
from weightsync.fleet.urls import worker_url  # noqa: E402
from weightsync.ray import ActorRef, RayFleet, WorkerActor  # noqa: E402
from weightsync.router import Router  # noqa: E402
from weightsync.router.app import create_router_app  # noqa: E402
from weightsync.serve import ServerThread  # noqa: E402
from weightsync.trainer import save_checkpoint, weights_digest  # noqa: E402

pytestmark = pytest.mark.slow

NAMESPACE = "weightsync-tests"
NAMES = ["fleet-w0", "fleet-w1"]


class Workers:
    """Two named worker actors; one a test killed is started again under its name."""

    def __init__(self, root: Path) -> None:
        self.root = root
        # what a started actor holds (the tiny model's seeded weights): the first transaction's
        # rollback source, which prepare checks against the actors' digests
        self.old = str(save_checkpoint(dict(ReferenceEngine(TINY).model.weights()), root / "initial"))
        self.handles: dict[str, Any] = {}

    def start(self, name: str) -> Any:
        self.handles[name] = WorkerActor.options(name=name, namespace=NAMESPACE, **SMALL).remote(
            model_config="tiny", replica_index=NAMES.index(name), allowed_weight_dirs=[str(self.root)],
        )  # fmt: skip
        return self.handles[name]

    def alive(self) -> None:
        """Every worker answering, those that died started again (on the initial weights)."""
        for name in NAMES:
            handle = self.handles.get(name)
            try:
                ray.get(handle.ready.remote(), timeout=60) if handle is not None else None
            except ray.exceptions.RayActorError:
                handle = None
            if handle is None:
                handle = self.start(name)
                ray.get(handle.ready.remote(), timeout=120)

    def checkpoint(self, seed: int) -> str:
        path = self.root / f"step-{seed}"
        return str(path) if path.exists() else str(save_checkpoint(new_weights(seed), path))

    def fleet(self, journal: Path | None = None, **options: Any) -> RayFleet:
        options.setdefault("initial_source", self.old)
        options.setdefault("cleanup_s", 30.0)
        return RayFleet(NAMES, namespace=NAMESPACE, journal=journal or self.root / "fleet.db", **options)


@pytest.fixture(scope="module")
def module_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    local_cluster()
    workers = Workers(tmp_path_factory.mktemp("ray-fleet"))
    try:
        yield workers
    finally:
        for handle in workers.handles.values():
            ray.kill(handle)


@pytest.fixture
def workers(module_workers: Workers) -> Workers:
    module_workers.alive()
    return module_workers


def on_one_version(fleet: RayFleet, result: TransactionResult) -> tuple[Any, int | None, str | None]:
    """Every actor that serves holds one (version, epoch, digest), as the result says; that
    triple."""
    now = {s.url: s.reply for s in fleet.status()}
    serving = {u: r for u, r in now.items() if r is not None and not r["paused"]}
    held = {(r["version"], r["epoch"], r["digest"]) for r in serving.values()}
    assert len(held) == 1 and not any(r["torn"] for r in serving.values()), now
    for w in result.workers:  # the result is what the actors report
        assert (w.holds is None) == (now[w.url] is None), (w, now[w.url])
        if w.holds is not None:
            assert (w.holds["version"], w.holds["digest"]) == (now[w.url]["version"], now[w.url]["digest"])
    return held.pop()


def dead(handle: Any) -> None:
    """Wait until ``handle``'s actor is dead: ``ray.kill`` only asks Ray to end it, and a call
    that reaches the actor first is still answered."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            ray.get(handle.ready.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)
    raise AssertionError("the killed actor still answers")


def kill_at(workers: Workers, phase: str, name: str) -> Callable[[Event], None]:
    """An ``on_event`` that kills the actor ``name`` as the transaction enters ``phase``,
    before the phase sends anything: the phase's calls find it dead."""

    def hook(event: Event) -> None:
        if event.phase == phase and event.worker is None and name in workers.handles:
            handle = workers.handles.pop(name)
            ray.kill(handle)
            dead(handle)

    return hook


def test_a_disk_transaction_commits_on_every_actor_and_status_pause_resume_reach_them(
    workers: Workers,
) -> None:
    fleet = workers.fleet()
    result = fleet.update_sync(workers.checkpoint(1), version="step-1")
    assert result.ok and [w.outcome for w in result.workers] == ["committed", "committed"]
    assert on_one_version(fleet, result) == ("step-1", result.epoch, weights_digest(new_weights(1)))
    assert [s.url for s in fleet.status()] == ["http://fleet-w0.weightsync-tests.ray:80",
                                               "http://fleet-w1.weightsync-tests.ray:80"]  # fmt: skip
    import asyncio

    assert all(s.reply["paused"] for s in asyncio.run(fleet.pause()))
    assert all(not s.reply["paused"] for s in asyncio.run(fleet.resume()))


def test_push_transactions_from_a_trainer_actor_commit_its_tensors_on_every_actor(workers: Workers) -> None:
    """The trainer is a Ray actor: it forms the gloo group with the worker actors (their
    admin calls over Ray, the tensors over the group) and runs the fleet transactions, one
    per step; after each, every actor serves the trainer's tensors under the new version,
    epoch and digest.  (The next test's disk transaction then starts from pushed weights.)"""
    trainer = PushTrainer.remote(NAMES, NAMESPACE, str(workers.root / "fleet.db"), workers.old)  # type: ignore[attr-defined]
    fleet = workers.fleet()
    try:
        for seed in (7, 8):
            result = ray.get(trainer.push.remote(seed, f"pushed-{seed}"), timeout=180)
            assert result.ok and result.phase == "committed", result.to_json()
            assert [w.outcome for w in result.workers] == ["committed", "committed"]
            assert result.expected_digest == weights_digest(new_weights(seed))
            assert on_one_version(fleet, result) == (f"pushed-{seed}", result.epoch, result.expected_digest)
        ray.get(trainer.close.remote(), timeout=60)
    finally:
        ray.kill(trainer)


def test_after_a_push_commit_a_disk_transaction_needs_a_way_back_and_fence_serves_through_a_dead_actor(
    workers: Workers,
) -> None:
    """The fleet is on the previous test's pushed weights: no checkpoint of them exists.
    Failed on the previous code: a disk transaction went ahead, an actor died as apply began,
    and the survivor could not be restored (``no_rollback_source``): every replica stayed
    paused, and the advice named CLI commands that cannot reach an actor.  Now the update is
    refused at prepare, nothing paused (both still serve the push's commit), the advice in
    RayFleet terms; under ``policy="fence"`` the same death fences the dead actor and the
    survivor commits and serves."""
    fleet = workers.fleet(on_event=kill_at(workers, "applying", NAMES[1]))
    pushed = {(s.reply or {}).get("version") for s in fleet.status()}
    assert pushed == {"pushed-8"}, pushed  # (the previous test's last push)
    refused = fleet.update_sync(workers.checkpoint(1), version="step-1-after-push")
    assert refused.phase == "aborted", refused.to_json()
    assert {w.code for w in refused.workers} == {"initial_source_mismatch"}  # the initial source is not it
    assert all(s.reply is not None and not s.reply["paused"] for s in fleet.status())  # none was paused
    said = refused.next_step
    assert "weightsync fleet" not in said and "RayFleet.update(path, version)" in said, said
    alive, killed = fleet.workers
    result = fleet.update_sync(
        workers.checkpoint(1), version="step-1-after-push", policy="fence", min_workers=1
    )
    assert result.phase == "fenced" and result.ok, result.to_json()
    assert [w.outcome for w in result.workers] == ["committed", "fenced"], result.to_json()
    assert "unreachable" in result.worker(killed).codes
    assert on_one_version(fleet, result) == (
        "step-1-after-push",
        result.epoch,
        weights_digest(new_weights(1)),
    )
    assert [s.url for s in fleet.status() if s.reply is not None] == [alive]


@pytest.mark.parametrize("phase", ["applying", "committing"])
def test_an_actor_killed_mid_transaction_leaves_every_serving_actor_on_one_version(
    workers: Workers, phase: str
) -> None:
    """Killed as apply starts (before it is paused), or as commit starts (both actors hold
    step-2, verified, paused): under ``rollback`` the other actor is taken back to step-1
    under a new epoch and serves, and the result says the dead one could not be restored."""
    fleet = workers.fleet()
    base = fleet.update_sync(workers.checkpoint(1), version="step-1")
    assert base.ok
    alive, killed = fleet.workers
    fleet = workers.fleet(on_event=kill_at(workers, phase, NAMES[1]))
    result = fleet.update_sync(workers.checkpoint(2), version=f"step-2-{phase}")
    assert result.phase == "rollback_failed" and not result.ok, result.to_json()
    assert [w.outcome for w in result.workers] == ["rolled_back", "failed"], result.to_json()
    assert result.worker(killed).holds is None and "unreachable" in result.worker(killed).codes
    assert result.epoch is not None and base.epoch is not None and result.epoch > base.epoch
    assert on_one_version(fleet, result) == ("step-1", result.epoch, weights_digest(new_weights(1)))
    assert [s.url for s in fleet.status() if s.reply is not None] == [alive]


def test_an_actor_killed_during_commit_under_fence_is_fenced_and_the_other_serves_the_new_version(
    workers: Workers,
) -> None:
    """Under ``fence`` with a quorum of one, the actor that died as commit began is fenced
    and the other commits: the new version stands where it was committed, and the result
    names the fenced actor."""
    fleet = workers.fleet()
    assert fleet.update_sync(workers.checkpoint(1), version="step-1").ok
    alive, killed = fleet.workers
    fleet = workers.fleet(on_event=kill_at(workers, "committing", NAMES[1]))
    result = fleet.update_sync(workers.checkpoint(2), version="step-2-fenced", policy="fence", min_workers=1)
    assert result.phase == "fenced" and result.ok, result.to_json()
    assert [w.outcome for w in result.workers] == ["committed", "fenced"], result.to_json()
    assert result.worker(killed).holds is None and "unreachable" in result.worker(killed).codes
    assert on_one_version(fleet, result) == ("step-2-fenced", result.epoch, weights_digest(new_weights(2)))
    assert [s.url for s in fleet.status() if s.reply is not None] == [alive]


def test_an_actor_started_again_under_its_name_is_brought_onto_the_next_commit(workers: Workers) -> None:
    """The workers fixture started the actor killed above again: fresh seeded weights, no
    version; the next transaction reaches it by name and commits on both."""
    fleet = workers.fleet()
    result = fleet.update_sync(workers.checkpoint(3), version="step-3")
    assert result.ok
    assert on_one_version(fleet, result) == ("step-3", result.epoch, weights_digest(new_weights(3)))


def restarted(actor: Any) -> dict[str, Any]:
    """``actor``'s ``ready()`` once Ray restarted it (calls fail while it is down)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            ready = ray.get(actor.ready.remote(), timeout=60)
        except ray.exceptions.RayActorError:
            ready = None
        if ready is not None and ready["restarted"]:
            return dict(ready)
        time.sleep(0.1)
    raise AssertionError("Ray did not restart the actor")


def test_an_actor_ray_restarts_after_a_commit_is_routed_to_only_once_admitted_onto_the_commit(
    module_workers: Workers,
) -> None:
    """A worker actor with ``max_restarts=1`` serving its HTTP app behind a router (which
    follows the fleet's journal), killed after a commit: Ray brings it back on the weights
    it was started with, paused, so the router routes nothing to it; ``RayFleet.admit``
    takes it onto the committed version, epoch and digest, and only then does the router
    route to it."""
    root = module_workers.root
    name = "restarting-w"
    actor = WorkerActor.options(name=name, namespace=NAMESPACE, max_restarts=1, **SMALL).remote(
        model_config="tiny", allowed_weight_dirs=[str(root)], serve_http=True, port=free_port()
    )
    try:
        url = ray.get(actor.ready.remote(), timeout=120)["url"]
        journal = root / "restarting.db"
        fleet = RayFleet(
            [ActorRef(name=name, namespace=NAMESPACE, url=url)],
            journal=journal,
            initial_source=module_workers.old,
        )
        committed = fleet.update_sync(module_workers.checkpoint(5), version="step-5")
        assert committed.ok and fleet.workers == [worker_url(url)], committed.to_json()
        commit = ("step-5", committed.epoch, weights_digest(new_weights(5)))
        started_on = weights_digest(dict(ReferenceEngine(TINY).model.weights()))
        router = Router(
            [url], journal=journal, follow_journal=True, poll_interval_s=0.1, request_timeout_s=60
        )
        with ServerThread(create_router_app(router)) as server:

            def seen() -> dict[str, Any]:
                return dict(httpx.get(f"{server.url}/fleet/status", timeout=10).json()["workers"][0])

            def complete() -> httpx.Response:
                return httpx.post(
                    f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60
                )

            wait_until(lambda: seen()["routable"], timeout=30)
            assert complete().json()["weight_epoch"] == committed.epoch

            ray.kill(actor, no_restart=False)  # Ray restarts it: max_restarts=1
            assert restarted(actor)["url"] == url  # its app on the same port
            now = ray.get(actor.get_weight_version.remote(), timeout=60)
            assert now["paused"] and not now["version_declared"] and now["digest"] == started_on, now
            wait_until(lambda: seen()["digest"] == started_on, timeout=30)  # the router saw it
            assert not seen()["routable"]
            refused = complete()
            assert refused.status_code == 503 and refused.json()["code"] == "no_worker", refused.text

            admission = fleet.admit_sync()
            assert admission.ok and (admission.version, admission.epoch, admission.digest) == commit
            now = ray.get(actor.get_weight_version.remote(), timeout=60)
            assert (now["version"], now["epoch"], now["digest"]) == commit and not now["paused"], now
            wait_until(lambda: seen()["routable"], timeout=30)
            routed = complete()
            assert routed.status_code == 200 and routed.json()["weight_epoch"] == committed.epoch, routed.text
    finally:
        ray.kill(actor)


def test_a_new_driver_recovers_the_transaction_of_a_driver_killed_mid_transaction(workers: Workers) -> None:
    """The driver is killed with the new weights loaded on every actor (paused), not yet
    verified; a new driver with the same journal and actor names finishes or rolls back, and
    every actor serves again on one version."""
    journal = workers.root / "fleet.db"  # the journal that knows what the fleet committed
    driver = FleetDriver.remote()  # type: ignore[attr-defined]
    running = driver.update.remote(NAMES, NAMESPACE, str(journal), workers.old, workers.checkpoint(4),
                                   "step-4", "verifying")  # fmt: skip
    deadline = time.monotonic() + 120
    while True:  # until the driver stalls with the new weights loaded, not yet committed
        assert time.monotonic() < deadline, "the driver never reached verifying"
        ready, _ = ray.wait([running], timeout=0.1)
        assert not ready, ray.get(running)  # it must not have finished (or failed)
        if journal.exists():
            unfinished = Journal(journal, must_exist=True).unfinished()
            if unfinished and unfinished[0][2].phase == "verifying":
                break
    ray.kill(driver)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(running, timeout=60)
    fleet = workers.fleet(journal=journal)
    results = fleet.recover_sync(wait_s=60)  # its lease, if its death is not seen at once
    assert len(results) == 1 and results[0].phase in ("committed", "rolled_back")
    version, _, digest = on_one_version(fleet, results[0])
    if results[0].ok:
        assert (version, digest) == ("step-4", weights_digest(new_weights(4)))
    else:  # back on what the journal last committed
        assert (version, digest) == ("step-3", weights_digest(new_weights(3)))
    assert Journal(journal, must_exist=True).unfinished() == []
