"""Tiny random Llama checkpoints made at test time (no downloads), for the vLLM tests."""

from __future__ import annotations

from pathlib import Path


def make_tiny_llama(directory: str | Path, seed: int = 0, dtype: str = "float32") -> Path:
    """Save a 2-layer Llama (hidden 256, 4 heads: head_dim 64, which vLLM's CPU attention
    accepts) with random weights from ``seed``; return the directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(str(directory), safe_serialization=True)
    return Path(directory)
