"""A worker actor's keywords read as ``weightsync serve``'s flags, and the rank each replica
takes from one ``init_info`` (no Ray cluster needed)."""

from __future__ import annotations

from typing import Any

import pytest

from weightsync.cli import build_parser
from weightsync.core.errors import InvalidRequest
from weightsync.ray.arguments import serve_namespace


def test_no_keywords_are_serves_defaults_but_a_free_port() -> None:
    parsed = vars(build_parser().parse_args(["serve"]))
    ns = vars(serve_namespace({}))
    assert ns["port"] == 0
    assert {k: v for k, v in ns.items() if k != "port"} == {
        k: v for k, v in parsed.items() if k not in ("port", "command", "func")
    }


def test_keywords_are_serves_flags_with_lists_under_their_plural() -> None:
    ns = serve_namespace({
        "model_config": "tiny", "tensor_parallel_size": 2, "allowed_weight_dirs": ["/ckpt"],
        "require_version": True, "session_timeout": 5, "vllm_args": {"max_model_len": 64},
    })  # fmt: skip
    assert (ns.model_config, ns.tensor_parallel_size, ns.allowed_weight_dir) == ("tiny", 2, ["/ckpt"])
    assert ns.require_version is True and ns.session_timeout == 5.0
    assert ns.vllm_arg == ["max_model_len=64"]


@pytest.mark.parametrize("version", ["step-1", "1", 3, None, {"step": [1, 2]}])
def test_the_initial_version_is_any_json_value_read_back_as_itself(version: Any) -> None:
    from weightsync.worker_app import initial_version

    text = serve_namespace({"initial_version": version}).initial_version
    assert (text is None) if version is None else initial_version(text) == version


@pytest.mark.parametrize(
    ("options", "code", "field"),
    [
        ({"model_config": "huge"}, "invalid_value", "model_config"),
        ({"tensor_parallel_size": "2"}, "wrong_type", "tensor_parallel_size"),
        ({"tensor_parallel_size": True}, "wrong_type", "tensor_parallel_size"),
        ({"require_version": 1}, "wrong_type", "require_version"),
        ({"allowed_weight_dirs": "/ckpt"}, "wrong_type", "allowed_weight_dirs"),
        ({"initial_version": float("nan")}, "invalid_value", "initial_version"),
    ],
)
def test_a_value_serve_would_refuse_is_refused_naming_its_keyword(
    options: dict[str, Any], code: str, field: str
) -> None:
    with pytest.raises(InvalidRequest) as refused:
        serve_namespace(options)
    assert (refused.value.code, refused.value.details["field"]) == (code, field)


def test_an_unknown_keyword_is_refused_and_the_message_lists_serves_flags() -> None:
    with pytest.raises(InvalidRequest) as refused:
        serve_namespace({"allowed_weight_dir": ["/x"], "colour": "red"})
    assert refused.value.code == "unknown_field" and refused.value.details["fields"] == [
        "allowed_weight_dir",
        "colour",
    ]
    assert "allowed_weight_dirs" in refused.value.message


@pytest.mark.parametrize(("replica", "world", "offset"), [(0, 1, 1), (1, 1, 2), (2, 2, 5)])
def test_each_replica_takes_its_own_ranks_from_one_init_info(replica: int, world: int, offset: int) -> None:
    from weightsync.ray.vllm_methods import VllmMethods

    methods = VllmMethods(None, replica, world)  # type: ignore[arg-type]
    info = {"master_address": "h", "master_port": 1, "rank_offset": 1, "world_size": 1 + 4}
    assert methods.ranked(info) == {**info, "rank_offset": offset}
    assert methods.ranked({"rank_offset": "1"}) == {"rank_offset": "1"}  # the dialect refuses it
