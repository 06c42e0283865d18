"""``weightsync_version_info``'s labels: a string version is the label as it is (no JSON quotes,
so a dashboard filters on ``version="step-2"``), any other JSON value its JSON text with a type."""

from __future__ import annotations

from typing import Any

import pytest

from weightsync.serve.metrics import version_labels


@pytest.mark.parametrize(
    ("declared", "value", "labels"),
    [
        (True, "step-2", {"version": "step-2", "type": "string"}),
        (True, '"quoted"', {"version": '"quoted"', "type": "string"}),
        (True, 3, {"version": "3", "type": "number"}),
        (True, 1.5, {"version": "1.5", "type": "number"}),
        (True, True, {"version": "true", "type": "boolean"}),
        (True, None, {"version": "null", "type": "null"}),
        (True, [1, "a"], {"version": '[1, "a"]', "type": "array"}),
        (True, {"step": 1}, {"version": '{"step": 1}', "type": "object"}),
        (False, None, {"version": "", "type": "undeclared"}),
    ],
)
def test_a_version_becomes_plain_labels(declared: bool, value: Any, labels: dict[str, str]) -> None:
    assert version_labels(declared, value) == labels
