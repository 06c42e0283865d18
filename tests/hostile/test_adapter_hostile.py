"""Every byte of an adapter directory is hostile: whatever is written into its config, its
safetensors file or its manifest, reading it either yields a verified adapter or raises one
4xx refusal of the error family, and a worker's slot is unchanged by a refused load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightsync.core.errors import WeightSyncError
from weightsync.engines.reference.model import CausalLM, ModelConfig
from weightsync.lora.names import tensor_name
from weightsync.trainer import save_adapter
from weightsync.transports.adapters.reader import read_adapter

MODULES = CausalLM(ModelConfig.tiny()).linear_modules()
FILES = ("adapter_config.json", "adapter_model.safetensors", "weightsync-manifest.json")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    gen = torch.Generator().manual_seed(0)
    module = "model.layers.0.self_attn.q_proj"
    fan_in, fan_out = MODULES[module]
    tensors = {
        tensor_name(module, "A"): torch.randn(2, fan_in, generator=gen),
        tensor_name(module, "B"): torch.randn(fan_out, 2, generator=gen),
    }
    config = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}
    return save_adapter(tensors, config, tmp_path_factory.mktemp("adapter") / "a", version=1)


def read_or_refuse(path: Path) -> Any:
    try:
        return read_adapter(str(path), MODULES)
    except WeightSyncError as exc:
        assert 400 <= exc.http_status < 500, exc
        return exc


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(
    file=st.sampled_from(FILES),
    at=st.integers(min_value=0, max_value=4096),
    patch=st.binary(min_size=1, max_size=16),
    truncate=st.booleans(),
)
def test_a_corrupted_adapter_is_refused_with_a_4xx_or_read_verified(
    pristine: Path, tmp_path: Path, file: str, at: int, patch: bytes, truncate: bool
) -> None:
    work = tmp_path / "work"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(pristine, work)
    raw = bytearray((work / file).read_bytes())
    at %= len(raw)
    raw = raw[:at] if truncate else raw[:at] + patch + raw[at + len(patch) :]
    (work / file).write_bytes(bytes(raw))
    outcome = read_or_refuse(work)
    if not isinstance(outcome, WeightSyncError):  # a change that still reads must be harmless
        assert outcome.digest == read_adapter(str(pristine), MODULES).digest


@settings(max_examples=100, deadline=None)
@given(
    config=st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
        max_leaves=10,
    )
)
def test_any_json_config_beside_good_tensors_reads_or_is_refused(pristine: Path, config: Any) -> None:
    path = Path(str(pristine) + "-config")
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(pristine, path)
    (path / "adapter_config.json").write_text(json.dumps(config))
    assert isinstance(read_or_refuse(path), WeightSyncError)  # never the manifest's adapter
