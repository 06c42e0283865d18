"""Worker side: the groups a worker joined, and receiving a weight stream into a sink.

Packed streams (``bucket_bytes`` set) follow a three-step protocol with the trainer
(the worker's side in :mod:`.packed`):

1. before posting the update the trainer puts a *manifest* in the group's store under
   ``stream_id``: the byte count of every chunk it will broadcast.  The worker checks the
   metadata against its weights and the manifest against its own plan of the declared
   metadata (a mismatch is a 400, before any collective), then marks itself ready;
2. it waits in the store for rank 0's decision: go once every worker is ready, abort as
   soon as one refused (the trainer learns that from its HTTP reply).  No collective is
   started unless every rank is in it, so a refusal never leaves the group out of step;
3. the chunks arrive, ``STREAM_DEPTH`` collectives in flight, each into exactly its
   declared size: large tensors into the engine's own, small ones in buckets (two reusable
   buffers).  Every tensor is hashed (xxh3-64); the load succeeds only if all match the
   hashes the trainer puts in the store after its last chunk (a short send leaves stale
   bytes that no longer hash the same).  The verified hashes are kept in ``sink.hashes``.

Foreign streams (vLLM's and SGLang's trainers: one broadcast per tensor, or the bytes
concatenated into a few) carry no manifest or checksums: :mod:`.foreign` verifies them
against the request's ``hashes`` when it carries them, else reports ``verified: false``.  On gloo they, and
sharded plans (:meth:`GroupRegistry.plan_group`), are received only on a group joined with
``receiver: "process"`` (:mod:`.receiver`: a helper process owns the group, so a sender
of more bytes than declared aborts the helper, not the worker).  Any failure after the
first write is ``wrote=True``: the worker becomes torn.

A refusal or a failure never leaves a trainer waiting in a collective (:mod:`.drain`): a
bare stream refused before it began, and any stream that ended without taking every
broadcast its trainer sends, join the rest into scratch memory and discard it, so the group
stays in step for the next update.  The group is dropped only when its wire broke (a helper
that died, a timeout), when the drain failed, or when what the trainer sends cannot be
joined at all (metadata that does not parse: :meth:`GroupRegistry.abandon`).  A bare stream
on a gloo group joined inline is refused (``unsafe_stream``) and not drained: receiving sizes
that are only the request's word could abort the worker.  The reader is :mod:`.reader`'s.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time

import attrs

from weightsync.core.errors import EngineUnavailable, IllegalState, InvalidRequest, NotFound
from weightsync.core.requests import InitGroupRequest
from weightsync.core.sources import DistributedSource
from weightsync.transports.distributed.group import Group, create_group
from weightsync.transports.distributed.reader import StreamReader
from weightsync.transports.distributed.receiver import (
    START_GRACE_S,
    ReceiverGroup,
    start_helper,
    stop_helper,
)
from weightsync.transports.distributed.stateless import CommGroup, join_stateless

log = logging.getLogger("weightsync.transports.distributed")

JOIN_GRACE_S = 2.0
"""How long past a join's ``timeout_s`` its caller waits for the rendezvous thread to give up
by itself before it stops waiting (a helper process's start is allowed ``START_GRACE_S`` more)."""


@attrs.define(eq=False)
class _Join:
    """A rendezvous in progress: the thread doing it, and how its caller learns the end."""

    done: threading.Event = attrs.field(factory=threading.Event)
    cancelled: threading.Event = attrs.field(factory=threading.Event)
    group: Group | ReceiverGroup | CommGroup | None = None
    error: BaseException | None = None
    abandoned: bool = False


class GroupRegistry:
    """The weight-update groups of one worker, by name."""

    def __init__(self) -> None:
        self._groups: dict[str, Group | ReceiverGroup | CommGroup] = {}
        self._joining: dict[str, _Join] = {}  # names reserved by a rendezvous in progress
        self._lock = threading.Lock()
        self._spare: subprocess.Popen[bytes] | None = None  # the next helper, already starting

    def names(self) -> list[str]:
        return sorted(self._groups)

    def join(self, req: InitGroupRequest, local_rank: int = 0) -> None:
        """Join ``req``'s group (blocking, up to ``req.timeout_s``).  The name is reserved for
        the whole rendezvous: a second join of the same name waits for it (as joins queued
        behind each other before), up to its own ``timeout_s``, then is ``group_exists``.

        The rendezvous runs on a thread of its own and the caller waits at most its deadline
        (``timeout_s``, plus :data:`JOIN_GRACE_S`, plus ``START_GRACE_S`` for a helper process):
        a trainer that accepts the connection and never answers (torch's store client does not
        bound every read by its timeout) cannot hold the caller longer.  A thread still stuck
        there is left behind; whatever it joins late is closed, never kept.  :meth:`destroy`
        of the name meanwhile cancels the join (``join_cancelled``).

        Raises ``IllegalState`` (``group_exists``, ``join_cancelled``), ``EngineUnavailable``
        (``rendezvous_failed``) and what the rendezvous raises."""
        join = _Join()
        deadline = time.monotonic() + req.timeout_s
        while True:  # a join of the same name in progress is waited for, up to this one's timeout_s
            with self._lock:
                pending = self._joining.get(req.group_name)
                if req.group_name in self._groups or (pending is not None and time.monotonic() >= deadline):
                    state = "is being joined" if pending is not None else "already exists"
                    raise IllegalState(
                        f"group {req.group_name!r} {state}; destroy it first", code="group_exists"
                    )
                if pending is None:
                    self._joining[req.group_name] = join
                    break
            if pending.done.wait(min(0.05, max(deadline - time.monotonic(), 0.0))):
                time.sleep(0.005)  # done: its caller is about to register it or free the name
        threading.Thread(
            target=self._rendezvous, args=(req, local_rank, join), name="weightsync-join", daemon=True
        ).start()
        grace = JOIN_GRACE_S + (START_GRACE_S if req.receiver == "process" else 0.0)
        deadline = time.monotonic() + req.timeout_s + grace
        try:
            while not join.done.is_set() and not join.cancelled.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EngineUnavailable(
                        f"could not join weight-update group {req.group_name!r} at {req.master_address}:"
                        f"{req.master_port} within {req.timeout_s}s: the trainer accepted the connection "
                        "but never completed the rendezvous",
                        code="rendezvous_failed",
                    )
                join.done.wait(min(left, 0.05))
            if join.error is not None and not join.cancelled.is_set():
                raise join.error
            with self._lock:  # registered, or cancelled, never both: cancel_join takes this lock
                if not join.cancelled.is_set():
                    assert join.group is not None
                    self._groups[req.group_name] = join.group
                    join.group = None
                    del self._joining[req.group_name]
            if join.cancelled.is_set():
                raise IllegalState(
                    f"the join of group {req.group_name!r} was cancelled by destroy_weights_update_group",
                    code="join_cancelled",
                )
        finally:
            with self._lock:
                if self._joining.get(req.group_name) is join:
                    del self._joining[req.group_name]
                join.abandoned = True
                late, join.group = join.group, None
            if late is not None:
                late.close()

    def _rendezvous(self, req: InitGroupRequest, local_rank: int, join: _Join) -> None:
        """The rendezvous itself, on its own thread; hands the group to :meth:`join`, or closes
        it when :meth:`join` stopped waiting."""
        group: Group | ReceiverGroup | CommGroup | None = None
        try:
            if req.rendezvous == "vllm_stateless":
                group = join_stateless(req, req.rank_offset + local_rank)
            elif req.receiver == "process":
                with self._lock:
                    helper, self._spare = self._spare, start_helper()
                group = ReceiverGroup(req, req.rank_offset + local_rank, helper)
            else:
                group = create_group(
                    req.group_name,
                    master_address=req.master_address,
                    master_port=req.master_port,
                    rank=req.rank_offset + local_rank,
                    world_size=req.world_size,
                    backend=req.backend,
                    timeout_s=req.timeout_s,
                    layout=req.rendezvous,
                )
        except BaseException as exc:  # handed to the caller, which raises it
            join.error = exc
        with self._lock:
            keep = not join.abandoned
            if keep:
                join.group = group
        if not keep and group is not None:
            group.close()
        join.done.set()

    def cancel_join(self, name: str) -> bool:
        """Cancel the rendezvous of ``name`` in progress, freeing the name at once; returns
        whether there was one.  Its caller gets ``join_cancelled``."""
        with self._lock:
            join = self._joining.pop(name, None)
            if join is not None:
                join.cancelled.set()
        return join is not None

    def destroy(self, name: str) -> None:
        """Leave the group ``name``, or cancel its join in progress.  Raises ``NotFound``."""
        if self.cancel_join(name):
            return
        with self._lock:
            group = self._groups.pop(name, None)
        if group is None:
            raise NotFound(f"no weight-update group {name!r}", code="unknown_group")
        group.close()

    def get(self, name: str) -> Group:
        """The group ``name``, joined by this process.  Raises ``NotFound`` (``unknown_group``), or
        ``InvalidRequest`` (``wrong_receiver``) for a helper process's or a vLLM trainer's."""
        group = self._joined(name)
        if isinstance(group, Group):
            return group
        raise InvalidRequest(
            f"group {name!r} was joined with receiver 'process' (foreign streams and plans); "
            "weightsync's packed stream needs a group joined with receiver 'inline'",
            code="wrong_receiver",
        )

    def plan_group(self, name: str) -> Group | ReceiverGroup:
        """The group ``name``, for a sharded plan: one a helper process joined (``receiver:
        "process"``), or an NCCL group this process joined.  Raises ``NotFound``,
        ``InvalidRequest`` (``wrong_receiver``), or (``unsafe_stream``) for a gloo group this
        process joined itself: a source sending more bytes than it declared would abort it."""
        group = self._joined(name)
        if isinstance(group, Group) and group.backend == "gloo":
            raise InvalidRequest(
                f"group {name!r} was joined by the worker itself (receiver 'inline'): on gloo a sharded "
                "plan needs a group joined with receiver 'process' (ShardedPusher's), since a source "
                "sending more bytes than it declared would abort the worker",
                code="unsafe_stream",
            )
        return group

    def _joined(self, name: str) -> Group | ReceiverGroup:
        """The group ``name``, unless it is a vLLM trainer's communicator (``wrong_receiver``)."""
        group = self.get_any(name)
        if isinstance(group, CommGroup):
            raise InvalidRequest(
                f"group {name!r} is a vLLM trainer's NCCL communicator, which carries vLLM's per-tensor "
                "and packed streams only",
                code="wrong_receiver",
            )
        return group

    def get_any(self, name: str) -> Group | ReceiverGroup | CommGroup:
        """The group ``name``, whoever joined it.  Raises ``NotFound`` (``unknown_group``)."""
        group = self._groups.get(name)
        if group is None:
            raise NotFound(
                f"no weight-update group {name!r}; call init_weights_update_group", code="unknown_group"
            )
        return group

    def close(self) -> None:
        for name in self.names():
            self.destroy(name)
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None:
            stop_helper(spare)

    def reader(self, source: DistributedSource, *, drains: bool = True) -> StreamReader:
        """The reader of ``source``'s stream on one of these groups (``drains``: see
        :class:`~.reader.StreamReader`; a dry run's reader does not)."""
        return StreamReader(self, source, drains=drains)

    def drain(self, source: DistributedSource) -> None:
        """``source``'s update was refused before its engine was asked (its state, its
        version): join what a trainer that posts and broadcasts at once is sending
        (:meth:`StreamReader.refused <.reader.StreamReader.refused>`).  Blocking; never raises."""
        StreamReader(self, source).refused()

    def abandon(self, name: str) -> None:
        """A refused update named group ``name`` with metadata that does not parse, so what
        its trainer sends cannot be joined: leave the group (a helper's process exits with it,
        and the trainer's collective fails instead of waiting).  Nothing without the group, or
        for a gloo group this process joined itself: it takes weightsync's packed stream only,
        whose trainer sends nothing before the go."""
        with self._lock:
            group = self._groups.get(name)
        if group is not None and not (isinstance(group, Group) and group.backend == "gloo"):
            log.warning("group %r left: a refused update declared no stream that can be drained", name)
            self._drop(group)

    def _drop(self, group: Group | ReceiverGroup | CommGroup) -> None:
        with self._lock:
            if self._groups.get(group.name) is group:
                del self._groups[group.name]
        group.close()
