"""Ranks 1..T-1 of a tensor-parallel reference engine, as the processes rank 0 commands.

:meth:`RankProcesses.spawn` hosts a TCPStore, spawns the ranks (``multiprocessing``'s
``spawn`` context; :func:`.tp_rank.rank_main`) and joins their gloo group as rank 0.
:meth:`RankProcesses.command` sends one command to every rank over its pipe, runs rank 0's
own part meanwhile, then collects every rank's answer; commands are serialised by one lock,
so the ranks see them, and their collectives, in one order.

A rank that dies, answers an error, or does not answer by its deadline fails them for good
(:meth:`RankProcesses.fail`): the remaining ranks are stopped and every later command raises
:class:`~weightsync.core.errors.EngineFailure` (``tp_rank_failed``, a 500) at once.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, TypeVar

import attrs
import torch.distributed as dist

from weightsync.core.errors import EngineFailure
from weightsync.engines.reference.model import ModelConfig
from weightsync.engines.reference.tp_rank import join_group, rank_main
from weightsync.transports.failures import describe_exception

T = TypeVar("T")

_POLL_S = 0.05


@attrs.define
class RankProcess:
    rank: int
    process: BaseProcess
    conn: Connection


def attempt(fn: Callable[..., T], *args: Any) -> T | BaseException:
    """``fn(*args)``, or what it raised."""
    try:
        return fn(*args)
    except BaseException as exc:
        return exc


class RankProcesses:
    """Ranks 1..``size``-1 and the gloo group they share with rank 0 (see the module docstring)."""

    def __init__(self, size: int, timeout_s: float) -> None:
        self.size, self.timeout_s = size, timeout_s
        self.ranks: list[RankProcess] = []
        self.failure: str | None = None
        self.group: Any = None  # the ranks' gloo group, rank 0's member of it
        self._store: Any = None
        self._lock = threading.Lock()

    def spawn(self, config: ModelConfig, slots: int) -> None:
        """Spawn the ranks and wait until every one joined the group and holds its part of the
        seeded model.  Raises ``EngineFailure`` when one does not within ``timeout_s``."""
        timeout = datetime.timedelta(seconds=self.timeout_s)
        store = dist.TCPStore("127.0.0.1", 0, self.size, True, timeout, wait_for_workers=False)
        ctx = multiprocessing.get_context("spawn")
        for r in range(1, self.size):
            ours, theirs = ctx.Pipe()
            args = (r, self.size, store.port, config, slots, self.timeout_s, theirs)
            proc = ctx.Process(target=rank_main, args=args, name=f"weightsync-tp-rank-{r}", daemon=True)
            proc.start()
            theirs.close()
            self.ranks.append(RankProcess(r, proc, ours))
        self._store = store
        # Joining blocks until every rank joined: wait for it beside the children, so that one
        # dying on the way (a bad interpreter, a main module without a __main__ guard) fails
        # the start at once instead of after the whole timeout.
        joined: list[Any] = []
        joiner = threading.Thread(
            target=lambda: joined.append(attempt(join_group, store, 0, self.size, self.timeout_s)),
            name="weightsync-tp-join",
            daemon=True,
        )
        joiner.start()
        deadline = time.monotonic() + self.timeout_s
        while joiner.is_alive():
            joiner.join(_POLL_S)
            for rank in self.ranks:
                if not rank.process.is_alive():
                    self.fail(f"rank {rank.rank} exited while starting (exit code {rank.process.exitcode})")
            if time.monotonic() > deadline:
                self.fail(f"the tensor-parallel group did not form within {self.timeout_s}s")
        if isinstance(joined[0], BaseException):
            self.fail(f"the tensor-parallel group did not form: {describe_exception(joined[0])}")
        self.group = joined[0]
        for rank in self.ranks:
            self._answer(rank, deadline)

    def command(
        self, op: str, args: Sequence[Any], local: Callable[[], T], timeout_s: float | None = None
    ) -> tuple[T, list[Any]]:
        """Send ``(op, args)`` to every rank and run ``local`` (rank 0's part) meanwhile;
        returns its result and the ranks' answers (by rank), each within ``timeout_s`` (the
        runner's own by default).  Raises ``EngineFailure``."""
        with self._lock:
            self.check()
            for rank in self.ranks:
                try:
                    rank.conn.send((op, tuple(args)))
                except OSError as exc:
                    self.fail(f"rank {rank.rank} is unreachable: {describe_exception(exc)}")
            try:
                mine = local()
            except Exception as exc:
                self.fail(f"rank 0 failed in {op}: {describe_exception(exc)}")
            deadline = time.monotonic() + (timeout_s or self.timeout_s)
            return mine, [self._answer(rank, deadline) for rank in self.ranks]

    def _answer(self, rank: RankProcess, deadline: float) -> Any:
        while not rank.conn.poll(_POLL_S):
            if not rank.process.is_alive():
                self.fail(f"rank {rank.rank} died (exit code {rank.process.exitcode})")
            if time.monotonic() > deadline:
                self.fail(f"rank {rank.rank} did not answer within {self.timeout_s}s")
        try:
            status, result = rank.conn.recv()
        except (EOFError, OSError):
            self.fail(f"rank {rank.rank} closed its pipe (exit code {rank.process.exitcode})")
        if status != "ok":
            self.fail(f"rank {rank.rank}: {result}")
        return result

    def check(self) -> None:
        """Raises ``EngineFailure`` (``tp_rank_failed``) once the ranks failed."""
        if self.failure is not None:
            raise EngineFailure(f"the tensor-parallel engine failed: {self.failure}", code="tp_rank_failed")

    def fail(self, message: str) -> Any:
        """Fail the ranks for good (the first failure is the one reported); raises it."""
        if self.failure is None:
            self.failure = message
            self.stop(grace_s=0.5)
        self.check()

    def alive(self) -> bool:
        return self.failure is None and all(r.process.is_alive() for r in self.ranks)

    def close(self) -> None:
        """Stop every rank (bounded: a rank that does not stop is killed) and leave the group."""
        if self.failure is None:
            self.failure = "the engine was closed"
        self.stop(grace_s=5.0)

    def stop(self, grace_s: float) -> None:
        for rank in self.ranks:
            with contextlib.suppress(Exception):
                rank.conn.send(("stop", ()))
        deadline = time.monotonic() + grace_s
        for rank in self.ranks:
            rank.process.join(max(deadline - time.monotonic(), 0.01))
            if rank.process.is_alive():
                rank.process.kill()
                rank.process.join(2.0)
            with contextlib.suppress(Exception):
                rank.conn.close()
        if self.group is not None:
            with contextlib.suppress(Exception):
                self.group.shutdown()
            self.group = None
