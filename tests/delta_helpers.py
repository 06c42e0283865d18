"""Weights and delta checkpoints for the delta tests: a base, a target that changes a given
fraction of the elements of every tensor, and deltas between them (hostile ones included)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import requests
import torch

from tests.helpers import TINY
from weightsync.core import Controller, Declared
from weightsync.engines.reference import ReferenceEngine
from weightsync.serve import ServerThread, create_app
from weightsync.trainer.delta import compute_delta, save_delta
from weightsync.transports.delta.manifest import DeltaManifest
from weightsync.transports.hashing import tensor_hashes


def base_weights() -> dict[str, torch.Tensor]:
    """The weights a fresh tiny reference engine starts with (version "A" in these tests)."""
    return {n: t.detach().clone() for n, t in ReferenceEngine(TINY).model.weights().items()}


def changed(
    weights: dict[str, torch.Tensor], fraction: float = 0.01, seed: int = 7
) -> dict[str, torch.Tensor]:
    """``weights`` with ``fraction`` of every tensor's elements moved by a step large enough to
    change greedy outputs (at least one element per tensor)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in weights.items():
        flat = t.clone().reshape(-1)
        k = max(1, int(flat.numel() * fraction))
        idx = torch.randperm(flat.numel(), generator=gen)[:k]
        flat[idx] = flat[idx] + torch.randn(k, generator=gen).to(flat.dtype)
        out[name] = flat.reshape(t.shape)
    return out


def write_delta(
    base: dict[str, torch.Tensor],
    target: dict[str, torch.Tensor],
    path: Path,
    *,
    encoding: str = "sparse",
    base_version: Any = "A",
    target_version: Any = "B",
    edit: Callable[[DeltaManifest, dict[str, torch.Tensor]], DeltaManifest | None] | None = None,
) -> Path:
    """Compute and save the delta; ``edit(manifest, payload)`` may change the payload in place
    or return another manifest first (a hostile delta, written with correct checksums)."""
    manifest, payload = compute_delta(
        base, target, base_version=base_version, target_version=target_version, encoding=encoding
    )
    if edit is not None:
        manifest = edit(manifest, payload) or manifest
    return save_delta(manifest, payload, path)


@attrs.define
class Worker:
    url: str
    engine: ReferenceEngine

    def post(self, route: str, **body: Any) -> requests.Response:
        return requests.post(f"{self.url}/engine/{route}", json=body, timeout=60)

    def state(self) -> dict[str, Any]:
        return dict(self.post("get_weight_version").json())

    def held(self) -> dict[str, str]:
        return tensor_hashes(self.engine.model.weights().items())


@contextlib.contextmanager
def delta_worker(tmp_path: Path) -> Iterator[Worker]:
    """A paused loopback worker on the seeded weights, declared "A", reading under ``tmp_path``."""
    engine = ReferenceEngine(TINY, allowed_weight_dirs=[tmp_path])
    with ServerThread(create_app(Controller(engine, version=Declared("A")))) as server:
        worker = Worker(server.url, engine)
        assert worker.post("pause_generation").status_code == 200
        yield worker
