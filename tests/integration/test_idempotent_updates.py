"""Retry-safe updates: an update carrying an idempotency key runs once, on real loopback
servers over the reference engine.

Each repeat is checked against the controller's own record of what it ran (its journal of
commands): a repeat answered from the record adds nothing there — no second load, no second
apply — and the worker's digest and commit count are as the first request left them.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import perturbed
from tests.workers import Worker
from weightsync.trainer import save_checkpoint


def post(worker: Worker, route: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(f"{worker.url}{route}", json=body, headers=headers, timeout=60)


def checkpoint(worker: Worker, name: str, seed: int) -> Path:
    return save_checkpoint(perturbed(worker.engine.model.weights(), seed=seed), worker.root / name)


def loads(worker: Worker) -> int:
    """How many disk updates the controller carried out or refused (its journal of commands)."""
    return sum(e.command == "update" for e in worker.controller.journal)


def test_a_repeated_update_is_answered_from_the_record_without_a_second_load(worker: Worker) -> None:
    path = str(checkpoint(worker, "a", seed=1))
    worker.client.pause_generation()
    base = worker.controller.snapshot().digest
    body = {"model_path": path, "weight_version": "a", "idempotency_key": "step-1-try"}
    first = post(worker, "/engine/update_weights_from_disk", body)
    assert first.status_code == 200, first.text
    before = (loads(worker), worker.controller.snapshot())
    again = post(worker, "/engine/update_weights_from_disk", body)
    assert again.status_code == 200 and again.json()["replayed"] is True
    assert {k: v for k, v in again.json().items() if k != "replayed"} == first.json()
    assert first.json()["idempotency"] == {
        "key": "step-1-try",
        "base_digest": base,
        "target_digest": first.json()["digest"],
    }
    assert base != first.json()["digest"]
    assert (loads(worker), worker.controller.snapshot()) == before  # nothing ran again


def test_the_same_key_with_another_body_is_refused_and_changes_nothing(worker: Worker) -> None:
    a, b = str(checkpoint(worker, "a", seed=1)), str(checkpoint(worker, "b", seed=2))
    worker.client.pause_generation()
    assert (
        post(
            worker, "/engine/update_weights_from_disk", {"model_path": a, "idempotency_key": "k"}
        ).status_code
        == 200
    )
    held = worker.controller.snapshot()
    r = post(worker, "/engine/update_weights_from_disk", {"model_path": b, "idempotency_key": "k"})
    assert r.status_code == 409 and r.json()["code"] == "idempotency_key_reused", r.text
    assert worker.controller.snapshot() == held


def test_a_refusal_is_replayed_and_a_repeat_while_the_first_runs_waits_for_it(worker: Worker) -> None:
    worker.client.pause_generation()
    missing = {"model_path": str(worker.root / "missing"), "idempotency_key": "bad"}
    n = loads(worker)
    first = post(worker, "/engine/update_weights_from_disk", missing)
    assert first.status_code >= 400 and loads(worker) == n + 1  # tried, and refused
    n += 1
    again = post(worker, "/engine/update_weights_from_disk", missing)
    assert (again.status_code, again.json()["code"]) == (first.status_code, first.json()["code"])
    assert loads(worker) == n  # the refusal was not tried again
    # two requests with one key at once: one load, both answered with its reply
    body = {"model_path": str(checkpoint(worker, "c", seed=3)), "idempotency_key": "together"}
    replies: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: replies.append(post(worker, "/engine/update_weights_from_disk", body)))
               for _ in range(2)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [r.status_code for r in replies] == [200, 200]
    assert sorted(r.json().get("replayed", False) for r in replies) == [False, True]
    assert loads(worker) == n + 1


def test_the_header_makes_a_dialects_route_retry_safe(worker: Worker) -> None:
    """SGLang's ``/update_weights_from_disk`` takes fixed fields: the key comes as the
    ``Idempotency-Key`` header, as a retrying client or proxy adds it."""
    path = str(checkpoint(worker, "s", seed=4))
    first = post(worker, "/update_weights_from_disk", {"model_path": path}, **{"Idempotency-Key": "sg-1"})
    assert first.status_code == 200 and first.json()["success"] is True, first.text
    n, held = loads(worker), worker.controller.snapshot()
    again = post(worker, "/update_weights_from_disk", {"model_path": path}, **{"Idempotency-Key": "sg-1"})
    assert again.status_code == 200 and again.json()["success"] is True
    assert (loads(worker), worker.controller.snapshot().digest) == (n, held.digest)


@pytest.mark.parametrize(
    ("key", "header", "code"),
    [
        pytest.param("", None, "invalid_value", id="empty"),
        pytest.param("x" * 256, None, "invalid_value", id="too-long"),
        pytest.param(7, None, "invalid_value", id="not-a-string"),
        pytest.param("a\nb", None, "invalid_value", id="control-character"),
        pytest.param("a", "b", "conflicting_options", id="body-and-header-differ"),
    ],
)
def test_a_bad_key_is_a_400_and_changes_nothing(
    worker: Worker, key: Any, header: str | None, code: str
) -> None:
    worker.client.pause_generation()
    held, n = worker.controller.snapshot(), loads(worker)
    body = {"model_path": str(checkpoint(worker, "x", seed=5)), "idempotency_key": key}
    headers = {} if header is None else {"Idempotency-Key": header}
    r = post(worker, "/engine/update_weights_from_disk", body, **headers)
    assert (r.status_code, r.json()["code"]) == (400, code), r.text
    assert (worker.controller.snapshot(), loads(worker)) == (held, n)
