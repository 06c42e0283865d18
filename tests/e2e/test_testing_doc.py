"""docs/testing.md's harness runs as printed: the conformance machine over real HTTP, with a
JSON null sent as null and a tear injected through the engine."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from tests.helpers import run_doc_example

DOC = Path(__file__).resolve().parents[2] / "docs" / "testing.md"


def test_testing_guide_harness_runs_the_machine_to_completion(tmp_path: Path) -> None:
    out = run_doc_example(DOC, tmp_path, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "conforms"


def test_testing_guide_harness_sends_json_null_as_a_body_and_tears_for_real() -> None:
    code = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert code
    namespace: dict[str, Any] = {}
    exec(code.group(1).split("\nrun_state_machine(")[0], namespace)
    harness = namespace["MyHarness"]()
    try:
        # A JSON null body is not an empty one: resume_generation must refuse it (400).
        status, reply = harness.call("resume_generation", None)
        assert status == 400 and reply["status"] == "error", reply
        assert harness.call("pause_generation", {})[0] == 200
        route, body = harness.update_request("tear", "t1")
        status, reply = harness.call(route, body)
        assert status >= 400 and reply["code"] == "weights_torn", reply
        assert harness.call("get_weight_version", {})[1]["torn"] is True
    finally:
        harness.close()
