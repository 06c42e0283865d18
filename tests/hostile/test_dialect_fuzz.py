"""Every dialect route, fuzzed with bad bodies: a 4xx with a code, and nothing changed."""

from __future__ import annotations

from typing import Any

import pytest
import requests

from tests.dialect_worker import Served, served

__all__ = ["served"]


VLLM_POSTS = [
    "/pause", "/resume", "/abort_requests", "/init_weight_transfer_engine", "/shutdown_weight_transfer_engine",
    "/weight_checker", "/update_weight_version",
]  # fmt: skip
SGLANG_POSTS = [
    "/update_weights_from_disk", "/update_weights_from_distributed", "/update_weights_from_tensor",
    "/init_weights_update_group", "/destroy_weights_update_group", "/pause_generation",
    "/continue_generation", "/update_weight_version",
]  # fmt: skip
BAD_BODIES: list[Any] = [
    [],
    "text",
    17,
    {"no_such_field": 1},
    {"mode": 3},
    {"init_info": "x"},
    {"update_info": [1]},
    {"update_info": {"names": "x"}},
    {"model_path": 5},
    {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "g", "flush_cache": "yes"},
    {"master_address": "127.0.0.1", "master_port": 0, "rank_offset": 1, "world_size": 2},
    {"action": "sum"},
    {"new_version": {"a": float("inf")}} if False else {"new_version": None, "abort_all_requests": "no"},
]


@pytest.mark.parametrize("path", VLLM_POSTS + SGLANG_POSTS)
def test_every_dialect_route_refuses_bad_bodies_with_a_code_and_changes_nothing(
    served: Served, path: str
) -> None:
    before = served.state()
    for body in BAD_BODIES:
        r = served.post(path, json=body)
        if r.status_code == 200:  # a body this route has no fields for but accepts is fine only if empty-ish
            assert body in ({},), (path, body, r.text)
            continue
        assert 400 <= r.status_code < 500, (path, body, r.status_code, r.text)
        reply = r.json()
        code = reply["error"]["type"] if "error" in reply else reply["code"]
        assert isinstance(code, str) and code, (path, body, reply)
        assert served.state() == before, (path, body)
    broken = requests.post(
        f"{served.url}{path}", data=b"{not json", headers={"Content-Type": "application/json"}, timeout=30
    )
    assert 400 <= broken.status_code < 500
    assert served.state() == before
