"""Replies inside an open update session name only what is held: an SGLang disk update sent
between ``begin_weight_update`` and ``end_weight_update``, against a real loopback server.

Failed on the previous code: the update answered "Weight version updated to d2" (the version
waits for the session's end) with the digest of the weights it had just overwritten, and
``get_weight_version`` reported that stale digest beside ``torn: true`` and a label it
called current.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from tests.helpers import TINY, perturbed
from weightsync.core import Controller
from weightsync.core.snapshot import Declared
from weightsync.engines.reference import ReferenceEngine
from weightsync.serve import ServerThread, create_app
from weightsync.trainer import save_checkpoint, weights_digest

pytestmark = pytest.mark.integration


def test_an_sglang_disk_update_inside_a_session_says_the_sessions_truth(tmp_path: Path) -> None:
    engine = ReferenceEngine(TINY, allowed_weight_dirs=[tmp_path])
    old = dict(engine.model.weights())
    new = perturbed(old, seed=7)
    d2 = str(save_checkpoint(new, tmp_path / "d2"))
    controller = Controller(engine, version=Declared("d1"))
    with ServerThread(create_app(controller)) as server:
        url = server.url

        def post(path: str, body: dict[str, object] | None = None) -> dict[str, object]:
            r = requests.post(f"{url}{path}", json=body or {}, timeout=60)
            assert r.status_code == 200, r.text
            out: dict[str, object] = r.json()
            return out

        assert post("/pause_generation", {"mode": "retract"})["success"]
        assert post("/begin_weight_update")["success"]
        reply = post("/update_weights_from_disk", {"model_path": d2, "weight_version": "d2"})
        assert reply["success"]
        assert "updated to d2" not in str(reply["message"]) and "d2" in str(reply["message"])
        assert reply["digest"] != weights_digest(old)  # never the digest of overwritten weights
        label = requests.get(f"{url}/get_weight_version", timeout=30).json()
        assert label["weight_version"] == "d1" and label["digest"] != weights_digest(old)
        state = post("/engine/get_weight_version")
        assert state["session_open"] and state["torn"]
        assert state["digest"] is None and state["version_current"] is False
        end = post("/end_weight_update")
        assert end["digest"] == weights_digest(new)
        state = post("/engine/get_weight_version")
        assert (state["version"], state["digest"], state["version_current"]) == (
            "d2",
            weights_digest(new),
            True,
        )
