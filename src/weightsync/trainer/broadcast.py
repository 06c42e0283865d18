"""Trainer side: :class:`Broadcaster` pushes named tensors to many workers at once.

>>> b = Broadcaster(["http://w1:8000", "http://w2:8000"], backend="gloo")
>>> b.connect()                                   # rank 0 + one rank per worker
>>> b.push(model.state_dict(), version="step-7")  # pause the workers first, or allow_unpaused
>>> b.close()

``push`` checks the metadata against every worker's ``weight_info`` before anything moves,
posts ``update_weights_from_distributed`` to all workers concurrently, waits until each is
ready (or tells the ready ones to abort when another refused), broadcasts the tensors
(large ones as they are, small ones packed into two reusable buckets; ``STREAM_DEPTH``
collectives in flight, so a bucket is packed while earlier chunks are on the wire, each
tensor hashed as it is copied in (one pass over its bytes), and
refilled only once its own broadcast is done), waits for every reply, and
raises one :class:`PushFailed` naming each worker that failed.  Beside the data it puts in
the group's store the manifest of what it will send (before posting) and the xxh3-64 hash
of every tensor it sent (after the last chunk), which the workers check (see
:mod:`weightsync.transports.distributed.worker`); each chunk's size is checked against the manifest before it is posted.  ``apush``/``aconnect``/``aclose`` are
the same as coroutines.  Pushes are serialised: a second push waits for the first.
"""

from __future__ import annotations

import asyncio
import datetime
import threading
import time
import uuid
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import httpx
import torch
import torch.distributed as dist

from weightsync.core.errors import EngineFailure
from weightsync.core.snapshot import TensorSpec
from weightsync.trainer.client import UNSET, ClientPool
from weightsync.trainer.fleet import FleetError, form_group
from weightsync.trainer.pushes import BlockingLoop, finish_push, leave_group
from weightsync.transports.copying import pack_digest
from weightsync.transports.distributed.group import Group, Window, check_timeout, create_group, stream_hasher
from weightsync.transports.distributed.keys import go_key, manifest_key, ready_key, sums_key
from weightsync.transports.distributed.layout import (
    DEFAULT_BUCKET_BYTES,
    STREAM_DEPTH,
    Chunk,
    Direct,
    bucket_capacity,
    manifest,
    plan_chunks,
)
from weightsync.transports.hashing import tensor_digest
from weightsync.transports.sink import check_metadata, dtype_name

if TYPE_CHECKING:
    from weightsync.transports.delta.manifest import DeltaManifest

_UNSET: Any = UNSET  # shows as UNSET in help()


class PushFailed(FleetError):
    """Some workers failed a push; ``failures`` maps worker URL to its error."""

    default_code = "push_failed"


class Broadcaster:
    """Rank 0 of a weight-update group spanning ``workers`` (their base URLs).

    ``transport``: the httpx async transport its admin calls to the workers take (``None``:
    HTTP); :meth:`weightsync.ray.RayFleet.broadcaster` gives one that calls worker actors.
    The group itself is formed as always: ``master_address``:``master_port`` (0: a free
    port) is the store the workers join."""

    def __init__(
        self,
        workers: Sequence[str],
        *,
        group_name: str = "weightsync",
        backend: str = "gloo",
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        timeout_s: float = 60.0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        api_key: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.urls = list(workers)
        self.group_name = group_name
        self.backend = backend
        self.master_address = master_address
        self.master_port = master_port
        self.timeout_s = check_timeout(timeout_s)
        self.bucket_bytes = bucket_bytes
        self.api_key = api_key
        self.transport = transport
        self.group: Group | None = None
        self._specs: dict[str, dict[str, TensorSpec]] = {}
        self._alock: asyncio.Lock | None = None
        self._tlock = threading.Lock()
        self._blocking = BlockingLoop()
        self._pool = ClientPool(self.urls, api_key=api_key, timeout=self.timeout_s + 30, transport=transport)

    # ------------------------------------------------------------------ async API

    async def aconnect(self) -> None:
        """Create the group: host the store, have every worker join, join as rank 0."""
        timeout = datetime.timedelta(seconds=self.timeout_s)
        store = dist.TCPStore(
            self.master_address, self.master_port, None, True, timeout, wait_for_workers=False
        )
        port = store.port
        clients = await self._pool.get()
        try:
            sizes = [int((await c.routes())["world_size"]) for c in clients]
            world = 1 + sum(sizes)
            offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
            joins = [
                c.init_weights_update_group(
                    self.master_address,
                    port,
                    off,
                    world,
                    self.group_name,
                    backend=self.backend,
                    timeout_s=self.timeout_s,
                )
                for c, off in zip(clients, offsets, strict=True)
            ]
            mine = asyncio.to_thread(
                create_group,
                self.group_name,
                master_address=self.master_address,
                master_port=port,
                rank=0,
                world_size=world,
                backend=self.backend,
                timeout_s=self.timeout_s,
                store=store,
            )
            self.group = await form_group(mine, joins, self.urls, PushFailed)
            infos = await asyncio.gather(*(c.weight_info() for c in clients))
            for url, info in zip(self.urls, infos, strict=True):
                self._specs[url] = {
                    n: TensorSpec(n, d, s)
                    for n, d, s in zip(info["names"], info["dtypes"], info["shapes"], strict=True)
                }
        except BaseException:
            await self._pool.aclose()
            raise

    async def apush(
        self,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        version: Any = _UNSET,
        allow_unpaused: bool = False,
        reset_prefix_cache: Any = _UNSET,
    ) -> dict[str, dict[str, Any]]:
        """Push tensors to every worker; return each worker's reply by URL.

        Raises ``InvalidRequest`` (before anything moves) when the tensors do not fit a
        worker, and :class:`PushFailed` naming each worker whose update failed."""
        if self._alock is None:
            self._alock = asyncio.Lock()
        async with self._alock:
            return await self._push(named_tensors, version, allow_unpaused, reset_prefix_cache)

    async def _push(
        self, named: Any, version: Any, allow_unpaused: bool, reset: Any
    ) -> dict[str, dict[str, Any]]:
        if self.group is None:
            raise EngineFailure("not connected: call connect() first", code="not_connected")
        group = self.group
        items = [(n, t.detach()) for n, t in (named.items() if isinstance(named, Mapping) else named)]
        specs = [TensorSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in items]
        for url in self.urls:  # refuse before anything moves
            check_metadata(specs, self._specs[url], allow_partial=True)
        stream_id = uuid.uuid4().hex
        chunks = plan_chunks(specs, self.bucket_bytes)
        group.store.set(manifest_key(stream_id), manifest(chunks))
        body: dict[str, Any] = {"allow_unpaused": allow_unpaused}
        if version is not _UNSET:
            body["weight_version"] = version
        if reset is not _UNSET:
            body["reset_prefix_cache"] = reset
        clients = await self._pool.get()
        posts = [
            asyncio.ensure_future(
                c.update_weights_from_distributed(
                    [s.name for s in specs],
                    [s.dtype for s in specs],
                    [list(s.shape) for s in specs],
                    self.group_name,
                    packing={"bucket_bytes": self.bucket_bytes, "stream_id": stream_id},
                    **body,
                )
            )
            for c in clients
        ]
        try:
            go = await self._wait_ready(group, stream_id, posts)
            sending = asyncio.to_thread(self._send, group, items, chunks, go, stream_id)
            return await finish_push(self._or_drop(group, sending), posts, self.urls, PushFailed)
        finally:
            for p in posts:  # none is left running when this push ends (cancelled, say)
                p.cancel()

    async def apush_delta(
        self,
        manifest: DeltaManifest,
        payload: Mapping[str, torch.Tensor],
        *,
        version: Any = _UNSET,
        allow_unpaused: bool = False,
        reset_prefix_cache: Any = _UNSET,
    ) -> dict[str, dict[str, Any]]:
        """Push a sparse delta (:func:`~weightsync.trainer.delta.compute_delta`) to every worker:
        each checks its base and verifies the result as for a delta checkpoint (see
        :mod:`weightsync.trainer.delta_push`).  Raises :class:`PushFailed` naming each worker
        that failed (``base_mismatch``, ``delta_unverified``, ...)."""
        from weightsync.trainer.delta_push import push_delta

        body: dict[str, Any] = {"allow_unpaused": allow_unpaused}
        body.update({} if version is _UNSET else {"weight_version": version})
        body.update({} if reset_prefix_cache is _UNSET else {"reset_prefix_cache": reset_prefix_cache})
        if self._alock is None:
            self._alock = asyncio.Lock()
        async with self._alock:
            return await push_delta(self, manifest, payload, body, PushFailed)

    async def _or_drop(self, group: Group, sending: Awaitable[None]) -> None:
        try:
            await sending
        except Exception:
            # The stream broke on our side: the group is out of step, drop it.
            self.group = None
            group.close()
            raise

    async def _wait_ready(self, group: Group, stream_id: str, posts: list[asyncio.Future[Any]]) -> bool:
        """True once every worker rank is ready; False as soon as one answered (refused)."""
        keys = [ready_key(stream_id, r) for r in range(1, group.world_size)]
        deadline = time.monotonic() + self.timeout_s
        while True:
            if any(p.done() for p in posts):
                return False
            if group.store.check(keys):
                return True
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.002)

    def _send(
        self,
        group: Group,
        items: list[tuple[str, torch.Tensor]],
        chunks: list[Chunk],
        go: bool,
        stream_id: str,
    ) -> None:
        group.store.set(go_key(stream_id), b"1" if go else b"0")
        if not go:
            return
        tensors = dict(items)
        buffers = group.buffers(bucket_capacity(chunks)) if bucket_capacity(chunks) else []
        sums: dict[str, bytes | Future[bytes]] = {}
        # Tensors sent alone are hashed on a helper thread while they are on the wire.
        with stream_hasher() as hasher:
            window = Window(group, STREAM_DEPTH, buffers)
            for chunk in chunks:
                window.make_room()
                if isinstance(chunk, Direct):
                    src = _checked(tensors[chunk.spec.name], group.device, chunk.nbytes, chunk.spec.name)
                    window.post(src)
                    sums[chunk.spec.name] = hasher.submit(tensor_digest, src)
                    continue
                buf = window.refill()  # a buffer is refilled only once its broadcast is done
                for slot in chunk.slots:  # pack while the previous chunks are on the wire
                    src = _checked(tensors[slot.spec.name], group.device, slot.nbytes, slot.spec.name)
                    sums[slot.spec.name] = pack_digest(buf[slot.offset : slot.offset + slot.nbytes], src)
                window.post(buf[: chunk.size])
            window.drain()
            digests = [d.result() if isinstance(d, Future) else d for d in (sums[name] for name, _ in items)]
        group.store.set(sums_key(stream_id), b"".join(digests))

    async def aclose(self) -> None:
        """Have every worker leave the group, then leave it."""
        await leave_group(self._pool, self.group_name)
        if self.group is not None:
            self.group.close()
            self.group = None

    # ------------------------------------------------------------------ blocking API

    def _run(self, coro: Any) -> Any:
        return self._blocking.run(coro)

    def connect(self) -> Broadcaster:
        with self._tlock:
            self._run(self.aconnect())
        return self

    def push(self, named_tensors: Any, **options: Any) -> dict[str, dict[str, Any]]:
        with self._tlock:
            return self._run(self.apush(named_tensors, **options))  # type: ignore[no-any-return]

    def push_delta(self, manifest: DeltaManifest, payload: Any, **options: Any) -> dict[str, dict[str, Any]]:
        with self._tlock:
            return self._run(self.apush_delta(manifest, payload, **options))  # type: ignore[no-any-return]

    def close(self) -> None:
        with self._tlock:
            try:
                self._run(self.aclose())
            finally:
                self._blocking.close()

    def __enter__(self) -> Broadcaster:
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _checked(tensor: torch.Tensor, device: torch.device, nbytes: int, name: str) -> torch.Tensor:
    """``tensor`` contiguous on ``device``, checked against its size in the manifest: a worker
    receives exactly that many bytes, so nothing else may be sent."""
    t = tensor.to(device).contiguous()
    if t.numel() * t.element_size() != nbytes:
        raise EngineFailure(
            f"{name}: {t.numel() * t.element_size()} bytes to send, the manifest says {nbytes}",
            code="stream_mismatch",
        )
    return t
