"""Trainer side of the packed delta stream: a delta (:func:`~weightsync.trainer.delta.compute_delta`)
pushed over a :class:`~weightsync.trainer.broadcast.Broadcaster`'s group.

Each worker is posted ``update_weights_from_distributed`` with the changed tensors' names,
dtypes and shapes and a ``delta`` object: the counts, ``stream: "packed"``, a ``stream_id``, and
the claims of the manifest (``base``: version and digest; per tensor ``target_hashes``,
``base_linear``, ``target_linear``), which the worker checks exactly as it checks a delta
checkpoint's (``409 base_mismatch`` before any collective, the linear check after the write,
undone on failure).  Before posting, the byte count and bucket size go in the group's store;
after every worker is ready (or one refused: then every worker is told to abort), the bytes —
per changed tensor its indices (int32; int64 past 2**31 elements) then its values — are
broadcast in buckets (see :mod:`weightsync.transports.delta.stream`).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import torch

from weightsync.core.errors import EngineFailure
from weightsync.core.snapshot import TensorSpec
from weightsync.trainer.pushes import finish_push
from weightsync.transports.delta.manifest import DeltaManifest
from weightsync.transports.delta.stream import index_dtype, packed_manifest
from weightsync.transports.distributed.group import Group
from weightsync.transports.distributed.keys import go_key, manifest_key


def delta_body(manifest: DeltaManifest, stream_id: str) -> tuple[list[TensorSpec], dict[str, Any]]:
    """The changed tensors and the ``delta`` object of the update every worker is posted."""
    changed = manifest.changed
    if not changed:
        raise ValueError("the delta changes nothing: declare the version instead (set_weight_version)")
    specs = [TensorSpec(t.name, t.dtype, t.shape) for t in changed]
    delta = {
        "counts": [t.changed for t in changed], "stream": "packed", "stream_id": stream_id,
        "base": manifest.base.to_json(), "target": manifest.target.to_json(),
        "target_hashes": [t.target_hash for t in changed],
        "base_linear": [list(t.base_linear) for t in changed],
        "target_linear": [list(t.target_linear) for t in changed],
    }  # fmt: skip
    return specs, delta


def packed_bytes(manifest: DeltaManifest, payload: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The stream's bytes: per changed tensor, its indices then its values."""
    if manifest.encoding != "sparse":
        raise ValueError("the delta stream carries sparse deltas (compute_delta(..., encoding='sparse'))")
    parts = []
    for t in manifest.changed:
        assert t.indices is not None and t.values is not None
        idx = payload[t.indices].reshape(-1).to(index_dtype(t.numel)).contiguous()
        parts += [idx.view(torch.uint8), payload[t.values].reshape(-1).contiguous().view(torch.uint8)]
    return torch.cat(parts)


async def push_delta(
    b: Any,
    manifest: DeltaManifest,
    payload: Mapping[str, torch.Tensor],
    body: dict[str, Any],
    failed: Callable[..., BaseException],
) -> dict[str, dict[str, Any]]:
    """Push ``manifest``'s delta to every worker of the ``Broadcaster`` ``b`` (``body``: the
    update's options); returns each worker's reply by URL.  Raises ``failed(failures, replies)``
    (its ``PushFailed``) naming each worker that failed."""

    if b.group is None:
        raise EngineFailure("not connected: call connect() first", code="not_connected")
    group = b.group
    stream_id = uuid.uuid4().hex
    specs, delta = delta_body(manifest, stream_id)
    data = packed_bytes(manifest, payload).to(group.device)
    group.store.set(manifest_key(stream_id), packed_manifest(data.numel(), b.bucket_bytes))
    clients = await b._pool.get()
    names, dtypes, shapes = [s.name for s in specs], [s.dtype for s in specs], [list(s.shape) for s in specs]
    posts = [
        asyncio.ensure_future(
            c.update_weights_from_distributed(names, dtypes, shapes, b.group_name, delta=delta, **body)
        )
        for c in clients
    ]
    try:
        go = await b._wait_ready(group, stream_id, posts)
        sending = asyncio.to_thread(_send, group, data, b.bucket_bytes, go, stream_id)
        return await finish_push(b._or_drop(group, sending), posts, b.urls, failed)
    finally:
        for p in posts:
            p.cancel()


def _send(group: Group, data: torch.Tensor, bucket_bytes: int, go: bool, stream_id: str) -> None:
    group.store.set(go_key(stream_id), b"1" if go else b"0")
    if go:
        for start in range(0, data.numel(), bucket_bytes):
            group.wait(group.broadcast(data[start : start + bucket_bytes]))
