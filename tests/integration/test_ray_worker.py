"""``weightsync.ray.WorkerActor`` on a real local Ray cluster: the admin routes as methods,
refusals through Ray with their codes, the HTTP app beside them, and vLLM's own
``RayVLLMWeightSyncClient`` (imported unchanged) driving two actors through a weight update
a trainer actor broadcasts over gloo."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests

ray = pytest.importorskip("ray", reason="the ray extra is not installed (make test installs it)")

from tests.helpers import free_port  # noqa: E402
from tests.ray_cluster import SMALL, GlooTrainer, local_cluster, new_weights, update_info  # noqa: E402
from weightsync.core.errors import IllegalState, InvalidRequest, NotFound, WeightSyncError  # noqa: E402
from weightsync.core.routes import ROUTES  # noqa: E402
from weightsync.ray import WorkerActor  # noqa: E402
from weightsync.trainer import save_checkpoint, weights_digest  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ray-worker")


@pytest.fixture(scope="module")
def actors(root: Path) -> Iterator[list[Any]]:
    """Two worker actors (replicas 0 and 1) on the tiny reference engine; the first also
    serves its HTTP app.  vLLM's client starts updates on serving engines: both pause for them."""
    local_cluster()
    made = [
        WorkerActor.options(**SMALL).remote(
            model_config="tiny",
            replica_index=i,
            allowed_weight_dirs=[str(root)],
            auto_pause_updates=True,
            serve_http=i == 0,
        )
        for i in range(2)
    ]
    try:
        ray.get([a.ready.remote() for a in made], timeout=120)
        yield made
    finally:
        for a in made:
            ray.kill(a)


def state(actor: Any) -> dict[str, Any]:
    return dict(ray.get(actor.get_weight_version.remote(), timeout=60))


def test_every_admin_route_is_an_actor_method_that_answers_its_reply(actors: list[Any]) -> None:
    from weightsync.ray.worker import Worker

    assert all(callable(getattr(Worker, name, None)) for name in ROUTES)
    routes = ray.get(actors[0].routes.remote(), timeout=60)
    assert routes["routes"] == sorted(ROUTES) and routes["engine"] == "reference"
    reply = ray.get(actors[1].set_weight_version.remote(weight_version={"step": 0}), timeout=60)
    assert reply["status"] == "ok" and reply["version"] == {"step": 0}
    assert state(actors[1])["version"] == {"step": 0}


def test_a_refusal_is_the_same_error_family_and_code_through_ray_and_changes_nothing(
    actors: list[Any],
) -> None:
    before = state(actors[0])
    with pytest.raises(InvalidRequest) as bad:
        ray.get(actors[0].pause_generation.remote(mode="sideways"), timeout=60)
    assert bad.value.code == "invalid_value" and bad.value.details["field"] == "mode"
    with pytest.raises(InvalidRequest) as unknown:
        ray.get(actors[0].pause_generation.remote(mode="keep", colour="red"), timeout=60)
    assert unknown.value.code == "unknown_field"
    with pytest.raises(NotFound) as missing:
        ray.get(
            actors[0].update_weights_from_disk.remote(
                model_path="/no/such/checkpoint", allow_unpaused=True, reset_prefix_cache=False
            ),
            timeout=60,
        )
    assert missing.value.code == "path_not_found"
    with pytest.raises(IllegalState) as running:  # a session needs a paused worker
        ray.get(actors[0].begin_weight_update.remote(), timeout=60)
    assert isinstance(running.value, WeightSyncError) and running.value.code == "not_paused"
    assert state(actors[0]) == before


def test_a_disk_update_through_the_actor_and_its_http_app_agree(actors: list[Any], root: Path) -> None:
    new = new_weights(seed=3)
    path = str(save_checkpoint(new, root / "disk-3"))
    actor = actors[0]
    ray.get(actor.pause_generation.remote(mode="abort"), timeout=60)
    reply = ray.get(
        actor.update_weights_from_disk.remote(model_path=path, weight_version="disk-3"), timeout=120
    )
    ray.get(actor.resume_generation.remote(), timeout=60)
    assert reply["version"] == "disk-3" and reply["digest"] == weights_digest(new)
    url = ray.get(actor.ready.remote(), timeout=60)["url"]
    over_http = requests.post(f"{url}/engine/get_weight_version", json={}, timeout=30).json()
    assert over_http == state(actor) and over_http["version"] == "disk-3" and not over_http["paused"]


def test_a_bad_argument_fails_the_actor_at_start_naming_it() -> None:
    local_cluster()
    for bad, named in (({"model_config": "huge"}, "model_config"), ({"colour": 1}, "colour")):
        actor = WorkerActor.options(**SMALL).remote(**bad)
        with pytest.raises(ray.exceptions.RayActorError, match=named):
            ray.get(actor.ready.remote(), timeout=60)


def test_finish_with_a_version_commits_it_in_the_same_step(actors: list[Any]) -> None:
    actor = actors[1]
    ray.get(actor.start_weight_update.remote(), timeout=60)
    ray.get(actor.finish_weight_update.remote(weight_version="same-step"), timeout=60)
    now = state(actor)
    assert now["version"] == "same-step" and now["version_current"] and not now["paused"]


def _checkpoint(root: Path, seed: int) -> str:
    path = root / f"step-{seed}"
    return str(path) if path.exists() else str(save_checkpoint(new_weights(seed), path))


def test_vllms_client_finish_then_label_leaves_no_label_on_the_new_weights_in_between(
    actors: list[Any], root: Path
) -> None:
    """vLLM's client finishes, then labels in a second call: between the two the workers say
    their label does not describe the weights they now hold (``version_current: false``)."""
    from vllm.distributed.weight_transfer import RayVLLMWeightSyncClient

    client = RayVLLMWeightSyncClient(actors)
    client.start_weight_update()
    path = _checkpoint(root, seed=5)
    ray.get([a.update_weights_from_disk.remote(model_path=path, session=True) for a in actors], timeout=120)
    client.finish_weight_update()  # no version: vLLM's own client labels in another call
    assert all(not state(a)["version_current"] for a in actors)
    ray.get([a.update_weight_version.remote("labelled") for a in actors], timeout=60)
    assert all(state(a)["version"] == "labelled" and state(a)["version_current"] for a in actors)


def test_a_failed_finish_labels_no_actor_with_the_new_version(actors: list[Any], root: Path) -> None:
    """One actor has an update open that wrote, the other none: vLLM's client's finish fails
    on the second, and neither carries the new version."""
    from vllm.distributed.weight_transfer import RayVLLMWeightSyncClient

    ray.get(actors[0].start_weight_update.remote(), timeout=60)
    path = _checkpoint(root, seed=6)
    ray.get(actors[0].update_weights_from_disk.remote(model_path=path, session=True), timeout=120)
    with pytest.raises(IllegalState) as refused:
        RayVLLMWeightSyncClient(actors).finish_weight_update("never-labelled")
    assert refused.value.code == "no_session"
    assert all(state(a)["version"] != "never-labelled" for a in actors)
    assert not state(actors[0])["version_current"]  # new weights, under no label that names them


def _push_with_vllms_client(
    actors: list[Any], host: str, seed: int, timeout_s: float = 180, **init: Any
) -> None:
    """vLLM's ``RayVLLMWeightSyncClient`` drives ``actors`` through init, start, update and
    finish with a version while a trainer actor broadcasts ``new_weights(seed)``; ``host`` is
    how the trainer forms its group (``GlooTrainer`` method).  ``timeout_s`` leaves room for
    the trainer actor's start on a machine that runs other tests beside (``make test``)."""
    from vllm.distributed.weight_transfer import RayVLLMWeightSyncClient

    client = RayVLLMWeightSyncClient(actors)
    trainer = GlooTrainer.remote()  # type: ignore[attr-defined]
    try:
        # the trainer actor must be up before the workers wait for its rendezvous: on a loaded
        # machine its start can take longer than a join's timeout, and a join then fails saying
        # nothing listened, which hides where the time went
        try:
            ray.get(trainer.__ray_ready__.remote(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            pytest.fail(f"the trainer actor did not start in {timeout_s}s; free: {ray.available_resources()}")
        port = free_port()
        hosting = getattr(trainer, host).remote(port, 1 + len(actors))
        # one init_info for every handle: each actor's replica index gives it its own rank; the
        # trainer's side is watched meanwhile, so its failure (a port taken since it was picked)
        # is raised as itself at once rather than as the workers' rendezvous timing out
        with ThreadPoolExecutor(1) as pool:
            joining = pool.submit(
                client.init_weight_transfer_engine,
                {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                 "world_size": 1 + len(actors), "backend": "gloo", "timeout_s": timeout_s, **init},
            )  # fmt: skip
            while not joining.done():
                done, _ = ray.wait([hosting], timeout=0.5)
                if done:
                    ray.get(hosting)  # the trainer's side ended: raises its error, if any
                    break
            joining.result(timeout=timeout_s)
        ray.get(hosting, timeout=timeout_s)
        client.start_weight_update()
        sending = trainer.broadcast.remote(seed)
        client.update_weights(update_info(new_weights(seed)))
        ray.get(sending, timeout=timeout_s)
        client.finish_weight_update(f"pushed-{seed}")
        client.shutdown_weight_transfer_engine()
    finally:
        ray.kill(trainer)
    for actor in actors:
        now = state(actor)
        assert now["version"] == f"pushed-{seed}" and now["version_current"] and now["verified"]
        assert now["digest"] == weights_digest(new_weights(seed)) and not now["paused"]


def test_vllms_ray_client_pushes_to_two_actors_over_a_weightsync_hosted_gloo_group(
    actors: list[Any],
) -> None:
    # weightsync's own trainer forms a process_group: named in init_info (weightsync's extension)
    _push_with_vllms_client(actors, "host_weightsync", seed=21, rendezvous="process_group")


def test_vllms_ray_client_pushes_to_two_actors_from_a_plain_init_process_group_trainer(
    actors: list[Any],
) -> None:
    _push_with_vllms_client(actors, "host_plain", seed=22)


def test_a_detached_named_actor_is_found_and_answers_from_another_driver(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    address = local_cluster()["address"]
    actor = WorkerActor.options(name="detached-0", namespace="weightsync-tests", lifetime="detached",
                                **SMALL).remote(model_config="tiny", initial_version="kept")  # fmt: skip
    try:
        ray.get(actor.ready.remote(), timeout=120)
        other_driver = (
            "import ray\n"
            f"ray.init(address={address!r}, namespace='weightsync-tests', log_to_driver=False)\n"
            "print(ray.get(ray.get_actor('detached-0').get_weight_version.remote(), timeout=60)['version'])\n"
        )
        env = {**os.environ, "RAY_DISABLE_USAGE_STATS": "1"}
        out = subprocess.run([sys.executable, "-c", other_driver], capture_output=True, text=True,
                             timeout=120, env=env, cwd=tmp_path)  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip().splitlines()[-1] == "kept"
        assert state(actor)["version"] == "kept"  # the other driver's exit left it running
    finally:
        ray.kill(actor)
