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
worker to join the group at the ranks the plan gives it (on gloo with ``receiver:
"process"``: a helper process per worker rank receives, so a rank that sends more bytes than
it declared cannot abort a worker), and publishes the fleet layout in
the store so every trainer rank computes the same plan (:func:`weightsync.core.plan.build.make_plan`,
cached until a layout changes).  For each push it waits until every trainer rank posted its
manifest, posts every worker's part of the plan (``update_weights_from_plan``), waits until
all are ready (or one refused), says go or abort, and returns the replies; every rank (rank
0 included) posts its manifest, waits for that word, sends its transfers and posts its
pieces' hashes (one push on one rank: :class:`~weightsync.trainer.sharded_step.SourceStep`).
Pushes are collective: every trainer rank calls :meth:`ShardedPusher.push` the same number
of times, in step, as it would an all-reduce.

``held`` maps each tensor name to the tensor this rank holds of it: its box in the
trainer layout (a dim-0 shard for FSDP — ``param.to_local()`` of a DTensor, or
``FSDP``'s flat-param view of it — the whole tensor when it owns or replicates it).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
import torch
import torch.distributed as dist

from weightsync.core.errors import EngineFailure, InvalidRequest
from weightsync.core.plan.boxes import Box
from weightsync.core.plan.build import DEFAULT_BUCKET_BYTES, make_plan
from weightsync.core.plan.layouts import FleetLayout, TrainerLayout, WorkerLayout
from weightsync.core.plan.value import Plan
from weightsync.core.snapshot import TensorSpec
from weightsync.trainer.client import UNSET, AsyncWorkerClient, ClientPool
from weightsync.trainer.fleet import FleetError, form_group
from weightsync.trainer.pushes import BlockingLoop, leave_group
from weightsync.trainer.sharded_step import SourceStep, announce, stream_id_of
from weightsync.transports.distributed.group import Group, check_timeout, create_group

_UNSET: Any = UNSET  # shows as UNSET in help()
_FLEET_KEY = "weightsync/plan/fleet"


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
    """One trainer rank of sharded weight updates (see the module docstring).  ``transport``:
    the httpx async transport rank 0's admin calls to the workers take (``None``: HTTP;
    :meth:`weightsync.ray.RayFleet.transport` calls worker actors)."""

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
        transport: httpx.AsyncBaseTransport | None = None,
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
        # On gloo every worker rank receives through a helper process of its own: a source
        # that sends more bytes than it declared aborts the helper, never the worker.
        self.receiver = "process" if backend == "gloo" else "inline"
        self.group: Group | None = None
        self.fleet: FleetLayout | None = None
        self._steps = 0
        self._blocking = BlockingLoop()
        self._pool = ClientPool(self.urls, api_key=api_key, timeout=self.timeout_s + 30, transport=transport)
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
        return self._blocking.run(coro)

    # ------------------------------------------------------------------ connect

    def connect(self) -> ShardedPusher:
        """Form the group (every trainer rank calls this).  Raises ``ShardedPushFailed`` when
        a worker cannot join, ``EngineUnavailable`` when the rendezvous fails."""
        if self.rank == 0:
            self._run(self._connect_coordinator())
        else:
            self.group = create_group(
                self.group_name,
                master_address=self.master_address,
                master_port=self.master_port,
                rank=self.rank,
                world_size=self._wait_world(),
                backend=self.backend,
                timeout_s=self.timeout_s,
            )
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
                    self.master_address,
                    store.port,
                    plan.rank_offset(w),
                    plan.world_size,
                    self.group_name,
                    backend=self.backend,
                    timeout_s=self.timeout_s,
                    receiver=self.receiver,
                )
                for w, c in enumerate(clients)
            ]
            mine = asyncio.to_thread(
                create_group,
                self.group_name,
                master_address=self.master_address,
                master_port=store.port,
                rank=0,
                world_size=plan.world_size,
                backend=self.backend,
                timeout_s=self.timeout_s,
                store=store,
            )
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
        stream_id = stream_id_of(group, self.rank, self._steps, self.timeout_s)
        step = SourceStep(group, plan, self.rank, self._steps, stream_id, mine, self.timeout_s)
        try:
            step.post_manifest()
            if self.rank == 0:
                body: dict[str, Any] = {"allow_unpaused": allow_unpaused}
                if version is not _UNSET:
                    body["weight_version"] = version
                if reset_prefix_cache is not _UNSET:
                    body["reset_prefix_cache"] = reset_prefix_cache
                return self._run(self._coordinate(step, body))  # type: ignore[no-any-return]
            step.send(step.wait_go)
            return {}
        finally:
            if step.broken:
                self.group = None  # out of step with the workers: the group is gone

    def skip(self) -> None:
        """Rank 0: end this step without sending (a fleet transaction that stopped before its
        apply): the other ranks' :meth:`push` of the step returns ``{}`` without sending."""
        if self.group is None or self.rank != 0:
            raise EngineFailure("only a connected trainer rank 0 skips a step", code="not_connected")
        self._steps += 1
        announce(self.group, self._steps, uuid.uuid4().hex, abort=True)

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

    async def _coordinate(self, step: SourceStep, body: dict[str, Any]) -> dict[str, dict[str, Any]]:
        clients = await self._pool.get()
        wires = self._part_wires(step.plan)
        return await step.coordinate(clients, self.urls, wires, self.group_name, body, ShardedPushFailed)

    # ------------------------------------------------------------------ close

    def close(self) -> None:
        """Leave the group (rank 0 first has every worker leave it)."""
        try:
            if self.rank == 0 and self.urls:
                self._run(leave_group(self._pool, self.group_name))
        finally:
            if self.group is not None:
                self.group.close()
                self.group = None
            self._blocking.close()

    def __enter__(self) -> ShardedPusher:
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()
