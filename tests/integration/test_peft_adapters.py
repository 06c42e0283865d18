"""Adapters PEFT itself wrote (``save_pretrained``, its real ``adapter_config.json`` with every
field it writes): a worker reads them verified, digests them as the trainer side computes,
and the reference engine computes with them what their merged weights compute."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.test_reference_lora import merged_engine, run, same, serve
from weightsync.engines.reference import ModelConfig, ReferenceEngine
from weightsync.engines.reference.model import CausalLM
from weightsync.trainer import adapter_digest
from weightsync.transports.adapters.reader import read_adapter

peft = pytest.importorskip("peft", reason="the peers extra is not installed (make test installs it)")

CONFIG = ModelConfig.tiny()


def peft_adapter(directory: Path, r: int, lora_alpha: int, targets: list[str]) -> dict[str, torch.Tensor]:
    """A LoRA adapter of a Llama of the reference model's shapes, saved by PEFT into
    ``directory``; returns its tensors (PEFT's names)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = CONFIG
    hf = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_hidden_layers=c.num_layers,
            num_attention_heads=c.num_heads,
            num_key_value_heads=c.num_kv_heads,
        )
    )
    model = peft.get_peft_model(
        hf, peft.LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=targets, lora_dropout=0.0)
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero: make the adapter change something
                p.normal_(0, 0.5)
    model.save_pretrained(str(directory))
    return {k: v.detach() for k, v in peft.get_peft_model_state_dict(model).items()}


def test_peft_save_pretrained_output_reads_and_digests_as_the_trainer_computes(tmp_path: Path) -> None:
    tensors = peft_adapter(tmp_path / "peft", 4, 16, ["q_proj", "v_proj", "down_proj"])
    adapter = read_adapter(str(tmp_path / "peft"), CausalLM(CONFIG).linear_modules())
    written = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert adapter.digest == adapter_digest(tensors, written)
    assert not adapter.has_version  # PEFT writes no manifest
    assert adapter.config.scale == 4.0 and len(adapter.matrices) == 6


def test_an_adapter_peft_wrote_computes_what_its_merged_weights_compute(tmp_path: Path) -> None:
    tensors = peft_adapter(tmp_path / "peft", 8, 4, ["k_proj", "up_proj"])

    async def main() -> tuple[Any, Any, Any]:
        engine, merged = (
            ReferenceEngine(CONFIG),
            merged_engine({k: v.float() for k, v in tensors.items()}, 4 / 8),
        )
        try:
            await serve(engine, "peft", tmp_path / "peft")
            return await run(engine, "peft"), await run(engine), await run(merged)
        finally:
            await engine.close()
            await merged.close()

    lora, base, want = asyncio.run(main())
    assert same(lora, want) and not same(lora, base)
    assert lora.adapter is not None and not lora.adapter.version_declared  # PEFT names no version
