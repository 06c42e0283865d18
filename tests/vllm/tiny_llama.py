"""Tiny random Llama checkpoints made at test time (no downloads), for the vLLM tests."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    import torch


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


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def add_byte_tokenizer(directory: str | Path) -> Path:
    """Save a byte-level tokenizer with a chat template beside a tiny Llama in ``directory``:
    ``<unk>``, ``<s>``, ``</s>`` are ids 0-2 (the Llama config's bos and eos), each byte one
    token from id 3 on, so text and chat prompts fit the 512-token vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet())):
        vocab[ch] = 3 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(directory))
    return Path(directory)


@attrs.frozen
class TinyLlamas:
    """Two tiny Llamas of the same shape, ``a`` (seed 1) and ``b`` (seed 2), in ``root``."""

    root: Path
    a: Path
    b: Path
    a_tensors: dict[str, torch.Tensor]
    b_tensors: dict[str, torch.Tensor]

    @classmethod
    def make(cls, root: Path) -> TinyLlamas:
        """Make both in ``root`` (the directory the tests' servers may load checkpoints from)."""
        from safetensors.torch import load_file

        a, b = make_tiny_llama(root / "a", seed=1), make_tiny_llama(root / "b", seed=2)
        return cls(
            root, a, b, load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
        )
