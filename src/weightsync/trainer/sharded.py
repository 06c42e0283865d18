"""Trainer side of sharded updates: every trainer rank sends what it holds, every worker
rank receives only what it serves.

>>> layout = TrainerLayout.fsdp(specs, world)                  # the same on every rank
>>> p = ShardedPusher(rank, layout, workers=urls if rank == 0 else (),
...                   master_address=host0, master_port=port)  # a port agreed by all ranks
>>> p.connect()
>>> p.push({name: shard for name, shard in my_shards.items()}, version="step-7")  # on every rank
>>> p.close()

Trainer rank 0 coordinates: it hosts the group's store, reads every worker's layout
(``weight_info`` and world size: a one-process worker serves every tensor whole), asks each
worker to join the group at the ranks the plan gives it, and publishes the fleet layout in
the store so every trainer rank computes the same plan (:func:`weightsync.core.plan.build.make_plan`,
cached until a layout changes).  For each push it waits until every trainer rank posted its
manifest, posts every worker's part of the plan (``update_weights_from_plan``), waits until
all are ready (or one refused), says go or abort, and returns the replies; every rank (rank
0 included) posts its manifest, waits for that word, sends its transfers and posts its
pieces' hashes.  Pushes are collective: every
trainer rank calls :meth:`ShardedPusher.push` the same number of times, in step, as it
would an all-reduce.

``held`` maps each tensor name to the tensor this rank holds of it: its box in the
trainer layout (a dim-0 shard for FSDP — ``param.to_local()`` of a DTensor, or
``FSDP``'s flat-param view of it — the whole tensor when it owns or replicates it).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from weightsync.core.errors import EngineFailure, InvalidRequest, WeightSyncError
from weightsync.core.plan.boxes import Box
from weightsync.core.plan.build import DEFAULT_BUCKET_BYTES, make_plan
from weightsync.core.plan.layouts import FleetLayout, TrainerLayout, WorkerLayout
from weightsync.core.plan.value import Plan
from weightsync.core.snapshot import TensorSpec
from weightsync.trainer.client import UNSET, AsyncWorkerClient, ClientPool
from weightsync.trainer.fleet import FleetError, form_group, gather_by_url
from weightsync.transports.distributed.group import Group, check_timeout, create_group
from weightsync.transports.plan.sharded import (
    check_held,
    go_key,
    manifest,
    manifest_key,
    ready_key,
    send,
    sums_key,
)

_UNSET: Any = UNSET  # shows as UNSET in help()
_FLEET_KEY = "weightsync/plan/fleet"


def _step_key(n: int) -> str:
    return f"weightsync/plan/step/{n}"


async def _worker_layout(
    client: AsyncWorkerClient, url: str, world_size: int, specs: list[TensorSpec]
) -> WorkerLayout:
    """What each rank of the worker at ``url`` serves: every tensor whole on a one-process
    worker; a multi-rank worker says it itself (``engine_rpc`` ``worker_layout``, read from
    the engine's own layout), checked against its ``weight_info`` and world size.  Raises
    ``InvalidRequest`` (``layout_mismatch``/``invalid_layout``), or the worker's refusal."""
    if world_size == 1:
        return WorkerLayout.replica(url, specs)
    wire = (await client.engine_rpc("worker_layout"))["result"]
    layout = WorkerLayout.from_wire({**wire, "worker": url} if isinstance(wire, dict) else wire)
    if layout.world_size != world_size or list(layout.tensors) != list(specs):
        raise InvalidRequest(
            f"{url}: its layout names {layout.world_size} ranks and {len(layout.tensors)} tensors; it runs "
            f"{world_size} ranks serving {len(specs)}",
            code="layout_mismatch",
        )
    return layout


class ShardedPushFailed(FleetError):
    """Some workers failed a sharded push; ``failures`` maps worker URL to its error."""

    default_code = "push_failed"


class ShardedPusher:
    """One trainer rank of sharded weight updates (see the module docstring)."""

    def __init__(
        self,
        rank: int,
        layout: TrainerLayout,
        *,
        workers: Sequence[str] = (),
        master_address: str = "127.0.0.1",
        master_port: int,
        group_name: str = "weightsync-plan",
        backend: str = "gloo",
        timeout_s: float = 60.0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        api_key: str | None = None,
    ) -> None:
        if not 0 <= rank < layout.ranks:
            raise InvalidRequest(
                f"rank {rank} is not one of the layout's {layout.ranks}", code="invalid_value"
            )
        if bool(workers) != (rank == 0):
            raise InvalidRequest("trainer rank 0, and only rank 0, names the workers", code="invalid_value")
        self.rank, self.layout, self.urls = rank, layout, list(workers)
        self.master_address, self.master_port = master_address, master_port
        self.group_name, self.backend = group_name, backend
        self.timeout_s = check_timeout(timeout_s)
        self.bucket_bytes, self.api_key = bucket_bytes, api_key
        self.group: Group | None = None
        self.fleet: FleetLayout | None = None
        self._steps = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pool = ClientPool(self.urls, api_key=api_key, timeout=self.timeout_s + 30)
        # Every worker's part of the plan in its wire form, made once per plan.
        self._wires: tuple[Plan, list[dict[str, Any]]] | None = None

    @property
    def plan(self) -> Plan:
        """This update's plan (the same on every trainer rank)."""
        if self.fleet is None:
            raise EngineFailure("not connected: call connect() first", code="not_connected")
        return make_plan(self.layout, self.fleet, self.bucket_bytes)

    def _part_wires(self, plan: Plan) -> list[dict[str, Any]]:
        """Each worker's part of ``plan`` as it is posted (the plan is cached, so is this)."""
        if self._wires is None or self._wires[0] is not plan:
            self._wires = (plan, [plan.part(w).to_wire() for w in range(len(plan.fleet.workers))])
        return self._wires[1]

    def _run(self, coro: Any) -> Any:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(coro)

    # ------------------------------------------------------------------ connect

    def connect(self) -> ShardedPusher:
        """Form the group (every trainer rank calls this).  Raises ``ShardedPushFailed`` when
        a worker cannot join, ``EngineUnavailable`` when the rendezvous fails."""
        if self.rank == 0:
            self._run(self._connect_coordinator())
        else:
            self.group = create_group(
                self.group_name, master_address=self.master_address, master_port=self.master_port,
                rank=self.rank, world_size=self._wait_world(), backend=self.backend, timeout_s=self.timeout_s,
            )  # fmt: skip
            self.fleet = FleetLayout.from_wire(json.loads(self.group.store.get(_FLEET_KEY)))
        return self

    def _wait_world(self) -> int:
        """Trainer ranks above 0 learn the world size from rank 0's store."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                timeout = datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.1))
                store = dist.TCPStore(
                    self.master_address, self.master_port, None, False, timeout, wait_for_workers=False
                )
                store.wait([_FLEET_KEY], timeout)
                fleet = FleetLayout.from_wire(json.loads(store.get(_FLEET_KEY)))
                return self.layout.ranks + sum(w.world_size for w in fleet.workers)
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    async def _connect_coordinator(self) -> None:
        timeout = datetime.timedelta(seconds=self.timeout_s)
        store = dist.TCPStore(
            self.master_address, self.master_port, None, True, timeout, wait_for_workers=False
        )
        clients = await self._pool.get()
        try:
            routes = await asyncio.gather(*(c.routes() for c in clients))
            infos = await asyncio.gather(*(c.weight_info() for c in clients))
            workers = []
            for url, c, r, info in zip(self.urls, clients, routes, infos, strict=True):
                specs = [
                    TensorSpec(n, d, tuple(s))
                    for n, d, s in zip(info["names"], info["dtypes"], info["shapes"], strict=True)
                ]
                workers.append(await _worker_layout(c, url, int(r["world_size"]), specs))
            fleet = FleetLayout(tuple(workers))
            plan = make_plan(self.layout, fleet, self.bucket_bytes)  # refuses a layout mismatch now
            store.set(_FLEET_KEY, json.dumps(fleet.to_wire()))
            joins = [
                c.init_weights_update_group(
                    self.master_address, store.port, plan.rank_offset(w), plan.world_size, self.group_name,
                    backend=self.backend, timeout_s=self.timeout_s,
                )
                for w, c in enumerate(clients)
            ]  # fmt: skip
            mine = asyncio.to_thread(
                create_group, self.group_name, master_address=self.master_address, master_port=store.port,
                rank=0, world_size=plan.world_size, backend=self.backend, timeout_s=self.timeout_s, store=store,
            )  # fmt: skip
            self.group, self.fleet = await form_group(mine, joins, self.urls, ShardedPushFailed), fleet
        except BaseException:
            await self._pool.aclose()
            raise

    # ------------------------------------------------------------------ push

    def push(
        self,
        held: Mapping[str, torch.Tensor],
        *,
        version: Any = _UNSET,
        allow_unpaused: bool = False,
        reset_prefix_cache: Any = _UNSET,
    ) -> dict[str, dict[str, Any]]:
        """Send this rank's part of the plan; on rank 0 return every worker's reply by URL
        (``{}`` on the others).  Raises ``InvalidRequest`` before anything moves when
        ``held`` does not match this rank's layout, ``ShardedPushFailed`` naming the workers
        that failed."""
        if self.group is None or self.fleet is None:
            raise EngineFailure("not connected: call connect() first", code="not_connected")
        group, plan = self.group, self.plan
        mine = self._held(held)
        self._steps += 1
        if self.rank == 0:
            stream_id = uuid.uuid4().hex
        else:
            key = _step_key(self._steps)
            group.store.wait([key], datetime.timedelta(seconds=self.timeout_s))
            stream_id = group.store.get(key).decode()
        transfers = plan.for_source(self.rank)
        specs = {s.name: s for s in plan.trainer.specs}
        try:
            check_held(specs, mine)  # before the manifest: a bad rank lets the step abort
        except InvalidRequest:
            if self.rank == 0:
                group.store.set(go_key(stream_id), b"0")  # the others stop waiting
                group.store.set(_step_key(self._steps), stream_id.encode())
            raise
        group.store.set(manifest_key(stream_id, self.rank), manifest(transfers))
        if self.rank == 0:
            group.store.set(_step_key(self._steps), stream_id.encode())
            body: dict[str, Any] = {"allow_unpaused": allow_unpaused}
            if version is not _UNSET:
                body["weight_version"] = version
            if reset_prefix_cache is not _UNSET:
                body["reset_prefix_cache"] = reset_prefix_cache
            return self._run(self._coordinate(group, plan, stream_id, mine, body))  # type: ignore[no-any-return]
        self._send(group, plan, stream_id, mine, lambda: self._wait_go(group, stream_id))
        return {}

    def skip(self) -> None:
        """Rank 0: end this step without sending (a fleet transaction that stopped before its
        apply): the other ranks' :meth:`push` of the step returns ``{}`` without sending."""
        if self.group is None or self.rank != 0:
            raise EngineFailure("only a connected trainer rank 0 skips a step", code="not_connected")
        self._steps += 1
        stream_id = uuid.uuid4().hex
        self.group.store.set(go_key(stream_id), b"0")
        self.group.store.set(_step_key(self._steps), stream_id.encode())

    def _held(self, held: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, Box]]:
        boxes = self.layout.held_by(self.rank)
        out: dict[str, tuple[torch.Tensor, Box]] = {}
        for name, held_boxes in boxes.items():
            if len(held_boxes) != 1:
                raise InvalidRequest(
                    f"{name}: this rank holds {len(held_boxes)} boxes; one is supported",
                    code="invalid_layout",
                )
            if name not in held:
                raise InvalidRequest(
                    f"{name}: this rank holds part of it in the layout but was not given it",
                    code="missing_tensor",
                )
            out[name] = (held[name].detach(), held_boxes[0])
        return out

    def _wait_go(self, group: Group, stream_id: str) -> bool:
        group.store.wait([go_key(stream_id)], datetime.timedelta(seconds=self.timeout_s))
        return bool(group.store.get(go_key(stream_id)) == b"1")

    def _send(
        self,
        group: Group,
        plan: Plan,
        stream_id: str,
        mine: dict[str, tuple[torch.Tensor, Box]],
        go: Callable[[], bool],
    ) -> None:
        """Pack the first messages, ask ``go`` (the step's go or abort), send, post the
        pieces' hashes.  What ``go`` raises propagates as it is (nothing was sent); a failure
        after it leaves the group out of step with the workers: it is closed."""
        specs = {s.name: s for s in plan.trainer.specs}
        asked: list[BaseException] = []

        def ask() -> bool:
            try:
                return go()
            except BaseException as exc:
                asked.append(exc)
                raise

        try:
            sums = send(group, plan.for_source(self.rank), specs, mine, ask)
        except BaseException as exc:
            if asked and exc is asked[0]:
                raise  # no go came: nothing was sent
            if not isinstance(exc, Exception):
                raise
            self.group = None  # out of step with the workers: the group is gone
            group.close()
            if isinstance(exc, WeightSyncError):
                raise
            raise EngineFailure(
                f"trainer rank {self.rank}: the plan's sends broke ({exc}); the group is gone",
                code="stream_failed",
            ) from exc
        if sums is not None:
            group.store.set(sums_key(stream_id, self.rank), sums)

    async def _wait_manifests(self, group: Group, plan: Plan, stream_id: str) -> None:
        """Wait until every trainer rank posted its manifest.  Raises ``EngineFailure``
        (``stream_aborted``) when one did not in time; the others are told to abort, nothing
        was sent and no worker was asked."""
        keys = [manifest_key(stream_id, s) for s in range(1, plan.sources)]
        if not keys:
            return
        try:
            await asyncio.to_thread(group.store.wait, keys, datetime.timedelta(seconds=self.timeout_s))
        except Exception as exc:
            with contextlib.suppress(Exception):
                group.store.set(go_key(stream_id), b"0")  # the ranks that posted stop waiting
            raise EngineFailure(
                f"the other trainer ranks did not post their manifests within {self.timeout_s}s ({exc}); "
                "nothing was sent",
                code="stream_aborted",
            ) from exc

    async def _coordinate(
        self,
        group: Group,
        plan: Plan,
        stream_id: str,
        mine: dict[str, tuple[torch.Tensor, Box]],
        body: dict[str, Any],
    ) -> dict[str, dict[str, Any]]:
        clients = await self._pool.get()
        wires = self._part_wires(plan)
        # This rank packs its first messages in a thread of its own while the workers are
        # asked and get ready; it sends once told go (or sends nothing, told abort).
        decision: list[bool] = []
        decided = threading.Event()

        def wait_decision() -> bool:
            # bounded: a push torn down without its finally (an interrupted loop) must not
            # leave this thread waiting for ever, and the interpreter with it at exit
            return decided.wait(self.timeout_s + 30) and decision[0]

        def decide(go: bool) -> None:
            if not decided.is_set():
                decision.append(go)
                decided.set()

        sender = asyncio.ensure_future(
            asyncio.to_thread(self._send, group, plan, stream_id, mine, wait_decision)
        )
        posts: list[asyncio.Future[Any]] = []
        try:
            # Every source's manifest is in the store before any worker is asked to compare
            # it with its part (the other ranks post theirs once they read this step's id).
            await self._wait_manifests(group, plan, stream_id)
            posts = [
                asyncio.ensure_future(
                    c.update_weights_from_plan(self.group_name, stream_id, wires[w], **body)
                )
                for w, c in enumerate(clients)
            ]
            keys = [ready_key(stream_id, r) for r in range(plan.sources, plan.world_size)]
            deadline = time.monotonic() + self.timeout_s
            go = False
            while not any(p.done() for p in posts) and not sender.done() and time.monotonic() < deadline:
                if group.store.check(keys):
                    go = True
                    break
                await asyncio.sleep(0.002)
            go = go and not sender.done()  # a sender that failed while packing sends nothing
            group.store.set(go_key(stream_id), b"1" if go else b"0")
            decide(go)
            try:
                await sender
            except Exception:
                for p in posts:
                    p.cancel()
                await asyncio.gather(*posts, return_exceptions=True)
                raise
            try:
                return await gather_by_url(self.urls, posts)
            except FleetError as exc:
                raise ShardedPushFailed(exc.failures, exc.replies) from None
        finally:
            decide(False)  # a push that ended early: the sender stops without sending
            with contextlib.suppress(BaseException):
                await asyncio.shield(sender)
            for p in posts:  # none is left running when this push ends (cancelled, say)
                p.cancel()

    # ------------------------------------------------------------------ close

    def close(self) -> None:
        """Leave the group (rank 0 first has every worker leave it)."""
        try:
            if self.rank == 0 and self.urls:
                self._run(self._destroy())
        finally:
            if self.group is not None:
                self.group.close()
                self.group = None
            if self._loop is not None:
                self._loop.close()
                self._loop = None

    async def _destroy(self) -> None:
        clients = await self._pool.get()
        try:
            await asyncio.gather(
                *(c.destroy_weights_update_group(self.group_name) for c in clients), return_exceptions=True
            )
        finally:
            await self._pool.aclose()

    def __enter__(self) -> ShardedPusher:
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()
