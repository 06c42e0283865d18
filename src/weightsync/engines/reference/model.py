"""A small Llama/Qwen2-style causal transformer in plain torch, with HF weight names.

RMSNorm, rotary embeddings, grouped-query attention (optional q/k/v biases, as in Qwen2),
SwiGLU MLP, optional tied embeddings.  Names follow Hugging Face's layout
(``model.layers.0.self_attn.q_proj.weight``), so a Qwen2.5-0.5B-shaped config has exactly
the 290 tensors of that checkpoint, and the default config is byte-level and tiny enough to
generate tens of tokens per second per request on two CPU cores.

The KV cache is a fixed set of *slots* (one per concurrent request), so a decode step runs
the whole batch at once.

A model can also be one rank's shard of a tensor-parallel model (:meth:`CausalLM.shard`):
it then holds its share of the heads and MLP features, and ``reduce`` sums the partial
outputs of its row-parallel projections over the ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import attrs
import torch
import torch.nn.functional as F
from torch import nn

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Reduce = Callable[[torch.Tensor], torch.Tensor]


class Lora(Protocol):
    """LoRA adapters of a batch's rows (:class:`~.lora_batch.LoraBatch`): ``apply(module, x, y)``
    is ``module``'s output ``y`` for input ``x``, with each row's adapter added."""

    def apply(self, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...


def _alone(x: torch.Tensor) -> torch.Tensor:
    return x


@attrs.frozen
class ModelConfig:
    vocab_size: int = 256
    hidden_size: int = 512
    intermediate_size: int = 1408
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 4
    max_position: int = 512
    qkv_bias: bool = True
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    dtype: str = "float32"
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def tiny(cls, **overrides: Any) -> ModelConfig:
        """A very small model for tests: fast to build, fast to generate."""
        base = dict(
            hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, max_position=256
        )
        return cls(**{**base, **overrides})  # type: ignore[arg-type]

    @classmethod
    def qwen2_5_0_5b(cls, **overrides: Any) -> ModelConfig:
        """The shapes of Qwen2.5-0.5B (290 tensors, ~1 GB in bf16), randomly initialised."""
        base = dict(
            vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
            num_kv_heads=2, max_position=512, qkv_bias=True, tie_embeddings=True, dtype="bfloat16",
        )  # fmt: skip
        return cls(**{**base, **overrides})  # type: ignore[arg-type]


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + 1e-6)).to(x.dtype) * self.weight


class Attention(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.c = c
        kv = c.num_kv_heads * c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.hidden_size, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, kv, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, kv, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.hidden_size, c.hidden_size, bias=False)


class MLP(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size)
        self.mlp = MLP(c)


class Inner(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size)


class CausalLM(nn.Module):
    """The model plus a slot KV cache of shape [layers, 2, slots, kv_heads, positions, head_dim]."""

    def __init__(self, c: ModelConfig, *, slots: int = 8) -> None:
        super().__init__()
        self.c = c
        gen = torch.Generator().manual_seed(c.seed)
        with torch.device("cpu"):
            self.model = Inner(c)
            if not c.tie_embeddings:
                self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.5 / math.sqrt(p.shape[-1]), generator=gen)
        self.to(getattr(torch, c.dtype))
        self.requires_grad_(False)
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim))
        freqs = torch.outer(torch.arange(c.max_position).float(), inv)
        self.cos, self.sin = freqs.cos(), freqs.sin()
        self.slots = slots
        self.kv: torch.Tensor | None = None
        self.heads, self.kv_heads = c.num_heads, c.num_kv_heads  # this rank's share
        self.reduce: Reduce = _alone

    def shard(self, parts: Mapping[str, Any], size: int, reduce: Reduce) -> None:
        """Keep only this rank's part of every weight (``parts``: name -> ``"full"`` or
        ``(dim, start, length)``, see :mod:`.tp_layout`), as rank of ``size``; ``reduce``
        sums a tensor over the ranks."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                part = parts[name]
                if part != "full":
                    dim, start, length = part
                    p.data = p.data.narrow(dim, start, length).clone()
        self.heads, self.kv_heads = self.c.num_heads // size, self.c.num_kv_heads // size
        self.reduce = reduce
        self.kv = None

    def weights(self) -> dict[str, torch.Tensor]:
        """The served weights by HF name (tied embeddings appear once)."""
        return dict(self.named_parameters())

    def linear_modules(self) -> dict[str, tuple[int, int]]:
        """The linear modules a LoRA adapter may target, by HF path (``model.layers.0.self_attn.q_proj``):
        ``(in_features, out_features)`` of the full model."""
        c, kv = self.c, self.c.num_kv_heads * self.c.head_dim
        shapes = {
            "q_proj": (c.hidden_size, c.hidden_size),
            "k_proj": (c.hidden_size, kv),
            "v_proj": (c.hidden_size, kv),
            "o_proj": (c.hidden_size, c.hidden_size),
        }
        mlp = {
            "gate_proj": (c.hidden_size, c.intermediate_size),
            "up_proj": (c.hidden_size, c.intermediate_size),
            "down_proj": (c.intermediate_size, c.hidden_size),
        }
        out = {f"model.layers.{i}.self_attn.{n}": s for i in range(c.num_layers) for n, s in shapes.items()}
        out.update({f"model.layers.{i}.mlp.{n}": s for i in range(c.num_layers) for n, s in mlp.items()})
        if not c.tie_embeddings:
            out["lm_head"] = (c.hidden_size, c.vocab_size)
        return out

    def _cache(self) -> torch.Tensor:
        if self.kv is None:
            c = self.c
            shape = (c.num_layers, 2, self.slots, self.kv_heads, c.max_position, c.head_dim)
            self.kv = torch.zeros(shape, dtype=getattr(torch, c.dtype))
        return self.kv

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        # x: [B, H, T, D]; pos: [B, T]
        cos = self.cos[pos].unsqueeze(1).to(x.dtype)
        sin = self.sin[pos].unsqueeze(1).to(x.dtype)
        x1, x2 = x[..., ::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)

    def _forward(
        self, tokens: torch.Tensor, pos: torch.Tensor, attend: Attend, lora: Lora | None = None
    ) -> torch.Tensor:
        """The transformer over ``tokens`` [B, T] at positions ``pos`` [B, T]; ``attend(i, q, k, v)``
        does layer ``i``'s attention (with or without the cache); ``lora`` adds the rows'
        adapters to the linear modules they target.  Returns hidden states."""
        c = self.c
        b, t = tokens.shape

        def linear(module: nn.Linear, path: str, x: torch.Tensor) -> torch.Tensor:
            y = module(x)
            return y if lora is None else lora.apply(path, x, y)

        h = self.model.embed_tokens(tokens)
        for i, layer in enumerate(self.model.layers):
            a, m, at = layer.self_attn, layer.mlp, f"model.layers.{i}.self_attn."
            x = layer.input_layernorm(h)
            q = linear(a.q_proj, at + "q_proj", x).view(b, t, self.heads, c.head_dim).transpose(1, 2)
            k = linear(a.k_proj, at + "k_proj", x).view(b, t, self.kv_heads, c.head_dim).transpose(1, 2)
            v = linear(a.v_proj, at + "v_proj", x).view(b, t, self.kv_heads, c.head_dim).transpose(1, 2)
            att = attend(i, self._rope(q, pos), self._rope(k, pos), v)
            h = h + self.reduce(linear(a.o_proj, at + "o_proj", att.transpose(1, 2).reshape(b, t, -1)))
            x, mlp = layer.post_attention_layernorm(h), f"model.layers.{i}.mlp."
            gated = F.silu(linear(m.gate_proj, mlp + "gate_proj", x)) * linear(m.up_proj, mlp + "up_proj", x)
            h = h + self.reduce(linear(m.down_proj, mlp + "down_proj", gated))
        return self.model.norm(h)

    def _logits(self, h: torch.Tensor, lora: Lora | None = None) -> torch.Tensor:
        if self.c.tie_embeddings:
            return h @ self.model.embed_tokens.weight.T
        logits = h @ self.lm_head.weight.T
        return logits if lora is None else lora.apply("lm_head", h, logits)

    @torch.no_grad()
    def forward_slots(
        self, tokens: torch.Tensor, slots: torch.Tensor, start: torch.Tensor, lora: Lora | None = None
    ) -> torch.Tensor:
        """Run ``tokens`` [B, T] for requests in cache ``slots`` [B] whose first token is at
        position ``start`` [B], each with its LoRA adapter (``lora``, none by default); write
        their K/V into the cache; return last-position logits [B, V].

        With T > 1 the batch must be a single request (prefill); decode steps use T == 1.
        """
        kv = self._cache()
        b, t = tokens.shape
        pos = start.unsqueeze(1) + torch.arange(t).unsqueeze(0)  # [B, T]
        end = int((start + t).max())
        group = self.heads // self.kv_heads
        # mask [B, 1, T, end]: key position j visible to query at position p iff j <= p
        mask = torch.arange(end).view(1, 1, 1, end) <= pos.view(b, 1, t, 1)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            for j in range(b):
                s, p0 = int(slots[j]), int(start[j])
                kv[i, 0, s, :, p0 : p0 + t] = k[j]
                kv[i, 1, s, :, p0 : p0 + t] = v[j]
            keys = kv[i, 0, slots, :, :end].repeat_interleave(group, dim=1)
            vals = kv[i, 1, slots, :, :end].repeat_interleave(group, dim=1)
            return F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)

        return self._logits(self._forward(tokens, pos, attend, lora)[:, -1], lora).float()

    def forward_full(self, tokens: torch.Tensor, lora: Lora | None = None) -> torch.Tensor:
        """Logits [B, T, V] for whole sequences, without the cache (for training; autograd on),
        each with its LoRA adapter (``lora``)."""
        b, t = tokens.shape
        group = self.heads // self.kv_heads

        def attend(_: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        return self._logits(
            self._forward(tokens, torch.arange(t).unsqueeze(0).expand(b, t), attend, lora), lora
        )

    def copy_slot_prefix(self, slot: int, blocks: list[torch.Tensor], block: int) -> None:
        """Write cached prefix blocks (each [layers, 2, kv_heads, block, head_dim]) into ``slot``."""
        kv = self._cache()
        for n, b in enumerate(blocks):
            kv[:, :, slot, :, n * block : (n + 1) * block] = b

    def read_block(self, slot: int, n: int, block: int) -> torch.Tensor:
        return self._cache()[:, :, slot, :, n * block : (n + 1) * block].clone()
