"""An adapter's config is read strictly: the fields that change the math are kept (and
digested), harmless ones ignored, and anything that would change the math unseen is refused."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weightsync.core.errors import InvalidRequest
from weightsync.lora.config import INERT, NEUTRAL, AdapterConfig
from weightsync.lora.digest import adapter_digest
from weightsync.lora.names import parse_name, tensor_name

BASE: dict[str, Any] = {"r": 8, "lora_alpha": 16, "target_modules": ["v_proj", "q_proj"]}


def code_of(config: dict[str, Any]) -> str:
    with pytest.raises(InvalidRequest) as err:
        AdapterConfig.from_json(config)
    return err.value.code


def test_the_math_fields_are_kept_and_the_targets_sorted() -> None:
    config = AdapterConfig.from_json({**BASE, "lora_dropout": 0.1, "task_type": "CAUSAL_LM"})
    assert config == AdapterConfig(8, 16.0, ("q_proj", "v_proj"), False)
    assert config.scale == 2.0


def test_rslora_scales_by_the_square_root_of_the_rank() -> None:
    config = AdapterConfig.from_json({**BASE, "r": 16, "use_rslora": True})
    assert config.scale == pytest.approx(16 / math.sqrt(16))


def test_targets_match_as_peft_matches_a_list_of_names() -> None:
    config = AdapterConfig.from_json({**BASE, "target_modules": ["q_proj", "layers.1.mlp.up_proj"]})
    assert config.targets("model.layers.0.self_attn.q_proj")
    assert config.targets("model.layers.1.mlp.up_proj")
    assert not config.targets("model.layers.0.mlp.up_proj")
    assert not config.targets("model.layers.0.self_attn.xq_proj")


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"r": 0}, "bad_adapter_config"),
        ({"r": True}, "bad_adapter_config"),
        ({"r": 8.0}, "bad_adapter_config"),
        ({"lora_alpha": 0}, "bad_adapter_config"),
        ({"lora_alpha": "16"}, "bad_adapter_config"),
        ({"target_modules": []}, "bad_adapter_config"),
        ({"target_modules": ["q_proj", "../x"]}, "bad_adapter_config"),
        ({"target_modules": "all-linear"}, "unsupported_adapter_config"),
        ({"use_rslora": 1}, "bad_adapter_config"),
        ({"use_dora": True}, "unsupported_adapter_config"),
        ({"bias": "all"}, "unsupported_adapter_config"),
        ({"fan_in_fan_out": True}, "unsupported_adapter_config"),
        ({"rank_pattern": {"q_proj": 4}}, "unsupported_adapter_config"),
        ({"alpha_pattern": {"q_proj": 4}}, "unsupported_adapter_config"),
        ({"modules_to_save": ["lm_head"]}, "unsupported_adapter_config"),
        ({"init_lora_weights": "pissa"}, "unsupported_adapter_config"),
        ({"peft_type": "IA3"}, "unsupported_adapter_config"),
        ({"use_dora": 0}, "unsupported_adapter_config"),  # 0 is not false
        ({"scaling_mode": "anything"}, "unknown_adapter_config_field"),
    ],
)
def test_a_config_that_would_change_the_math_unseen_is_refused(change: dict[str, Any], code: str) -> None:
    assert code_of({**BASE, **change}) == code


@pytest.mark.parametrize("missing", ["r", "lora_alpha", "target_modules"])
def test_a_config_without_a_math_field_is_refused(missing: str) -> None:
    config = dict(BASE)
    del config[missing]
    assert code_of(config) == "bad_adapter_config"


def test_neutral_values_and_inert_fields_are_accepted() -> None:
    neutral = {field: values[0] for field, values in NEUTRAL.items()}
    inert = {field: {"anything": ["at all"]} for field in INERT}
    assert AdapterConfig.from_json({**BASE, **neutral, **inert}) == AdapterConfig.from_json(BASE)


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
        max_leaves=12,
    )
)
def test_any_json_value_is_a_config_or_one_refusal(value: Any) -> None:
    for config in (value, {**BASE, "r": value}, {**BASE, "target_modules": value}, {**BASE, "x": value}):
        try:
            AdapterConfig.from_json(config)
        except InvalidRequest as exc:
            assert exc.code.endswith("adapter_config") or exc.code == "unknown_adapter_config_field"


def test_the_trainers_config_reads_back_as_itself() -> None:
    config = AdapterConfig.from_json({**BASE, "use_rslora": True})
    assert AdapterConfig.from_json(config.to_json()) == config


def test_peft_names_round_trip_and_nothing_else_parses() -> None:
    module = "model.layers.0.self_attn.q_proj"
    assert parse_name(tensor_name(module, "A")) == (module, "A")
    assert parse_name(tensor_name(module, "B")) == (module, "B")
    for name in (
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector",
        "base_model.model.model.embed_tokens.lora_embedding_A",
        "base_model.model.model.layers.0.self_attn.q_proj.base_layer.bias",
        "model.layers.0.self_attn.q_proj.lora_A.weight",
        "base_model.model..lora_A.weight",
        "base_model.model.lora_A.weight",
    ):
        assert parse_name(name) is None, name


def test_the_digest_covers_the_config_that_changes_the_math() -> None:
    hashes = {tensor_name("m.q_proj", "A"): "0" * 16, tensor_name("m.q_proj", "B"): "1" * 16}
    base = AdapterConfig(8, 16.0, ("q_proj",))
    digests = {
        adapter_digest(hashes, config)
        for config in (
            base,
            AdapterConfig(8, 32.0, ("q_proj",)),
            AdapterConfig(8, 16.0, ("q_proj", "v_proj")),
            AdapterConfig(8, 16.0, ("q_proj",), use_rslora=True),
        )
    }
    assert len(digests) == 4
    assert adapter_digest(hashes, base) == adapter_digest(dict(reversed(hashes.items())), base)
    assert adapter_digest(hashes, base) != adapter_digest(
        {**hashes, tensor_name("m.q_proj", "A"): "2" * 16}, base
    )
    # the same alpha written as an integer or a float is the same config
    assert adapter_digest(
        hashes, AdapterConfig.from_json({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]})
    ) == (
        adapter_digest(
            hashes, AdapterConfig.from_json({"r": 8, "lora_alpha": 16.0, "target_modules": ["q_proj"]})
        )
    )
