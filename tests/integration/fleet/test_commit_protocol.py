"""The commit protocol over real worker apps in-process (ASGI), with a real SQLite journal.

Each docstring says whether the test failed on the coordinator this one replaced.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.integration.fleet.asgi import AsgiFleet, ok_without_doing_it, refuse
from weightsync.core.errors import InvalidRequest
from weightsync.fleet import FleetCoordinator

pytestmark = pytest.mark.integration


@pytest.fixture
def fleet(tmp_path: Path) -> AsgiFleet:
    return AsgiFleet(tmp_path, 3)


def test_a_transaction_commits_one_version_epoch_and_digest_everywhere(
    fleet: AsgiFleet, tmp_path: Path
) -> None:
    result = asyncio.run(fleet.coordinator(tmp_path / "j.db").update(fleet.new, "v1"))
    assert result.ok and result.phase == "committed" and result.epoch == 1
    assert fleet.serving() == {("v1", 1, fleet.new_digest)}
    assert result.fleet["versions"] == [
        {"version": "v1", "epoch": 1, "digest": fleet.new_digest, "workers": fleet.urls}
    ]
    again = asyncio.run(fleet.coordinator(tmp_path / "j.db").update(fleet.old, "v2"))
    assert again.ok and again.epoch == 2 and fleet.serving() == {("v2", 2, fleet.old_digest)}


def test_no_worker_resumes_before_every_worker_committed(fleet: AsgiFleet, tmp_path: Path) -> None:
    """Failed on the old code: each worker was declared and resumed on its own."""
    fleet.intercept(fleet.urls[2], "set_weight_version", refuse())
    result = asyncio.run(fleet.coordinator(tmp_path / "j.db").update(fleet.new, "v1"))
    # the victim refuses the rollback's re-declaration too: it stays paused, so the rollback
    # did not finish everywhere, and the phase says so
    assert not result.ok and result.phase == "rollback_failed"
    resumes = [i for i, (_, r) in enumerate(fleet.calls) if r == "resume_generation"]
    declares = [i for i, (_, r) in enumerate(fleet.calls) if r == "set_weight_version"]
    assert min(resumes) > declares[2]  # the commit's three declarations all came (and failed) first
    # every serving worker is back on the old weights and label, under one new epoch
    assert fleet.serving() == {("v0", result.epoch, fleet.old_digest)}
    assert result.epoch == 2  # the commit's epoch 1 was issued; the rollback's is higher
    assert {w.outcome for w in result.workers} == {"rolled_back"}
    assert result.worker(fleet.urls[2]).codes[0] == "digest_mismatch"


def test_a_200_from_set_weight_version_is_not_a_commit_until_read_back(
    fleet: AsgiFleet, tmp_path: Path
) -> None:
    """Failed on the old code: a 200 was taken as proof of the commit."""
    fleet.intercept(fleet.urls[1], "set_weight_version", ok_without_doing_it)
    result = asyncio.run(fleet.coordinator(tmp_path / "j.db").update(fleet.new, "v1"))
    assert not result.ok and "commit_not_read_back" in result.worker(fleet.urls[1]).codes
    assert fleet.serving() <= {("v0", result.epoch, fleet.old_digest)}
    assert len(fleet.serving()) == 1


def test_fence_fences_a_worker_down_before_prepare_when_the_quorum_holds(tmp_path: Path) -> None:
    """Failed on the old code: one unreachable worker aborted the whole fence at prepare."""
    fleet = AsgiFleet(tmp_path, 4)
    fleet.down.add(fleet.urls[3])
    result = asyncio.run(
        fleet.coordinator(tmp_path / "j.db").update(fleet.new, "v1", policy="fence", min_workers=3)
    )
    assert result.ok and result.phase == "fenced"
    assert result.worker(fleet.urls[3]).outcome == "fenced"
    assert result.fleet["fenced"] == [fleet.urls[3]] and result.fleet["unreachable"] == [fleet.urls[3]]
    fleet.down.clear()
    assert {fleet.state(u)[:3] for u in fleet.urls[:3]} == {("v1", 1, fleet.new_digest)}
    assert fleet.state(fleet.urls[3])[:3] == ("v0", None, fleet.old_digest)


def test_a_refusal_at_prepare_still_aborts_under_fence(fleet: AsgiFleet, tmp_path: Path) -> None:
    fleet.intercept(fleet.urls[0], "update_weights_from_disk", refuse("bad_checkpoint", 400))
    result = asyncio.run(
        fleet.coordinator(tmp_path / "j.db").update(fleet.new, "v1", policy="fence", min_workers=1)
    )
    assert result.phase == "aborted" and not result.ok
    assert fleet.serving() == {("v0", None, fleet.old_digest)}


def test_case_variant_urls_are_one_worker(fleet: AsgiFleet) -> None:
    """Failed on the old code: HTTP://h:p and http://h:p counted as two workers."""
    with pytest.raises(InvalidRequest) as err:
        FleetCoordinator(["http://127.0.0.1:9100", "HTTP://127.0.0.1:9100/"])
    assert err.value.code == "duplicate_worker"
    with pytest.raises(InvalidRequest):
        FleetCoordinator(["http://Example.com", "http://example.com:80"])


def test_a_worker_at_the_largest_epoch_cannot_brick_commits(fleet: AsgiFleet, tmp_path: Path) -> None:
    """Failed on the old code: the next epoch was max(worker epochs) + 1, past 2^63 - 1."""
    asyncio.run(fleet.controllers[fleet.urls[0]].declare("v0", epoch=2**63 - 1))
    refused = asyncio.run(fleet.coordinator(tmp_path / "j.db").update(fleet.new, "v1"))
    assert refused.phase == "aborted" and "untrusted_epoch" in refused.worker(fleet.urls[0]).codes
    fenced = asyncio.run(
        fleet.coordinator(tmp_path / "j.db").update(fleet.new, "v1", policy="fence", min_workers=2)
    )
    assert fenced.ok and fenced.worker(fleet.urls[0]).outcome == "fenced"
    later = asyncio.run(
        fleet.coordinator(tmp_path / "j.db").update(fleet.old, "v2", policy="fence", min_workers=2)
    )
    assert later.ok and later.epoch == fenced.epoch + 1  # the journal issues the epochs


def test_rolling_update_calls_the_hooks_around_each_batch(fleet: AsgiFleet, tmp_path: Path) -> None:
    seen: list[tuple[str, list[str]]] = []

    async def drain(urls: Any) -> None:
        seen.append(("drain", list(urls)))

    async def back(urls: Any) -> None:
        seen.append(("return", list(urls)))

    coordinator = fleet.coordinator(tmp_path / "j.db", before_pause=drain, after_commit=back)
    result = asyncio.run(coordinator.update(fleet.new, "v1", max_unavailable=2))
    assert result.ok and fleet.serving() == {("v1", 1, fleet.new_digest)}
    u = fleet.urls
    assert seen == [("drain", u[:2]), ("return", u[:2]), ("drain", u[2:]), ("return", u[2:])]


def test_a_later_batch_failing_under_rollback_takes_earlier_batches_back(
    fleet: AsgiFleet, tmp_path: Path
) -> None:
    fleet.intercept(fleet.urls[2], "verify_weights", refuse())
    seen: list[tuple[str, list[str]]] = []

    async def drain(urls: Any) -> None:
        seen.append(("drain", list(urls)))

    coordinator = fleet.coordinator(tmp_path / "j.db", before_pause=drain)
    result = asyncio.run(coordinator.update(fleet.new, "v1", max_unavailable=1))
    assert result.phase == "rolled_back"
    assert fleet.serving() == {("v0", result.epoch, fleet.old_digest)}
    assert ("drain", fleet.urls[:2]) in seen  # the committed batches are drained before their rollback


def test_a_later_batch_failing_under_fence_leaves_earlier_batches_committed(
    fleet: AsgiFleet, tmp_path: Path
) -> None:
    fleet.intercept(fleet.urls[2], "verify_weights", refuse())
    coordinator = fleet.coordinator(tmp_path / "j.db")
    result = asyncio.run(
        coordinator.update(fleet.new, "v1", max_unavailable=1, policy="fence", min_workers=2)
    )
    assert result.ok and result.phase == "fenced"
    assert fleet.serving() == {("v1", 1, fleet.new_digest)}
    assert fleet.state(fleet.urls[2])[3] is True  # the fenced worker stays paused


def test_a_checkpoint_without_a_manifest_is_an_initial_source_and_the_rollback_restores_it(
    fleet: AsgiFleet, tmp_path: Path
) -> None:
    """Failed on the previous code (``initial_source_mismatch: ... would load digest unknown``):
    a Hugging Face directory (the old weights' safetensors, no weightsync manifest) is what a
    user starts from.  Its dry run reads every byte, so the digest it would load is computed
    and compared; a later failure rolls every worker back onto it under the old label."""
    hf = tmp_path / "hf-old"  # under the workers' allowed root
    hf.mkdir()
    for shard in Path(fleet.old).glob("*.safetensors"):
        shutil.copy(shard, hf / shard.name)
    assert not list(hf.glob("*.json"))  # no manifest: the digest is not written anywhere
    fleet.intercept(fleet.urls[2], "verify_weights", refuse())
    result = asyncio.run(fleet.coordinator(tmp_path / "j.db", initial_source=str(hf)).update(fleet.new, "v1"))
    assert result.phase == "rolled_back", result
    assert fleet.serving() == {("v0", result.epoch, fleet.old_digest)}
    # and a source that is not what they hold is still refused, before any worker is paused
    fleet.calls.clear()
    wrong = tmp_path / "hf-new"
    wrong.mkdir()
    for shard in Path(fleet.new).glob("*.safetensors"):
        shutil.copy(shard, wrong / shard.name)
    refused = asyncio.run(
        fleet.coordinator(tmp_path / "k.db", initial_source=str(wrong)).update(fleet.new, "v1")
    )
    assert {w.codes for w in refused.workers} == {("initial_source_mismatch",)}
    assert "pause_generation" not in {r for _, r in fleet.calls}


def test_a_relative_checkpoint_path_is_refused_before_any_call(fleet: AsgiFleet) -> None:
    with pytest.raises(InvalidRequest):
        asyncio.run(fleet.coordinator().update("step-1", "v1"))
    assert fleet.calls == []


def test_a_channel_without_every_member_of_the_seam_is_refused_before_any_call(
    fleet: AsgiFleet, tmp_path: Path
) -> None:
    class NoRepush:  # the shape before the seam named its re-push: it could not roll back
        kind = "disk"
        restores_without_source = False

        def source(self, url: str) -> str:
            return fleet.new

        def expected_digest(self) -> None:
            return None

        def dry_run(self, url: str) -> Any:
            raise AssertionError("never asked")

        async def apply(self, urls: Any, fan: Any, deadline: float) -> Any:
            raise AssertionError("never asked")

    with pytest.raises(InvalidRequest) as err:
        asyncio.run(fleet.coordinator(tmp_path / "j.db").run(NoRepush(), "v1"))  # type: ignore[arg-type]
    assert err.value.code == "invalid_value" and "Channel" in err.value.message
    assert fleet.calls == []


def test_an_unrestorable_worker_stays_paused_and_the_phase_says_the_rollback_failed(
    fleet: AsgiFleet, tmp_path: Path
) -> None:
    """Failed on the previous code: a first transaction failing after apply with no source
    to restore reported phase ``rolled_back`` though no worker was."""
    fleet.intercept(fleet.urls[2], "verify_weights", refuse())
    result = asyncio.run(fleet.coordinator(tmp_path / "j.db", initial_source=None).update(fleet.new, "v1"))
    assert result.phase == "rollback_failed" and result.code == "rollback_failed" and not result.ok
    assert "rolled_back" not in {w.outcome for w in result.workers}
    stuck = [w for w in result.workers if w.outcome == "failed"]
    assert stuck and all(not w.serving and "no_rollback_source" in w.codes for w in stuck)
    assert "stay(s) paused" in result.next_step and "did not answer" not in result.next_step
    assert fleet.serving() == set()


def test_a_heartbeat_names_the_workers_still_owed_an_answer_and_the_time_left(
    fleet: AsgiFleet, tmp_path: Path
) -> None:
    fleet.slow[(fleet.urls[1], "update_weights_from_disk")] = 2.0
    events: list[Any] = []
    coordinator = fleet.coordinator(tmp_path / "j.db", on_event=events.append, heartbeat_s=0.1)
    result = asyncio.run(coordinator.update(fleet.new, "v1", deadline_s=30))
    assert result.ok
    beats = [e for e in events if e.what == "waiting"]
    assert beats and all(fleet.urls[1] in e.detail and "s left" in e.detail for e in beats)
    # Once the others answered (well within the slow worker's 2 s on a loaded machine), only
    # the slow one is named.
    applying = [e for e in beats if e.phase == "applying"]
    assert applying and fleet.urls[0] not in applying[-1].detail and "1 owed" in applying[-1].detail
    timed = [e for e in events if e.duration_s is not None]
    assert timed and all(e.line()[2] == ":" and " in " in e.line() for e in timed)


def test_a_corrupt_tensor_byte_is_refused_at_prepare_and_the_coordinator_reads_no_weight_bytes(
    fleet: AsgiFleet, tmp_path: Path
) -> None:
    """Flip the last byte of a tensor (no header changes).  The coordinator takes the
    expected digest from the manifest's per-tensor hashes without reading a weight byte;
    each worker's dry run checks the manifest's file checksums, so the corrupt shard is
    refused before any worker is paused: the transaction aborts and nothing changes."""
    from weightsync.fleet import DiskChannel

    shard = next(Path(fleet.new).glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert DiskChannel(dict.fromkeys(fleet.urls, fleet.new)).expected_digest() == fleet.new_digest
    result = asyncio.run(fleet.coordinator(tmp_path / "j.db").update(fleet.new, "v1"))
    assert result.phase == "aborted" and all(w.codes == ("manifest_mismatch",) for w in result.workers)
    assert "pause_generation" not in {r for _, r in fleet.calls}
    assert fleet.serving() == {("v0", None, fleet.old_digest)}


def test_a_wrong_initial_source_is_refused_at_prepare_before_any_worker_is_paused(
    fleet: AsgiFleet, tmp_path: Path
) -> None:
    """Failed on the previous code: the initial source was never checked, so this update
    went ahead, and a rollback would have loaded the wrong weights under the old label."""
    result = asyncio.run(
        fleet.coordinator(tmp_path / "j.db", initial_source=fleet.new).update(fleet.new, "v1")
    )
    assert result.phase == "aborted" and not result.ok
    assert {w.codes for w in result.workers} == {("initial_source_mismatch",)}
    assert "pause_generation" not in {r for _, r in fleet.calls}
    assert fleet.serving() == {("v0", None, fleet.old_digest)}
    # once the journal holds a commit, its source is what a rollback restores: the initial
    # source is no longer asked about
    ok = asyncio.run(fleet.coordinator(tmp_path / "j.db").update(fleet.new, "v1"))
    assert ok.ok
    fleet.calls.clear()
    again = asyncio.run(
        fleet.coordinator(tmp_path / "j.db", initial_source="/nowhere").update(fleet.old, "v2")
    )
    assert again.ok
