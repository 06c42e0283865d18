"""`copy_into`: the channels' one-thread copy is bit-exact for every dtype and layout, and
leaves casts to torch."""

from __future__ import annotations

import pytest
import torch

from weightsync.core.dtypes import DTYPES
from weightsync.transports.copying import copy_into
from weightsync.transports.sink import torch_dtype


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (every bit pattern, NaNs included; bools 0 or 1)."""
    g = torch.Generator().manual_seed(seed)
    n = torch.Size(shape).numel() * dtype.itemsize
    raw = torch.randint(0, 2 if dtype == torch.bool else 256, (n,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def _supported() -> list[str]:
    out = []
    for name in DTYPES:
        try:
            torch_dtype(name)
        except Exception:
            continue
        out.append(name)
    return out


@pytest.mark.parametrize("name", _supported())
def test_copy_into_is_bit_exact_for_every_dtype_and_strided_views(name: str) -> None:
    dtype = torch_dtype(name)
    src = _random((6, 10), dtype, seed=1)
    dst_base = torch.zeros(6, 20, dtype=dtype)
    dst = dst_base[:, ::2]  # strided destination
    copy_into(dst, src.t().contiguous().t())  # strided source
    assert torch.equal(dst.contiguous().view(torch.uint8), src.view(torch.uint8))
    untouched = dst_base[:, 1::2].contiguous().view(torch.uint8)
    assert torch.equal(untouched, torch.zeros(6, 10, dtype=dtype).view(torch.uint8))


def test_copy_into_a_parameter_and_an_inference_tensor() -> None:
    src = _random((4, 4), torch.bfloat16, seed=2)
    param = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.bfloat16))
    copy_into(param, src)
    assert torch.equal(param.detach().view(torch.int16), src.view(torch.int16))
    with torch.inference_mode():
        frozen = torch.zeros(4, 4, dtype=torch.bfloat16)
    copy_into(frozen, src)
    assert torch.equal(frozen.view(torch.int16), src.view(torch.int16))


def test_copy_into_casts_like_copy_when_dtypes_differ() -> None:
    src = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 3
    dst = torch.zeros(3, 4, dtype=torch.bfloat16)
    copy_into(dst, src)
    assert torch.equal(dst, src.to(torch.bfloat16))
