"""Worker side: the groups a worker joined, and receiving a weight stream into a sink.

Packed streams (``bucket_bytes`` set) follow a three-step protocol with the trainer:

1. the worker checks the metadata against its weights, then marks itself ready in the
   group's store under ``stream_id``;
2. it waits in the store for rank 0's decision: go once every worker is ready, abort as
   soon as one refused (the trainer learns that from its HTTP reply).  No collective is
   started unless every rank is in it, so a refusal never leaves the group out of step;
3. the chunks arrive, two collectives in flight: large tensors straight into the engine's
   own tensors, small ones packed in buckets received into two reusable buffers (the next
   is received while the previous one is unpacked).

Unpacked streams (no ``packing``) are one broadcast per tensor, in order — what vLLM's and
SGLang's RLHF examples send.  Any failure after the first write is ``wrote=True``: the
worker becomes torn, and the group is dropped (a new one must be set up).
"""

from __future__ import annotations

import datetime
import functools
import threading
from collections.abc import Iterator

import torch

from weightsync.core.errors import IllegalState, LoadFailed, NotFound, WeightSyncError
from weightsync.core.requests import DistributedSource, InitGroupRequest
from weightsync.core.values import LoadStats

from ..sink import TensorSink, check_metadata, torch_dtype
from .group import Group, Window, create_group
from .layout import Bucket, Direct, bucket_capacity, plan_chunks


def ready_key(stream_id: str, rank: int) -> str:
    return f"weightsync/stream/{stream_id}/ready/{rank}"


def go_key(stream_id: str) -> str:
    return f"weightsync/stream/{stream_id}/go"


class GroupRegistry:
    """The weight-update groups of one worker, by name."""

    def __init__(self) -> None:
        self._groups: dict[str, Group] = {}
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        return sorted(self._groups)

    def join(self, req: InitGroupRequest, local_rank: int = 0) -> None:
        """Join ``req``'s group (blocking, up to ``req.timeout_s``)."""
        with self._lock:
            if req.group_name in self._groups:
                raise IllegalState(
                    f"group {req.group_name!r} already exists; destroy it first", code="group_exists"
                )
        group = create_group(
            req.group_name,
            master_address=req.master_address,
            master_port=req.master_port,
            rank=req.rank_offset + local_rank,
            world_size=req.world_size,
            backend=req.backend,
            timeout_s=req.timeout_s,
        )
        with self._lock:
            self._groups[req.group_name] = group

    def destroy(self, name: str) -> None:
        with self._lock:
            group = self._groups.pop(name, None)
        if group is None:
            raise NotFound(f"no weight-update group {name!r}", code="unknown_group")
        group.close()

    def get(self, name: str) -> Group:
        group = self._groups.get(name)
        if group is None:
            raise NotFound(
                f"no weight-update group {name!r}; call init_weights_update_group", code="unknown_group"
            )
        return group

    def close(self) -> None:
        for name in self.names():
            self.destroy(name)

    def receive(self, source: DistributedSource, sink: TensorSink) -> LoadStats:
        """Receive ``source``'s stream into ``sink`` (blocking; run it in a thread).

        Raises ``LoadFailed`` (``wrote`` tells whether anything was written)."""
        import time

        t0 = time.perf_counter()
        try:
            group = self.get(source.group_name)
            check_metadata(source.tensors, sink.specs, allow_partial=True)
        except WeightSyncError as exc:
            raise LoadFailed(exc.message, wrote=False, cause=exc) from exc
        try:
            if source.bucket_bytes is None:
                self._receive_per_tensor(group, source, sink)
            else:
                self._receive_buckets(group, source, sink)
        except LoadFailed:
            raise  # a clean abort: the group is still in step
        except Exception as exc:
            self._drop(group)
            raise LoadFailed(
                f"weight stream on group {group.name!r} broke: {exc}",
                wrote=sink.wrote,
                code="stream_failed",
            ) from exc
        return LoadStats(tensors=sink.tensors, bytes=sink.bytes, seconds=time.perf_counter() - t0)

    def iter_stream(self, source: DistributedSource) -> Iterator[tuple[str, torch.Tensor]]:
        """The stream as ``(name, tensor)`` pairs for engines that pull weights (vLLM's
        reload takes an iterator).  Every tensor yielded is its own copy.  Raises
        ``NotFound`` at once for an unknown group; stream failures raise while iterating
        (``LoadFailed``) and drop the group."""
        group = self.get(source.group_name)
        return self._pull(group, source)

    def _pull(self, group: Group, source: DistributedSource) -> Iterator[tuple[str, torch.Tensor]]:
        try:
            if source.bucket_bytes is None:
                for spec in source.tensors:
                    t = torch.empty(spec.shape, dtype=torch_dtype(spec.dtype), device=group.device)
                    group.wait(group.broadcast(t))
                    yield spec.name, t
                return
            assert source.stream_id is not None
            chunks = plan_chunks(source.tensors, source.bucket_bytes)
            self._handshake(group, source.stream_id)
            buffers = group.buffers(bucket_capacity(chunks)) if bucket_capacity(chunks) else []
            packed = 0
            for chunk in chunks:
                if isinstance(chunk, Direct):
                    t = torch.empty(
                        chunk.spec.shape, dtype=torch_dtype(chunk.spec.dtype), device=group.device
                    )
                    group.wait(group.broadcast(t))
                    yield chunk.spec.name, t
                    continue
                buf = buffers[packed % 2]
                packed += 1
                group.wait(group.broadcast(buf[: chunk.size]))
                for slot in chunk.slots:
                    raw = buf[slot.offset : slot.offset + slot.nbytes]
                    yield (
                        slot.spec.name,
                        raw.view(torch_dtype(slot.spec.dtype)).reshape(slot.spec.shape).clone(),
                    )
        except LoadFailed:
            raise
        except Exception as exc:
            self._drop(group)
            raise LoadFailed(
                f"weight stream on group {group.name!r} broke: {exc}", wrote=True, code="stream_failed"
            ) from exc

    @staticmethod
    def _handshake(group: Group, stream_id: str) -> None:
        group.store.set(ready_key(stream_id, group.rank), b"1")
        group.store.wait([go_key(stream_id)], datetime.timedelta(seconds=group.timeout_s))
        if group.store.get(go_key(stream_id)) != b"1":
            aborted = IllegalState(
                "the trainer aborted the stream (another worker refused it)", code="stream_aborted"
            )
            raise LoadFailed(aborted.message, wrote=False, cause=aborted)

    def _drop(self, group: Group) -> None:
        with self._lock:
            if self._groups.get(group.name) is group:
                del self._groups[group.name]
        group.close()

    @staticmethod
    def _receive_per_tensor(group: Group, source: DistributedSource, sink: TensorSink) -> None:
        for spec in source.tensors:
            t = torch.empty(spec.shape, dtype=torch_dtype(spec.dtype), device=group.device)
            group.wait(group.broadcast(t))
            sink.write(spec.name, t)

    @staticmethod
    def _receive_buckets(group: Group, source: DistributedSource, sink: TensorSink) -> None:
        assert source.bucket_bytes is not None and source.stream_id is not None
        chunks = plan_chunks(source.tensors, source.bucket_bytes)
        buffers = group.buffers(bucket_capacity(chunks)) if bucket_capacity(chunks) else []
        group.store.set(ready_key(source.stream_id, group.rank), b"1")
        group.store.wait([go_key(source.stream_id)], datetime.timedelta(seconds=group.timeout_s))
        if group.store.get(go_key(source.stream_id)) != b"1":
            aborted = IllegalState(
                "the trainer aborted the stream (another worker refused it)", code="stream_aborted"
            )
            raise LoadFailed(aborted.message, wrote=False, cause=aborted)
        window = Window(group)
        packed = 0
        for chunk in chunks:
            window.make_room()
            if isinstance(chunk, Direct):
                target = sink.direct_target(chunk.spec, group.device)
                if target is not None:  # straight into the engine's tensor: no copy
                    window.post(target, functools.partial(sink.written_directly, chunk.spec, chunk.nbytes))
                else:
                    tmp = torch.empty(
                        chunk.spec.shape, dtype=torch_dtype(chunk.spec.dtype), device=group.device
                    )
                    window.post(tmp, functools.partial(sink.write, chunk.spec.name, tmp))
            else:
                buf = buffers[packed % 2]
                packed += 1
                window.post(buf[: chunk.size], functools.partial(_unpack, sink, buf, chunk))
        window.drain()


def _unpack(sink: TensorSink, buf: torch.Tensor, bucket: Bucket) -> None:
    for slot in bucket.slots:
        raw = buf[slot.offset : slot.offset + slot.nbytes]
        sink.write(slot.spec.name, raw.view(torch_dtype(slot.spec.dtype)).reshape(slot.spec.shape))
