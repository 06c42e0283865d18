"""`engines.vllm.delta` without vLLM: a sharded vLLM worker refuses deltas before reading
anything, and the checkpoint-form copy a delta patches serves only tensors whose hash is the
one the worker holds (a load's tensor once the load committed, the served checkpoint's from
its files).  The delta itself on a real vLLM engine: tests/vllm/test_vllm_delta.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from weightsync.core.errors import IllegalState, NotSupported
from weightsync.core.held import HeldWeights
from weightsync.core.snapshot import TensorSpec
from weightsync.core.sources import DeltaSource, DeltaStreamSource, DiskSource
from weightsync.engines.vllm.delta import BaseCopy, refuse_sharded
from weightsync.trainer import save_checkpoint
from weightsync.transports.hashing import tensor_hash, tensor_hashes


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(4, 8, generator=gen), "b.weight": torch.randn(16, generator=gen)}


def _specs(weights: dict[str, torch.Tensor]) -> dict[str, TensorSpec]:
    return {n: TensorSpec(n, "float32", tuple(t.shape)) for n, t in weights.items()}


@pytest.mark.parametrize(
    "source",
    [DeltaSource("/d"), DeltaStreamSource("g", [TensorSpec("a.weight", "float32", (4, 8))], (1,))],
)
def test_a_sharded_vllm_worker_refuses_deltas_with_501(source: DeltaSource | DeltaStreamSource) -> None:
    with pytest.raises(NotSupported) as info:
        refuse_sharded(source, 2)
    assert info.value.code == "not_supported" and info.value.http_status == 501
    refuse_sharded(source, 1)  # one rank: taken
    refuse_sharded(DiskSource("/ckpt"), 2)  # full weights: not this refusal's business


def test_the_copy_reads_the_served_checkpoint_when_its_hashes_are_the_held_ones(tmp_path: Path) -> None:
    weights = _weights()
    model = save_checkpoint(weights, tmp_path / "served")
    copy = BaseCopy(str(model))
    base = copy.base(HeldWeights.starting_with(tensor_hashes(weights.items())), _specs(weights))
    assert all(torch.equal(base[n], t) for n, t in weights.items())


def test_the_copy_refuses_a_base_it_does_not_hold(tmp_path: Path) -> None:
    weights = _weights()
    copy = BaseCopy(str(save_checkpoint(weights, tmp_path / "served")))
    other = _weights(1)  # the worker holds other weights than the served checkpoint's
    with pytest.raises(IllegalState) as info:
        copy.base(HeldWeights.starting_with(tensor_hashes(other.items())), _specs(other))
    assert info.value.code == "base_mismatch"
    with pytest.raises(IllegalState):  # nor anything while the digest is unknown
        copy.base(HeldWeights.starting_with(tensor_hashes(weights.items())).torn(), _specs(weights))


def test_a_recorded_tensor_counts_once_its_load_committed(tmp_path: Path) -> None:
    weights = _weights()
    copy = BaseCopy(str(save_checkpoint(weights, tmp_path / "served")))
    new = torch.full((16,), 3.0)
    held = HeldWeights.starting_with(tensor_hashes(weights.items())).loaded({"b.weight": tensor_hash(new)}, 1)
    copy.record("b.weight", new)
    new.zero_()  # the loader's memory is reused: the copy kept the bytes
    with pytest.raises(IllegalState):  # recorded, not committed: no hash, and the file's is not held
        copy.base(held, _specs(weights))
    copy.commit({"b.weight": held.hashes["b.weight"]})
    base = copy.base(held, _specs(weights))
    assert torch.equal(base["b.weight"], torch.full((16,), 3.0)) and torch.equal(
        base["a.weight"], weights["a.weight"]
    )
