"""SGLang's own checks of the weight version, re-run against a weightsync worker.

Followed one for one: ``test/srt/test_weight_version.py`` in sgl-project/sglang,
``TestWeightVersion`` (its server is launched with ``--weight-version test_version_1.0``; here
the worker starts with that version declared):

- ``test_weight_version_comprehensive``: ``/get_model_info`` and ``/get_weight_version``
  report it, an OpenAI completion carries it as ``metadata.weight_version``, and
  ``/update_weight_version`` (with and without ``abort_all_requests``) changes all three.
  Its ``/generate`` ``meta_info`` and ``/v1/chat/completions`` checks are not repeated here
  (those routes are rollout generation's);
- ``test_update_weight_version_with_weight_updates``: ``/update_weights_from_disk`` of the
  ``model_path`` ``/get_model_info`` reports, with ``load_format: "auto"`` and a
  ``weight_version``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.peers.sglang_worker import SglangWorker, launch
from weightsync.core import Declared


@pytest.fixture
def versioned(tmp_path: Path) -> Iterator[SglangWorker]:
    yield from launch(tmp_path, version=Declared("test_version_1.0"))


def completion_version(worker: SglangWorker) -> object:
    reply = worker.decode(max_tokens=5)
    assert "metadata" in reply and "weight_version" in reply["metadata"], reply
    assert "weight_version" in reply  # weightsync's own stamps stay at the top level
    return reply["metadata"]["weight_version"]


def test_weight_version_comprehensive(versioned: SglangWorker) -> None:
    r = versioned.get("/get_model_info")
    assert r.status_code == 200 and r.json()["weight_version"] == "test_version_1.0"
    r = versioned.get("/get_weight_version")
    assert r.status_code == 200 and r.json()["weight_version"] == "test_version_1.0"
    assert completion_version(versioned) == "test_version_1.0"

    r = versioned.post(
        "/update_weight_version", {"new_version": "updated_version_2.0", "abort_all_requests": False}
    )
    assert r.status_code == 200 and r.json()["success"] is True
    assert r.json()["new_version"] == "updated_version_2.0"
    assert versioned.get("/get_weight_version").json()["weight_version"] == "updated_version_2.0"
    assert completion_version(versioned) == "updated_version_2.0"

    r = versioned.post(
        "/update_weight_version", {"new_version": "final_version_3.0", "abort_all_requests": True}
    )
    assert r.status_code == 200 and r.json()["success"] is True
    assert r.json()["new_version"] == "final_version_3.0"
    assert versioned.get("/get_weight_version").json()["weight_version"] == "final_version_3.0"
    assert versioned.get("/get_model_info").json()["weight_version"] == "final_version_3.0"
    assert completion_version(versioned) == "final_version_3.0"


def test_update_weight_version_with_weight_updates(versioned: SglangWorker) -> None:
    r = versioned.get("/get_model_info")
    assert r.status_code == 200
    current_model_path = r.json()["model_path"]
    update_data = {
        "model_path": current_model_path,
        "load_format": "auto",
        "abort_all_requests": False,
        "weight_version": "disk_update_v2.0.0",
    }
    r = versioned.post("/update_weights_from_disk", update_data)
    assert r.status_code == 200, f"update_weights_from_disk failed with status {r.status_code}: {r.text}"
    assert versioned.get("/get_weight_version").json()["weight_version"] == "disk_update_v2.0.0"


def test_an_undeclared_worker_reports_sglangs_default_in_metadata(tmp_path: Path) -> None:
    """SGLang's version before any is set is ``"default"`` (``--weight-version``'s default)."""
    for worker in launch(tmp_path):
        assert completion_version(worker) == "default"
        assert worker.get("/get_model_info").json()["weight_version"] == "default"
