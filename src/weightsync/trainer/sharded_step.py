"""One step of a sharded push on one trainer rank (:class:`~.sharded.ShardedPusher` holds the
group, the plan and the step count; a :class:`SourceStep` is one push of it).

Every rank learns the step's ``stream_id`` (rank 0 makes it and announces it in the store),
checks what it holds and posts its manifest (:meth:`SourceStep.post_manifest`), packs its
first messages, waits for the go and sends (:meth:`SourceStep.send`).  Rank 0 also runs the
step (:meth:`SourceStep.coordinate`): it waits until every rank posted its manifest, posts
every worker's part of the plan, waits until all are ready (or one refused), says go or
abort, and returns the replies.  The protocol is :mod:`weightsync.transports.plan.protocol`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import torch

from weightsync.core.errors import EngineFailure, InvalidRequest, WeightSyncError
from weightsync.core.plan.boxes import Box
from weightsync.core.plan.value import Plan
from weightsync.trainer.client import AsyncWorkerClient
from weightsync.trainer.pushes import finish_push
from weightsync.transports.distributed.group import Group
from weightsync.transports.plan.protocol import go_key, manifest, manifest_key, ready_key, sums_key
from weightsync.transports.plan.send import check_held, send


def _step_key(n: int) -> str:
    return f"weightsync/plan/step/{n}"


def stream_id_of(group: Group, rank: int, n: int, timeout_s: float) -> str:
    """Step ``n``'s stream id: rank 0 makes a new one; the others wait until rank 0 announced
    it (:func:`announce`)."""
    if rank == 0:
        return uuid.uuid4().hex
    key = _step_key(n)
    group.store.wait([key], datetime.timedelta(seconds=timeout_s))
    return str(group.store.get(key).decode())


def announce(group: Group, n: int, stream_id: str, *, abort: bool = False) -> None:
    """Rank 0: tell the other ranks step ``n``'s stream id; with ``abort``, told first that
    the step sends nothing (their push of it returns without sending)."""
    if abort:
        group.store.set(go_key(stream_id), b"0")
    group.store.set(_step_key(n), stream_id.encode())


class SourceStep:
    """Step ``n`` (stream ``stream_id``) of trainer rank ``rank``, sending ``held`` (name ->
    the tensor it holds and its box) as ``plan`` says.  ``broken`` turns true when its sends
    broke after the go: the group is then out of step with the workers and closed."""

    def __init__(
        self,
        group: Group,
        plan: Plan,
        rank: int,
        n: int,
        stream_id: str,
        held: Mapping[str, tuple[torch.Tensor, Box]],
        timeout_s: float,
    ) -> None:
        self.group, self.plan, self.rank, self.n = group, plan, rank, n
        self.stream_id, self.held, self.timeout_s = stream_id, held, timeout_s
        self.specs = {s.name: s for s in plan.trainer.specs}
        self.broken = False

    def post_manifest(self) -> None:
        """Check what this rank holds, then post its manifest (rank 0 then announces the step).
        Raises ``InvalidRequest`` before anything moves (rank 0 having announced an aborted
        step, so that the other ranks stop waiting)."""
        group, sid = self.group, self.stream_id
        try:
            check_held(self.specs, self.held)  # before the manifest: a bad rank lets the step abort
        except InvalidRequest:
            if self.rank == 0:
                announce(group, self.n, sid, abort=True)
            raise
        group.store.set(manifest_key(sid, self.rank), manifest(self.plan.for_source(self.rank)))
        if self.rank == 0:
            announce(group, self.n, sid)

    def wait_go(self) -> bool:
        """Whether rank 0 said go (rather than abort) for this step."""
        key = go_key(self.stream_id)
        self.group.store.wait([key], datetime.timedelta(seconds=self.timeout_s))
        return bool(self.group.store.get(key) == b"1")

    def send(self, go: Callable[[], bool]) -> None:
        """Pack the first messages, ask ``go`` (the step's go or abort), send, post the
        pieces' hashes.  What ``go`` raises propagates as it is (nothing was sent); a failure
        after it leaves the group out of step with the workers: it is closed (``broken``)."""
        group = self.group
        asked: list[BaseException] = []

        def ask() -> bool:
            try:
                return go()
            except BaseException as exc:
                asked.append(exc)
                raise

        try:
            sums = send(group, self.plan.for_source(self.rank), self.specs, self.held, ask)
        except BaseException as exc:
            if asked and exc is asked[0]:
                raise  # no go came: nothing was sent
            if not isinstance(exc, Exception):
                raise
            self.broken = True  # out of step with the workers: the group is gone
            group.close()
            if isinstance(exc, WeightSyncError):
                raise
            raise EngineFailure(
                f"trainer rank {self.rank}: the plan's sends broke ({exc}); the group is gone",
                code="stream_failed",
            ) from exc
        if sums is not None:
            group.store.set(sums_key(self.stream_id, self.rank), sums)

    async def _wait_manifests(self) -> None:
        """Wait until every trainer rank posted its manifest.  Raises ``EngineFailure``
        (``stream_aborted``) when one did not in time; the others are told to abort, nothing
        was sent and no worker was asked."""
        group, sid = self.group, self.stream_id
        keys = [manifest_key(sid, s) for s in range(1, self.plan.sources)]
        if not keys:
            return
        try:
            await asyncio.to_thread(group.store.wait, keys, datetime.timedelta(seconds=self.timeout_s))
        except Exception as exc:
            with contextlib.suppress(Exception):
                group.store.set(go_key(sid), b"0")  # the ranks that posted stop waiting
            raise EngineFailure(
                f"the other trainer ranks did not post their manifests within {self.timeout_s}s ({exc}); "
                "nothing was sent",
                code="stream_aborted",
            ) from exc

    async def coordinate(
        self,
        clients: list[AsyncWorkerClient],
        urls: list[str],
        wires: list[dict[str, Any]],
        group_name: str,
        body: dict[str, Any],
        failed: Callable[[dict[str, WeightSyncError], dict[str, dict[str, Any]]], BaseException],
    ) -> dict[str, dict[str, Any]]:
        """Rank 0: run the step with the workers (``clients``, at ``urls``; ``wires``: each
        one's part of the plan) while this rank sends; returns every worker's reply by URL.
        Raises ``failed(failures, replies)`` naming the workers that failed, or what this
        rank's sending raised."""
        group, plan, sid = self.group, self.plan, self.stream_id
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

        sender = asyncio.ensure_future(asyncio.to_thread(self.send, wait_decision))
        posts: list[asyncio.Future[Any]] = []
        try:
            # Every source's manifest is in the store before any worker is asked to compare
            # it with its part (the other ranks post theirs once they read this step's id).
            await self._wait_manifests()
            posts = [
                asyncio.ensure_future(c.update_weights_from_plan(group_name, sid, wires[w], **body))
                for w, c in enumerate(clients)
            ]
            keys = [ready_key(sid, r) for r in range(plan.sources, plan.world_size)]
            deadline = time.monotonic() + self.timeout_s
            go = False
            while not any(p.done() for p in posts) and not sender.done() and time.monotonic() < deadline:
                if group.store.check(keys):
                    go = True
                    break
                await asyncio.sleep(0.002)
            go = go and not sender.done()  # a sender that failed while packing sends nothing
            group.store.set(go_key(sid), b"1" if go else b"0")
            decide(go)
            return await finish_push(sender, posts, urls, failed)
        finally:
            decide(False)  # a push that ended early: the sender stops without sending
            with contextlib.suppress(BaseException):
                await asyncio.shield(sender)
            for p in posts:  # none is left running when this push ends (cancelled, say)
                p.cancel()
