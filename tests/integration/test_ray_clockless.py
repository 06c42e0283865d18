"""A worker actor of the shape before the ``clock`` route (a class without a ``clock``
method) in a ``RayFleet`` on a real local Ray cluster: prepare's reading of its clock is a
route that is not there, as a 404 ``unknown_route`` is over HTTP, so the transaction sends
it the coordinator's deadline unchanged and commits, instead of failing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed (make test installs it)")

from tests.helpers import TINY  # noqa: E402
from tests.ray_cluster import SMALL, local_cluster, new_weights  # noqa: E402
from weightsync.engines.reference import ReferenceEngine  # noqa: E402
from weightsync.fleet.events import Event  # noqa: E402
from weightsync.ray import RayFleet, WorkerActor  # noqa: E402
from weightsync.ray.worker import DEFAULT_OPTIONS, Worker  # noqa: E402
from weightsync.trainer import save_checkpoint, weights_digest  # noqa: E402

pytestmark = pytest.mark.slow

NAMESPACE = "weightsync-tests"

OlderWorker = type(
    "OlderWorker",
    (),
    {k: v for k, v in vars(Worker).items() if k not in ("clock", "__dict__", "__weakref__")},
)
"""The worker actor's body as it was before the ``clock`` route: every other method."""

OlderWorkerActor = ray.remote(**DEFAULT_OPTIONS)(OlderWorker)


@pytest.fixture
def actors(tmp_path: Path) -> Iterator[tuple[Path, list[Any]]]:
    local_cluster()
    made = {"clockless-w0": OlderWorkerActor, "clocked-w1": WorkerActor}
    handles = [
        cls.options(name=name, namespace=NAMESPACE, **SMALL).remote(  # type: ignore[attr-defined]
            model_config="tiny", replica_index=i, allowed_weight_dirs=[str(tmp_path)]
        )
        for i, (name, cls) in enumerate(made.items())
    ]
    try:
        ray.get([h.ready.remote() for h in handles], timeout=120)
        yield tmp_path, handles
    finally:
        for handle in handles:
            ray.kill(handle)


def test_an_actor_without_a_clock_method_reads_as_no_clock_route_and_the_transaction_commits(
    actors: tuple[Path, list[Any]],
) -> None:
    root, (old, _) = actors
    assert not hasattr(OlderWorker, "clock") and hasattr(Worker, "clock")
    with pytest.raises(AttributeError):
        old.clock  # noqa: B018  (Ray knows the actor has no such method)
    initial = save_checkpoint(dict(ReferenceEngine(TINY).model.weights()), root / "initial")
    step = save_checkpoint(new_weights(3), root / "step-3")
    events: list[Event] = []
    fleet = RayFleet(
        ["clockless-w0", "clocked-w1"], namespace=NAMESPACE, journal=root / "fleet.db",
        initial_source=str(initial), cleanup_s=30.0, on_event=events.append,
    )  # fmt: skip
    result = fleet.update_sync(str(step), version="step-3")
    assert result.ok and result.phase == "committed", result.to_json()
    assert [w.outcome for w in result.workers] == ["committed", "committed"], result.to_json()
    assert not [e for e in events if "coordinator_error" in e.detail], [e.line() for e in events]
    now = {s.url: s.reply for s in fleet.status()}
    assert {(r["version"], r["epoch"], r["digest"], r["paused"]) for r in now.values()} == {
        ("step-3", result.epoch, weights_digest(new_weights(3)), False)
    }
