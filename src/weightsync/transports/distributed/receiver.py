"""A group member in a helper process, so that a size lie cannot reach the serving process.

gloo checks every incoming message against the receive it posted and, when a peer sends
*more* bytes than that, throws from its I/O thread: the exception cannot be caught and the
whole process aborts (SIGABRT).  No check before the collectives can rule that out: a
foreign stream (vLLM's or SGLang's trainers, one broadcast per tensor or a few flat ones)
declares its sizes only in the request, and a plan's source can send other sizes than the
manifest it posted.  A group joined with ``receiver: "process"`` is therefore joined by a
helper process (:mod:`.helper`; the registry keeps a spare one started): it owns the group
and receives each broadcast, or each message of a plan, into a shared-memory segment the
worker created and reads from.  A segment is an anonymous memory file (``memfd_create``),
its size sealed, handed over as a descriptor: nothing is left behind when either process
is killed.  A lie kills the helper, not the worker: the worker sees the pipe close, answers
``peer_failed`` (nothing changed, or torn when something was written), drops the group and
keeps serving.  The worker talks to the trainer's store itself, as a client of its own.

A *short* send (fewer bytes than declared) completes silently in gloo.  Before each
broadcast the worker writes 8 random bytes at the end of the region; if they are still there
after the receive, the peer sent at least 8 bytes too few (an honest tensor ends in those 8
bytes with probability 2**-64), and the update fails as ``short_send`` before that tensor is
handed on.  A shortfall of 1-7 bytes is caught only by the request's ``hashes``; a plan's
pieces are all checked against their sources' hashes.

The pipe protocol is one JSON object a line each way; nothing is pickled.  The worker sends
``{"op": "broadcast" | "recv", "segment", "offset", "nbytes"}`` (``recv`` with ``"src",
"tag"``; a new segment number comes with its descriptor on the helper's socket) or ``{"op":
"close"}``; the helper answers ``{"joined": true}`` once, then ``{"ok": true}`` or
``{"error": message}`` per collective, in order (after an error the group is dropped).
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Generator, Sequence
from typing import Any

import torch

from weightsync.core.errors import EngineFailure, EngineUnavailable, InvalidRequest, LoadFailed
from weightsync.core.requests import InitGroupRequest
from weightsync.transports.distributed.group import check_timeout, connect_plain_store
from weightsync.transports.distributed.segment import Segment

SENTINEL_BYTES = 8
"""How many random bytes mark the end of a receive region (see the module docstring)."""

START_GRACE_S = 120.0
"""Time the helper may take to start (import torch) beyond the rendezvous' own timeout."""


class PeerFailed(LoadFailed):
    """The helper that owns the group died (a size lie makes gloo abort it) or stopped
    answering.  ``wrote=False`` here; the target decides whether the update tore."""

    def __init__(self, message: str) -> None:
        cause = EngineUnavailable(message, code="peer_failed")
        super().__init__(message, wrote=False, cause=cause, code="peer_failed")


class ShortSend(LoadFailed):
    """The peer sent fewer bytes than the request declared for one broadcast."""

    def __init__(self, message: str) -> None:
        cause = InvalidRequest(message, code="short_send")
        super().__init__(message, wrote=False, cause=cause, code="short_send")


class Helper(subprocess.Popen[bytes]):
    """A helper process (``argv``: by default :mod:`.helper`'s ``main``), its stdin and stdout
    the pipe of the protocol, and :attr:`fds`, the worker's end of the socket that hands it
    segments' descriptors.  It exits when its stdin closes, so one never outlives its worker
    for long."""

    def __init__(self, argv: list[str] | None = None) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            super().__init__(
                argv
                or [sys.executable, "-m", "weightsync.transports.distributed.helper", str(theirs.fileno())],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,  # a signal meant for the worker's process group is not the helper's
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.fds = ours


class ReceiverGroup:
    """The worker's handle on a group a helper process joined (see the module docstring).
    Offers what a foreign stream needs (:meth:`receive_each`, two broadcasts in flight) and what a
    plan's receive needs (:meth:`buffers`, :meth:`recv`, :meth:`wait`, :attr:`store`), and
    ``device``, ``close``."""

    receiver = "process"

    def __init__(self, req: InitGroupRequest, rank: int, helper: Helper | None = None) -> None:
        self.name = req.group_name
        self.rank = rank
        self.world_size = req.world_size
        self.backend = req.backend
        self.timeout_s = check_timeout(req.timeout_s)
        self.device = torch.device("cpu")
        self.dead = False
        self._req = req
        self._store: Any = None
        self._segment: Segment | None = None
        self._buffer = b""
        self._asked = self._answered = 0  # collectives asked for, and answered, in order
        self._proc = helper if helper is not None and helper.poll() is None else start_helper()
        self._sent = 0  # the segment the helper holds
        assert self._proc.stdout is not None and self._proc.stdin is not None
        self._out = self._proc.stdout
        self._in = self._proc.stdin
        os.set_blocking(self._out.fileno(), False)
        try:
            self._send({**req.to_wire(), "rank": rank})
            reply = self._reply(self.timeout_s + START_GRACE_S, "joining the group")
        except Exception:
            self._discard()
            raise
        if "joined" not in reply:
            self._discard()
            raise EngineUnavailable(str(reply.get("error", reply)), code="rendezvous_failed")

    def _discard(self) -> None:
        """Drop a helper that never joined: it holds no group and no segment, so it is killed
        at once and reaped in the background (waiting for its interpreter to exit would hold
        the refusal back past the join's deadline)."""
        self.dead = True
        for pipe in (self._proc.stdin, self._proc.stdout, self._proc.fds):
            with contextlib.suppress(Exception):
                if pipe is not None:
                    pipe.close()
        with contextlib.suppress(Exception):
            self._proc.kill()
        threading.Thread(target=self._proc.wait, name="weightsync-reap-helper", daemon=True).start()

    # -- what a foreign stream calls -------------------------------------------------------

    def receive(self, nbytes: int) -> torch.Tensor:
        """Rank 0's next broadcast of ``nbytes`` bytes (:meth:`receive_each` of one)."""
        return next(iter(self.receive_each([nbytes])))

    def receive_each(self, sizes: Sequence[int]) -> Generator[torch.Tensor, None, None]:
        """Receive rank 0's next ``len(sizes)`` broadcasts, of those sizes in order, through
        the helper, the next one posted into the segment's other region before one is handed
        over, so the helper receives it while the caller copies this one out.  Yields each (a
        view of the shared segment, valid until the generator is resumed).

        Raises ``PeerFailed`` when the helper died or did not answer, ``EngineFailure``
        (``timeout``/``stream_failed``) when its collective failed, ``ShortSend`` when fewer
        bytes arrived than asked for; after any of them the group is :attr:`dead`.  A caller
        that stops early with a broadcast still asked for waits for it here (its bytes are
        not handed over): the group is then in step after :attr:`asked` broadcasts, and the
        rest of what the trainer sends is the caller's to drain (:mod:`.drain`)."""
        if not sizes:
            return
        stride = -(-max(sizes) // 64) * 64  # each region aligned for any dtype
        regions = min(2, len(sizes))
        try:
            seg = self._room(stride * regions)
        except EngineUnavailable as exc:  # no room for two regions: one, without overlap
            if regions == 1 or exc.code != "no_memory":
                raise
            regions, seg = 1, self._room(stride)
        posted: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (ticket, region, sentinel)

        def post(i: int) -> None:
            start = (i % regions) * stride
            region = seg[start : start + sizes[i]]
            sentinel = torch.frombuffer(bytearray(os.urandom(SENTINEL_BYTES)), dtype=torch.uint8)
            if sizes[i] >= SENTINEL_BYTES:
                region[-SENTINEL_BYTES:].copy_(sentinel)
            ticket = self._ask({"op": "broadcast", "offset": start, "nbytes": sizes[i]})
            posted.append((ticket, region, sentinel))

        try:
            post(0)
            for i in range(len(sizes)):
                ticket, region, sentinel = posted.pop(0)
                self.wait(ticket)
                if sizes[i] >= SENTINEL_BYTES and torch.equal(region[-SENTINEL_BYTES:], sentinel):
                    self.dead = True  # the trainer's stream is no longer where the request says
                    raise ShortSend(
                        f"group {self.name!r}: the trainer sent fewer bytes than the {sizes[i]} "
                        "declared for one broadcast (a short send, or a smaller dtype than "
                        "declared); the group is dropped"
                    )
                if i + 1 < len(sizes) and regions == 2:
                    post(i + 1)
                yield region
                if i + 1 < len(sizes) and regions == 1:
                    post(i + 1)
        finally:
            if posted and not self.dead:  # stopped early: let the broadcast asked for land
                with contextlib.suppress(LoadFailed, EngineFailure):  # those leave the group dead
                    self.wait(posted[-1][0])

    @property
    def asked(self) -> int:
        """How many collectives this group asked its helper for so far (each broadcast of
        :meth:`receive_each` is one, in order)."""
        return self._asked

    # -- what a plan's receive calls -------------------------------------------------------

    @property
    def store(self) -> Any:
        """The trainer's store, as a member that joined itself holds it (a client of its own,
        not counted among the group's members, connected at first use).  Raises what
        connecting raised."""
        if self._store is None:
            req = self._req
            self._store = connect_plain_store(req.master_address, req.master_port, self.timeout_s)
        return self._store

    def buffers(self, size: int) -> list[torch.Tensor]:
        """Two byte buffers of ``size`` bytes in the shared segment (kept across streams), the
        only memory :meth:`recv` receives into."""
        seg = self._room(2 * size)
        return [seg[:size], seg[size : 2 * size]]

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> int:
        """Ask the helper to receive exactly ``tensor``'s size from group rank ``src`` into
        ``tensor``, a slice of :meth:`buffers`; returns the ticket :meth:`wait` takes.  Raises
        ``PeerFailed`` when the helper is gone."""
        seg = self._room(0)
        offset = tensor.data_ptr() - seg.data_ptr()
        inside = offset >= 0 and offset + tensor.numel() <= seg.numel()
        if not (inside and tensor.dtype == torch.uint8 and tensor.is_contiguous()):
            raise ValueError("a receive through the helper lands only in this group's buffers")
        return self._ask({"op": "recv", "offset": offset, "nbytes": tensor.numel(), "src": src, "tag": tag})

    def wait(self, ticket: int) -> None:
        """Wait until the collective ``ticket`` (and every one asked for before it) is done.
        Raises ``PeerFailed`` when the helper died or did not answer, ``EngineFailure``
        (``timeout``/``stream_failed``) when a collective failed; the group is then
        :attr:`dead`."""
        while self._answered <= ticket:
            reply = self._reply(self.timeout_s + 5.0, "a receive")
            self._answered += 1
            if "ok" not in reply:
                self.dead = True
                error = str(reply.get("error", reply))
                code = "timeout" if "timed out" in error.lower() else "stream_failed"
                raise EngineFailure(f"group {self.name!r}: the collective failed: {error}", code=code)

    def _room(self, nbytes: int) -> torch.Tensor:
        """The segment, at least ``nbytes`` long (a bigger one replaces a smaller one).
        Raises ``PeerFailed`` on a dead group."""
        if self.dead:
            raise PeerFailed(f"group {self.name!r} is gone (an earlier stream broke it); join a new one")
        if self._segment is None or self._segment.size < nbytes:
            if self._segment is not None:
                self._segment.close()
            self._segment = None
            self._segment = Segment(nbytes)
        return self._segment.tensor

    def _ask(self, msg: dict[str, Any]) -> int:
        """Ask the helper for one collective on the current segment; its ticket."""
        assert self._segment is not None
        if self._sent != self._segment.id:
            try:
                socket.send_fds(self._proc.fds, [b"s"], [self._segment.fd])
            except OSError as exc:
                self.dead = True
                raise PeerFailed(self._died(f"could not be handed its buffer ({exc})")) from None
            self._sent = self._segment.id
        self._send({**msg, "segment": self._segment.id})
        self._asked += 1
        return self._asked - 1

    def close(self) -> None:
        """Stop the helper (it leaves the group) and free the segment.  Bounded: a helper
        that does not leave within a few seconds is killed."""
        self.dead = True
        with contextlib.suppress(Exception):
            self._send({"op": "close"})
        stop_helper(self._proc)
        self._store = None
        if self._segment is not None:
            self._segment.close()
            self._segment = None

    # -- the pipe ------------------------------------------------------------------------

    def _send(self, msg: dict[str, Any]) -> None:
        try:
            self._in.write(json.dumps(msg).encode() + b"\n")
            self._in.flush()
        except (OSError, ValueError) as exc:
            self.dead = True
            raise PeerFailed(self._died(f"could not be asked ({exc})")) from None

    def _reply(self, timeout_s: float, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as sel:
            sel.register(self._out, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.dead = True
                    self._proc.kill()
                    raise PeerFailed(
                        f"group {self.name!r}: the receiving helper gave no answer to {what} "
                        f"within {timeout_s:g}s; it was stopped"
                    )
                if not sel.select(min(left, 1.0)):
                    continue
                chunk = os.read(self._out.fileno(), 65536)
                if not chunk:
                    self.dead = True
                    raise PeerFailed(self._died(f"during {what}"))
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        try:
            reply = json.loads(line)
        except ValueError:  # not JSON, or not UTF-8: the helper is out of step
            reply = None
        if not isinstance(reply, dict):
            self.dead = True
            raise PeerFailed(
                f"group {self.name!r}: the receiving helper answered {what} with {line[:200]!r}, "
                "not a reply; the group is gone (join a new one)"
            )
        return reply

    def _died(self, when: str) -> str:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=5.0)
        rc = self._proc.returncode
        how = (
            f"was killed by {signal.Signals(-rc).name}"
            if rc is not None and rc < 0 and -rc in signal.valid_signals()
            else f"exited ({rc})"
        )
        return (
            f"group {self.name!r}: the helper process receiving the stream {how} {when} — a trainer "
            "that sends more bytes than declared makes gloo abort the receiving process; the worker "
            "was not affected, the group is gone (join a new one)"
        )


def start_helper() -> Helper:
    """A helper process, importing torch while it waits for the group to join (the first line
    it reads)."""
    return Helper()


def stop_helper(proc: Helper) -> None:
    """Close ``proc``'s stdin (it leaves its group and exits); kill it if it has not within a
    few seconds.  Bounded."""
    for pipe in (proc.stdin, proc.stdout, proc.fds):
        with contextlib.suppress(Exception):
            if pipe is not None:
                pipe.close()
    try:
        proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5.0)
