"""The transaction spec and worker records: frozen, validated, with a versioned JSON form."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from weightsync.core.errors import InvalidRequest
from weightsync.fleet.records import SCHEMA, Held, TransactionSpec, WorkerRecord
from weightsync.fleet.urls import worker_url

SPEC = TransactionSpec(
    {"step": 3, "tag": None},
    (
        WorkerRecord("http://a:80", "/ckpt/3", Held("v2", True, 7, "ab" * 8, False, False, "/ckpt/2")),
        WorkerRecord("http://b:80", "/ckpt/3"),
    ),
    policy="fence", min_workers=1, max_unavailable=1, expected_digest="cd" * 8, epoch=8,
)  # fmt: skip


def test_the_spec_round_trips_through_its_versioned_json() -> None:
    data = SPEC.to_json()
    assert data["schema"] == SCHEMA
    assert TransactionSpec.from_json(data) == SPEC


def test_the_commits_expiry_round_trips_and_a_spec_written_before_it_reads_as_none() -> None:
    expiring = attrs.evolve(SPEC, not_after=1767225600.125)
    assert TransactionSpec.from_json(expiring.to_json()).not_after == 1767225600.125
    older = SPEC.to_json()
    older.pop("not_after")  # an older release's spec has no such key
    assert TransactionSpec.from_json(older).not_after is None


def test_the_spec_is_frozen_and_evolve_revalidates() -> None:
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        SPEC.epoch = 9  # type: ignore[misc]
    with pytest.raises(InvalidRequest) as err:
        attrs.evolve(SPEC, min_workers=3)
    assert err.value.code == "invalid_value"
    with pytest.raises(InvalidRequest) as err:
        attrs.evolve(SPEC, workers=(SPEC.workers[0], SPEC.workers[0]))
    assert err.value.code == "duplicate_worker"


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.update(schema=1),
        lambda d: d.pop("schema"),
        lambda d: d.update(policy="yolo"),
        lambda d: d.update(min_workers="2"),
        lambda d: d.update(epoch=True),
        lambda d: d.update(workers="http://a"),
        lambda d: d["workers"][0].update(previous={"declared": "yes"}),
        lambda d: d["workers"][1].pop("url"),
        lambda d: d.update(not_after="1767225600"),
        lambda d: d.update(not_after=True),
        lambda d: d.update(not_after=-1.0),
        lambda d: d.update(not_after=float("nan")),
    ],
)
def test_any_other_form_is_bad_journal(mutate: Any) -> None:
    data = SPEC.to_json()
    mutate(data)
    with pytest.raises(InvalidRequest) as err:
        TransactionSpec.from_json(data)
    assert err.value.code == "bad_journal"


def test_held_from_a_status_reply_reads_anything_unexpected_as_unknown() -> None:
    held = Held.from_status({"version": "v", "version_declared": True, "epoch": "9", "digest": 5}, None)
    assert (held.declared, held.epoch, held.digest, held.paused) == (True, None, None, False)


@pytest.mark.parametrize(
    ("url", "normal"),
    [
        ("HTTP://Example.COM", "http://example.com:80"),
        ("http://example.com:80/", "http://example.com:80"),
        ("https://h", "https://h:443"),
        ("http://[::1]:8000", "http://[::1]:8000"),
    ],
)
def test_worker_urls_are_normalised(url: str, normal: str) -> None:
    assert worker_url(url) == normal


@pytest.mark.parametrize("url", ["", "ftp://h", "http://", "http://u:p@h", "http://h?x=1", "http://h :80"])
def test_bad_worker_urls_are_refused(url: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        worker_url(url)
    assert err.value.code == "bad_worker_url"
