"""The helper process of a group joined with ``receiver: "process"`` (``python -m`` this
module; the worker's side is :mod:`.receiver`, which holds the protocol's description).

It joins the group the first line names, then posts each collective the worker asks for —
a broadcast from rank 0, or a point-to-point receive from one rank of a plan — into the
shared-memory segments whose descriptors come on its socket.  Collectives are posted as the
requests arrive (a plan keeps two receives in flight) and answered in that order by a
second thread, which waits for each in turn.  A peer that sends more bytes than a receive
asked for makes gloo abort this process: the worker sees the pipe close.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import queue
import socket
import sys
import threading
from typing import Any

import torch

from weightsync.core.errors import WeightSyncError
from weightsync.core.requests import InitGroupRequest
from weightsync.transports.distributed.group import Group, create_group


def _answer_in_order(group: Group, posted: queue.Queue[Any], answer: Any) -> None:
    """Wait for each posted collective in turn and answer it (``None`` ends the thread)."""
    while (work := posted.get()) is not None:
        try:
            group.wait(work)
        except Exception as exc:
            answer({"error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            continue
        answer({"ok": True})


def _serve(out: Any, fds: socket.socket) -> None:
    """Join the group the first line names, then post the collectives the next lines ask
    for (see the module docstring)."""
    lock = threading.Lock()

    def answer(msg: dict[str, Any]) -> None:
        with lock:
            out.write(json.dumps(msg) + "\n")
            out.flush()

    first = sys.stdin.buffer.readline()
    if not first:
        return  # a spare the worker never used
    try:
        wire = json.loads(first)
        req = InitGroupRequest.from_wire({k: v for k, v in wire.items() if k != "rank"})
        group = create_group(
            req.group_name,
            master_address=req.master_address,
            master_port=req.master_port,
            rank=int(wire["rank"]),
            world_size=req.world_size,
            backend=req.backend,
            timeout_s=req.timeout_s,
            layout=req.rendezvous,
        )
    except WeightSyncError as exc:
        answer({"error": exc.message})
        return
    answer({"joined": True})
    posted: queue.Queue[Any] = queue.Queue()
    waiter = threading.Thread(target=_answer_in_order, args=(group, posted, answer), daemon=True)
    waiter.start()
    maps: dict[int, torch.Tensor] = {}
    try:
        for line in sys.stdin.buffer:
            msg = json.loads(line)
            op = msg.get("op")
            if op not in ("broadcast", "recv"):
                break
            segment, nbytes = int(msg["segment"]), int(msg["nbytes"])
            if segment not in maps:
                maps.clear()
                _, (fd, *_), _, _ = socket.recv_fds(fds, 1, 1)
                try:
                    maps[segment] = torch.frombuffer(mmap.mmap(fd, 0), dtype=torch.uint8)
                finally:
                    os.close(fd)
            offset = int(msg.get("offset", 0))
            region = maps[segment][offset : offset + nbytes]
            try:
                if op == "broadcast":
                    work = group.broadcast(region)
                else:
                    work = group.recv(region, int(msg["src"]), int(msg["tag"]))
            except Exception as exc:
                posted.put(_Failed(exc))
                continue
            posted.put(work)
    finally:
        posted.put(None)
        with contextlib.suppress(Exception):
            waiter.join(timeout=group.timeout_s + 5.0)
        group.close()


class _Failed:
    """A collective that could not be posted: waiting for it raises what posting raised."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def wait(self, timeout: Any = None) -> bool:
        raise self.exc


def main() -> None:
    # Answers go to a private copy of stdout; anything else written to fd 1 (a library's
    # print) lands on stderr instead of in the protocol.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    _serve(out, socket.socket(fileno=int(sys.argv[1])))


if __name__ == "__main__":
    main()
