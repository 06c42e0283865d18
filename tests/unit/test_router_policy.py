"""Freshness policies: strict parsing (header, body, CLI) and the choice of a worker."""

from __future__ import annotations

from typing import Any

import pytest

from weightsync.core.errors import InvalidRequest
from weightsync.router._state import Label
from weightsync.router.policy import (
    ANY,
    Candidate,
    Policy,
    Refusal,
    body_policy,
    choose,
    parse_policy,
    request_policy,
)


@pytest.mark.parametrize(
    ("text", "policy"),
    [
        ("any", ANY),
        (" any ", ANY),
        ("latest", Policy(max_staleness=0)),
        ("min-epoch:0", Policy(min_epoch=0)),
        ("min-epoch:12", Policy(min_epoch=12)),
        ("max-staleness:3", Policy(max_staleness=3)),
        (f"max-staleness:{2**63 - 1}", Policy(max_staleness=2**63 - 1)),
    ],
)
def test_policy_forms(text: str, policy: Policy) -> None:
    assert parse_policy(text) == policy


@pytest.mark.parametrize(
    "text",
    ["", "ANY", "newest", "min-epoch:", "min-epoch:-1", "min-epoch:1.5", "max-staleness:x",
     "min-epoch: 1", f"min-epoch:{2**63}", "min-epoch:99999999999999999999", "latest,any", 3, None],
)  # fmt: skip
def test_bad_policies_are_invalid_policy(text: Any) -> None:
    with pytest.raises(InvalidRequest) as err:
        parse_policy(text)
    assert err.value.code == "invalid_policy" and err.value.http_status == 400


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"min_weight_epoch": -1}, "invalid_value"),
        ({"min_weight_epoch": True}, "wrong_type"),
        ({"min_weight_epoch": "1"}, "wrong_type"),
        ({"max_staleness": 1.0}, "wrong_type"),
        ({"max_staleness": 2**63}, "invalid_value"),
        ({"weight_version": float("nan")}, "invalid_value"),
    ],
)
def test_bad_body_bounds_are_refused(body: dict[str, Any], code: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        body_policy(body)
    assert err.value.code == code


def test_header_and_body_bounds_all_apply_and_the_default_only_when_none_is_given() -> None:
    default = Policy(max_staleness=5)
    assert request_policy({}, None, default) == default
    assert request_policy({"prompt": "x"}, "any", default) == ANY
    both = request_policy({"min_weight_epoch": 2, "max_staleness": 4}, "max-staleness:1", default)
    assert both == Policy(min_epoch=2, max_staleness=1)
    exact = request_policy({"weight_version": None}, None, default)
    assert exact.has_version and exact.version is None


def cand(url: str, epoch: int | None, in_flight: int = 0, version: Any = "v") -> Candidate:
    return Candidate(url, Label(True, version, epoch, "d"), in_flight)


def test_allows() -> None:
    assert Policy(max_staleness=0).allows(Label(True, "v", 3, "d"), 3)
    assert not Policy(max_staleness=0).allows(Label(True, "v", 2, "d"), 3)
    assert Policy(max_staleness=1).allows(Label(True, "v", 2, "d"), 3)
    assert not Policy(min_epoch=3).allows(Label(True, "v", None, "d"), 3)
    assert Policy(version="v").allows(Label(True, "v", 1, "d"), 9)
    assert not Policy(version="v").allows(Label(False, "v", 1, "d"), 9)
    assert not Policy(version=1).allows(Label(True, True, 1, "d"), 9)


def test_choose_prefers_the_least_loaded_qualifying_worker() -> None:
    workers = [cand("a", 2, 0), cand("b", 3, 5), cand("c", 3, 1)]
    assert choose(workers, ANY, 3) == workers[0]
    assert choose(workers, Policy(max_staleness=0), 3) == workers[2]
    assert choose(workers, Policy(max_staleness=0), 3, exclude=frozenset({"c"})) == workers[1]


def test_choose_spreads_ties_round_robin() -> None:
    workers = [cand("a", 1), cand("b", 1), cand("c", 1)]
    assert [choose(workers, ANY, 1, start=i).url for i in range(4)] == ["a", "b", "c", "a"]  # type: ignore[union-attr]


def test_choose_refuses_with_a_reason() -> None:
    empty = choose([], ANY, 0)
    assert isinstance(empty, Refusal) and empty.code == "no_worker"
    stale = choose([cand("a", 1)], Policy(min_epoch=2), 2)
    assert isinstance(stale, Refusal) and stale.code == "no_fresh_worker"
    assert "epoch >= 2" in stale.message and "[1]" in stale.message
    only = choose([cand("a", 1)], ANY, 1, exclude=frozenset({"a"}))
    assert isinstance(only, Refusal) and only.code == "no_worker"
