"""The URL that stands for a worker actor in a fleet's results and journal: made from its
name, or given (its HTTP app's, so a router in front of it names it alike); no Ray cluster
needed."""

from __future__ import annotations

import pytest

pytest.importorskip("ray", reason="the ray extra is not installed (make test installs it)")

from weightsync.core.errors import InvalidRequest
from weightsync.ray import ActorRef


def test_a_named_actors_url_is_made_from_its_name_and_namespace() -> None:
    assert ActorRef(name="worker-0", namespace="rl").url == "http://worker-0.rl.ray:80"
    assert ActorRef(name="worker-0").url == "http://worker-0._.ray:80"


def test_a_given_url_stands_for_the_actor_normalised() -> None:
    ref = ActorRef(name="worker-0", namespace="rl", url="HTTP://127.0.0.1:8123/")
    assert ref.url == "http://127.0.0.1:8123" and ref.name == "worker-0"


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        ({}, "bad_worker"),
        ({"name": "has space"}, "bad_worker"),
        ({"name": "w", "url": "http://127.0.0.1:8123/engine"}, "bad_worker_url"),
        ({"name": "w", "url": "ftp://127.0.0.1:8123"}, "bad_worker_url"),
    ],
)
def test_a_ref_that_cannot_name_a_worker_is_refused(fields: dict[str, str], code: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        ActorRef(**fields)  # type: ignore[arg-type]
    assert refused.value.code == code
