"""Fleet transactions from a trainer's push: a real gloo group between a ``Broadcaster`` and
real worker servers on loopback (new: the old coordinator ran from disk checkpoints only)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.helpers import perturbed
from tests.workers import Worker
from weightsync.fleet import Event, FleetCoordinator
from weightsync.fleet.coordinator import RESULT_S
from weightsync.fleet.push import push_transaction
from weightsync.trainer import Broadcaster, save_checkpoint, weights_digest

pytestmark = pytest.mark.slow


def setup(make_worker: Callable[..., Worker], n: int = 2) -> tuple[list[Worker], dict[str, torch.Tensor]]:
    workers = [make_worker() for _ in range(n)]
    old = {k: v.clone() for k, v in workers[0].engine.model.weights().items()}
    return workers, old


def test_a_push_transaction_commits_the_trainers_digest(make_worker: Callable[..., Worker]) -> None:
    workers, old = setup(make_worker)
    new = perturbed(old, seed=3)
    urls = [w.url for w in workers]

    async def go() -> Any:
        b = Broadcaster(urls, timeout_s=20)
        await b.aconnect()
        try:
            return await push_transaction(FleetCoordinator(urls), b, new, "step-1")
        finally:
            await b.aclose()

    result = asyncio.run(go())
    assert result.ok and result.expected_digest == weights_digest(new)
    assert {(w.holds or {}).get("digest") for w in result.workers} == {weights_digest(new)}
    assert all(w.serving and w.holds and w.holds["version"] == "step-1" for w in result.workers)


def test_a_push_transaction_rolls_back_by_re_pushing_when_one_worker_fails(
    make_worker: Callable[..., Worker],
) -> None:
    workers, old = setup(make_worker)
    new = perturbed(old, seed=4)
    urls = [w.url for w in workers]
    victim = workers[1]

    def tamper(event: Event) -> None:  # weights changed behind the control plane after the push
        if event.worker == victim.url and event.what == "loaded":
            with torch.no_grad():
                next(iter(victim.engine.model.parameters())).add_(1.0)

    async def go() -> Any:
        b = Broadcaster(urls, timeout_s=20)
        await b.aconnect()
        try:
            coordinator = FleetCoordinator(
                urls, on_event=tamper, live_verify=True
            )  # a write behind the control plane
            return await push_transaction(coordinator, b, new, "step-1", restore=old)
        finally:
            await b.aclose()

    result = asyncio.run(go())
    assert result.phase == "rolled_back" and "digest_mismatch" in result.worker(victim.url).codes
    # every worker was re-pushed the weights the caller handed back, and serves them again
    assert [v["digest"] for v in result.fleet["versions"]] == [weights_digest(old)]
    assert result.fleet["serving"] == urls


def test_a_bare_error_out_of_the_push_is_every_workers_outcome_not_an_escape(
    make_worker: Callable[..., Worker],
) -> None:
    """Failed on the old code: only ``PushFailed`` was caught, so a bare collective error
    (gloo's ``RuntimeError``) escaped ``push_transaction`` and left the transaction unfinished."""
    workers, old = setup(make_worker)
    urls = [w.url for w in workers]

    async def go() -> Any:
        b = Broadcaster(urls, timeout_s=20)
        await b.aconnect()

        async def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("[gloo] Connection closed by peer")

        b.apush = broken  # type: ignore[method-assign]
        try:
            return await push_transaction(FleetCoordinator(urls), b, perturbed(old, seed=5), "step-1")
        finally:
            await b.aclose()

    result = asyncio.run(go())
    assert not result.committed and result.phase in ("rolled_back", "aborted", "failed"), result.to_json()
    assert all("push_failed" in w.codes for w in result.workers), result.to_json()
    assert {(w.holds or {}).get("digest") for w in result.workers} == {weights_digest(old)}


def test_push_after_push_commits_with_an_initial_source(make_worker: Callable[..., Worker]) -> None:
    """Failed on the old code: after a push committed, the journal knew no checkpoint of
    the workers' weights, so the next transaction dry-ran the initial source against them
    and every push after the first aborted with ``initial_source_mismatch``."""
    workers, old = setup(make_worker)
    urls = [w.url for w in workers]
    initial_sources = {w.url: str(save_checkpoint(old, w.root / "step-0")) for w in workers}

    async def go() -> list[Any]:
        b = Broadcaster(urls, timeout_s=20)
        await b.aconnect()
        try:
            results = []
            for seed in (6, 7):
                coordinator = FleetCoordinator(
                    urls, journal=workers[0].root / "j.db", initial_source=initial_sources
                )
                results.append(
                    await push_transaction(coordinator, b, perturbed(old, seed=seed), f"step-{seed}")
                )
            return results
        finally:
            await b.aclose()

    first, second = asyncio.run(go())
    assert first.ok and second.ok, second.to_json()
    assert second.fleet["versions"] == [
        {
            "version": "step-7",
            "epoch": second.epoch,
            "digest": weights_digest(perturbed(old, seed=7)),
            "workers": urls,
        }
    ]


def test_a_re_push_that_never_ends_cannot_hold_the_rollback_past_its_own_time(
    make_worker: Callable[..., Worker],
) -> None:
    """Failed on the old code: the rollback's re-push was awaited without a bound (a stopped
    worker holds a collective until the group's timeout, or for ever), so the transaction
    ended long after its deadline and the rollback's ``cleanup_s``."""
    workers, old = setup(make_worker)
    new = perturbed(old, seed=6)
    urls = [w.url for w in workers]
    victim = workers[1]

    def tamper(event: Event) -> None:  # the victim's weights change after the push: verify fails
        if event.worker == victim.url and event.what == "loaded":
            with torch.no_grad():
                next(iter(victim.engine.model.parameters())).add_(1.0)

    deadline_s, cleanup_s = 10.0, 2.0

    async def go() -> Any:
        b = Broadcaster(urls, timeout_s=20)
        await b.aconnect()
        real = b.apush
        pushes = 0

        async def hangs_the_second_time(*args: Any, **kwargs: Any) -> Any:
            nonlocal pushes
            pushes += 1
            if pushes > 1:  # the rollback's re-push of the old weights
                await asyncio.Event().wait()
            return await real(*args, **kwargs)

        b.apush = hangs_the_second_time  # type: ignore[method-assign]
        try:
            coordinator = FleetCoordinator(urls, on_event=tamper, cleanup_s=cleanup_s, live_verify=True)
            started = time.monotonic()
            result = await push_transaction(coordinator, b, new, "step-1", restore=old, deadline_s=deadline_s)
            return result, time.monotonic() - started
        finally:
            await b.aclose()

    result, took = asyncio.run(go())
    assert result.phase == "rollback_failed", result.to_json()
    assert {"timeout"} <= set(result.worker(victim.url).codes), result.to_json()
    # what docs/fleet.md promises (no commit was sent, so none was in doubt), and 5 s for a
    # loaded machine
    assert took <= deadline_s + cleanup_s + min(cleanup_s, RESULT_S) + 5, took


def test_a_disk_update_after_a_push_commit_needs_a_way_back_before_it_writes_anything(
    make_worker: Callable[..., Worker],
) -> None:
    """Failed on the old code: after a push committed, a disk transaction went ahead with no
    checkpoint of the pushed weights; when one worker failed, the others could not be
    restored (``no_rollback_source``) and stayed paused — nobody served.  Now it is refused at
    prepare (nothing paused, nothing written, the advice names the two ways out); with a
    checkpoint of the pushed weights as the initial source a failure rolls every worker back
    onto them; under the fence policy the failing worker is fenced and the others commit."""
    workers, old = setup(make_worker, 3)
    urls = [w.url for w in workers]
    pushed, step2 = perturbed(old, seed=8), perturbed(old, seed=9)
    journal = workers[0].root / "j.db"
    victim = workers[2]
    step2_at = {w.url: str(save_checkpoint(step2, w.root / "step-2")) for w in workers}
    pushed_at = {w.url: str(save_checkpoint(pushed, w.root / "step-1")) for w in workers}

    def tamper(event: Event) -> None:  # the victim's weights change behind the control plane
        if event.worker == victim.url and event.what == "loaded":
            with torch.no_grad():
                next(iter(victim.engine.model.parameters())).add_(1.0)

    async def go() -> list[Any]:
        b = Broadcaster(urls, timeout_s=20)
        await b.aconnect()
        try:
            first = await push_transaction(FleetCoordinator(urls, journal=journal), b, pushed, "step-1")
        finally:
            await b.aclose()
        assert first.ok, first.to_json()
        refused = await FleetCoordinator(urls, journal=journal, on_event=tamper, live_verify=True).update(
            step2_at, "step-2"
        )
        restored = await FleetCoordinator(
            urls, journal=journal, on_event=tamper, live_verify=True, initial_source=pushed_at
        ).update(step2_at, "step-2")
        fenced = await FleetCoordinator(urls, journal=journal, on_event=tamper, live_verify=True).update(
            step2_at, "step-2", policy="fence"
        )
        return [refused, restored, fenced]

    refused, restored, fenced = asyncio.run(go())
    # refused before any worker was paused or written: every one still serves the push's commit
    assert refused.phase == "aborted" and {w.code for w in refused.workers} == {"no_rollback_source"}
    assert {(w.holds or {}).get("version") for w in refused.workers} == {"step-1"}
    assert refused.fleet["serving"] == urls
    assert "--initial-source" in refused.next_step and "--policy fence" in refused.next_step
    # a checkpoint of the pushed weights: the victim's failure rolls everyone back onto them
    assert restored.phase == "rolled_back" and "digest_mismatch" in restored.worker(victim.url).codes
    assert {(w.holds or {}).get("version") for w in restored.workers} == {"step-1"}
    assert {(w.holds or {}).get("digest") for w in restored.workers} == {weights_digest(pushed)}
    assert restored.fleet["serving"] == urls
    # the fence policy needs no way back: the two healthy workers commit and serve step-2
    assert fenced.committed and fenced.worker(victim.url).outcome == "fenced", fenced.to_json()
    serving = [(w.url, (w.holds or {}).get("version")) for w in fenced.workers if w.serving]
    assert serving == [(urls[0], "step-2"), (urls[1], "step-2")], fenced.to_json()
