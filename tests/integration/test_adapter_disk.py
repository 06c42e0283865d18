"""LoRA adapters on disk: the trainer writes PEFT's layout with a manifest, a worker reads it
(or PEFT's own output) verified, and refuses everything else before anything changes."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from weightsync.core.errors import InvalidRequest, NotFound, WeightSyncError
from weightsync.engines.reference.model import CausalLM, ModelConfig
from weightsync.lora.config import AdapterConfig
from weightsync.lora.names import tensor_name
from weightsync.trainer import adapter_digest, save_adapter
from weightsync.transports.adapters.reader import read_adapter

MODULES = CausalLM(ModelConfig.tiny()).linear_modules()
CONFIG: dict[str, Any] = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def lora_tensors(
    seed: int = 0, r: int = 4, modules: tuple[str, ...] = ("q_proj", "v_proj")
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(2):
        for name in modules:
            module = f"model.layers.{layer}.self_attn.{name}"
            fan_in, fan_out = MODULES[module]
            out[tensor_name(module, "A")] = torch.randn(r, fan_in, generator=gen)
            out[tensor_name(module, "B")] = torch.randn(fan_out, r, generator=gen)
    return out


def peft_layout(directory: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> Path:
    """An adapter directory as PEFT writes one, without weightsync's manifest."""
    directory.mkdir()
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def refusal(path: Path, roots: Any = None) -> WeightSyncError:
    with pytest.raises(WeightSyncError) as err:
        read_adapter(str(path), MODULES, roots)
    assert err.value.http_status in (400, 404), err.value
    return err.value


def test_the_trainers_adapter_reads_back_verified_with_its_version_and_digest(tmp_path: Path) -> None:
    tensors = lora_tensors()
    path = save_adapter(tensors, CONFIG, tmp_path / "lora", version={"step": 7})
    assert sorted(p.name for p in path.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "weightsync-manifest.json",
    ]
    adapter = read_adapter(str(path), MODULES, [tmp_path])
    assert adapter.digest == adapter_digest(tensors, CONFIG)
    assert adapter.manifest_version == {"step": 7} and adapter.has_version
    assert adapter.config == AdapterConfig(4, 8.0, ("q_proj", "v_proj"))
    module = "model.layers.1.self_attn.v_proj"
    a, b = adapter.matrices[module]
    assert torch.equal(a, tensors[tensor_name(module, "A")]) and torch.equal(
        b, tensors[tensor_name(module, "B")]
    )
    manifest = json.loads((path / "weightsync-manifest.json").read_text())
    assert manifest["adapter"]["digest"] == adapter.digest


def test_a_pickled_adapter_is_refused_unread(tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"

    class Payload:
        def __reduce__(self) -> tuple[Any, ...]:
            return (Path.touch, (marker,))

    directory = tmp_path / "bin"
    directory.mkdir()
    (directory / "adapter_model.bin").write_bytes(pickle.dumps(Payload()))
    (directory / "adapter_config.json").write_text(json.dumps(CONFIG))
    assert refusal(directory).code == "unsafe_adapter_format"
    assert not marker.exists()


def test_a_changed_config_or_matrix_fails_the_manifests_digest(tmp_path: Path) -> None:
    path = save_adapter(lora_tensors(), CONFIG, tmp_path / "lora", version=1)
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 64}))  # 8x the scale
    error = refusal(path)
    assert error.code == "manifest_mismatch" and "adapter_config.json" in error.message
    other = save_adapter(lora_tensors(), CONFIG, tmp_path / "other")
    raw = bytearray((other / "adapter_model.safetensors").read_bytes())
    raw[-1] ^= 1
    (other / "adapter_model.safetensors").write_bytes(bytes(raw))
    assert refusal(other).code == "manifest_mismatch"


@pytest.mark.parametrize(
    ("tensors", "config", "code"),
    [
        ({}, CONFIG, "empty_adapter"),
        (
            {
                tensor_name("model.layers.9.self_attn.q_proj", "A"): torch.zeros(4, 64),
                tensor_name("model.layers.9.self_attn.q_proj", "B"): torch.zeros(64, 4),
            },
            CONFIG,
            "unknown_module",
        ),
        (lora_tensors(r=2), CONFIG, "adapter_shape_mismatch"),
        (lora_tensors(modules=("k_proj",)), CONFIG, "untargeted_module"),
        ({k: v for k, v in lora_tensors().items() if "lora_B" not in k}, CONFIG, "incomplete_adapter"),
        (
            {
                **lora_tensors(),
                "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": torch.ones(64),
            },
            CONFIG,
            "unknown_adapter_tensor",
        ),
        ({k: v.to(torch.int32) for k, v in lora_tensors().items()}, CONFIG, "bad_adapter_dtype"),
        (lora_tensors(), {**CONFIG, "use_dora": True}, "unsupported_adapter_config"),
        (lora_tensors(), {**CONFIG, "lora_scale_mode": "x"}, "unknown_adapter_config_field"),
        (lora_tensors(), [CONFIG], "bad_adapter_config"),
    ],
)
def test_an_adapter_the_model_cannot_serve_as_written_is_refused(
    tmp_path: Path, tensors: dict[str, torch.Tensor], config: Any, code: str
) -> None:
    assert refusal(peft_layout(tmp_path / "a", tensors, config)).code == code
    if isinstance(config, dict) and code not in ("unknown_module",):
        with pytest.raises(InvalidRequest) as err:  # the trainer refuses it too, writing nothing
            save_adapter(tensors, config, tmp_path / "t")
        assert err.value.code == code
        assert not (tmp_path / "t").exists()


def test_non_finite_values_are_refused_on_both_sides(tmp_path: Path) -> None:
    tensors = lora_tensors()
    tensors[tensor_name("model.layers.0.self_attn.q_proj", "B")][3, 1] = float("nan")
    assert refusal(peft_layout(tmp_path / "a", tensors, CONFIG)).code == "non_finite_adapter"
    with pytest.raises(InvalidRequest, match="NaN"):
        save_adapter(tensors, CONFIG, tmp_path / "t")


def test_paths_that_are_no_adapter_directory_are_refused(tmp_path: Path) -> None:
    path = save_adapter(lora_tensors(), CONFIG, tmp_path / "lora")
    assert refusal(path / "adapter_model.safetensors").code == "not_an_adapter"
    assert isinstance(refusal(tmp_path / "missing"), NotFound)
    assert refusal(path, [tmp_path / "elsewhere"]).code == "path_not_allowed"
    (path / "adapter_config.json").unlink()
    assert refusal(path).code == "missing_adapter_config"
    bare = tmp_path / "bare"
    bare.mkdir()
    assert refusal(bare).code == "not_an_adapter"


def test_save_adapter_is_atomic_and_does_not_overwrite_unasked(tmp_path: Path) -> None:
    path = save_adapter(lora_tensors(0), CONFIG, tmp_path / "lora", version=1)
    with pytest.raises(FileExistsError):
        save_adapter(lora_tensors(1), CONFIG, path, version=2)
    assert read_adapter(str(path), MODULES).manifest_version == 1
    save_adapter(lora_tensors(1), CONFIG, path, version=2, overwrite=True)
    assert read_adapter(str(path), MODULES).digest == adapter_digest(lora_tensors(1), CONFIG)
    assert [p.name for p in tmp_path.iterdir()] == ["lora"]  # no temporary sibling left
