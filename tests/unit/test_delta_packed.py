"""The packed delta stream's bytes (the trainer's ``packed_bytes``) read back by the worker's
``split_packed`` into each tensor's indices and values, for tensors of mixed element sizes.

Failed on the previous code: after a bfloat16 tensor's values the next tensor's int32 indices
start at an offset that is not a multiple of 4, and the worker's view of them raised ("storage
offset must be divisible by 4"), so a packed delta push of a bfloat16 model broke its stream."""

from __future__ import annotations

import pytest
import torch

from weightsync.core.snapshot import TensorSpec
from weightsync.trainer.delta import compute_delta
from weightsync.trainer.delta_push import packed_bytes
from weightsync.transports.delta.stream import packed_sizes, split_packed


@pytest.mark.parametrize("dtypes", [("bfloat16", "float32", "bfloat16"), ("float16", "bfloat16", "float32")])
def test_packed_bytes_of_mixed_element_sizes_split_back_into_each_tensors_indices_and_values(
    dtypes: tuple[str, ...],
) -> None:
    gen = torch.Generator().manual_seed(5)
    base = {
        f"t{i}": torch.randn(97 + 13 * i, generator=gen).to(getattr(torch, d)) for i, d in enumerate(dtypes)
    }
    target = {}
    for n, t in base.items():
        flat = t.clone()
        flat[torch.randperm(t.numel(), generator=gen)[:7]] += 1  # 7 changes: odd byte counts
        target[n] = flat
    manifest, payload = compute_delta(base, target, base_version="A", target_version="B")
    buf = packed_bytes(manifest, payload)
    specs = [TensorSpec(t.name, t.dtype, t.shape) for t in manifest.changed]
    sizes = packed_sizes(specs, [t.changed for t in manifest.changed])
    assert sum(a + b for a, b in sizes) == buf.numel()
    offsets = [sum(a + b for a, b in sizes[:k]) for k in range(len(sizes))]
    assert any(o % 4 for o in offsets), "the layout must put a section off a 4-byte boundary"
    parts = split_packed(buf, specs, sizes)
    for t, part in zip(manifest.changed, parts, strict=True):
        assert torch.equal(part[f"i:{t.name}"].to(torch.int64), payload[t.indices].to(torch.int64))
        got, sent = part[f"v:{t.name}"], payload[t.values]
        assert got.dtype == sent.dtype and torch.equal(
            got.view(torch.uint8), sent.contiguous().view(torch.uint8)
        )
