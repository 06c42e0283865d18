"""docs/embedding.md's example runs as printed, prints what the doc says, and shuts down
without a traceback; the protocol the doc prints is the one in the code."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

from tests.helpers import run_doc_example
from weightsync.core import Engine

DOC = Path(__file__).resolve().parents[2] / "docs" / "embedding.md"


def test_embedding_example_runs_and_drives_the_controller(tmp_path: Path) -> None:
    out = run_doc_example(DOC, tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    replies = [json.loads(line) for line in lines[:7]]
    assert replies[0]["version_declared"] is False
    assert replies[1]["status"] == "error" and replies[1]["code"] == "not_paused"
    assert replies[3]["status"] == "error" and replies[3]["code"] == "weights_mismatch"
    assert replies[4]["status"] == "ok" and replies[4]["version"] == "step-1"
    assert replies[4]["stats"]["tensors"] == 2
    assert replies[6] == {"status": "ok", "version": "step-1", "version_declared": True,
                          "paused": False, "torn": False, "update_in_flight": False,
                          "digest": None, "epoch": None, "version_digest": None,
                          "version_current": True, "session_open": False, "verified": True,
                          "weights": "resident", "kv_cache": "resident", "weights_released": False}  # fmt: skip
    assert lines[7] == "served weights sum to 16.0"


def test_embedding_example_shuts_down_without_a_traceback(tmp_path: Path) -> None:
    out = run_doc_example(DOC, tmp_path, timeout=60)
    assert out.returncode == 0 and out.stderr == "", out.stderr


def test_doc_prints_every_engine_method_with_its_code_signature() -> None:
    text = DOC.read_text()
    methods = [n for n, f in inspect.getmembers(Engine, inspect.iscoroutinefunction)]
    assert len(methods) == 7, methods
    for name in methods:
        sig = str(inspect.signature(getattr(Engine, name))).replace("'", "")
        match = re.search(rf"async def {name}\((.*?)\) -> (.*?): \.\.\.", text)
        assert match, f"docs/embedding.md does not show async def {name}"
        assert f"({match.group(1)}) -> {match.group(2)}" == sig, (name, sig)
