"""vLLM's engine processes end when the server that started them ends, however it ends.

vLLM's workers already exit when their EngineCore does (a death pipe), but the EngineCore
does not watch the server that spawned it: a server killed with SIGKILL (an OOM killer, a
scheduler) leaves the EngineCore and its workers running, re-parented to init, holding their
memory reservation, so a restarted server on the same machine cannot start.

:func:`start` runs in each vLLM worker process (the worker extension's module calls it when
vLLM imports it there).  It finds the *server* — the process named by
``WEIGHTSYNC_SERVER_PID`` (``weightsync serve`` sets it before starting vLLM), else the
nearest ancestor that is not one of vLLM's own processes (vLLM's own server with the
middleware) — remembers the vLLM processes between itself and the server (the
EngineCore), and waits on the server in a daemon thread (a pidfd where the kernel has them,
else polling ``/proc``).  When the server is gone it terminates those processes (SIGTERM,
then SIGKILL after a grace period) and then itself.  Processes are identified by pid *and*
start time, so a reused pid is never signalled.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import threading
import time

log = logging.getLogger(__name__)

ENV = "WEIGHTSYNC_SERVER_PID"
GRACE_S = 3.0
POLL_S = 0.5

_started = False


def _stat(pid: int) -> tuple[int, str, int] | None:
    """``(ppid, state, start time)`` of ``pid``; ``None`` if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # the name in parentheses may contain spaces
    return int(fields[1]), fields[0], int(fields[19])


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return ""


def _alive(pid: int, start: int) -> bool:
    """Whether the process ``pid`` that started at ``start`` still runs (a zombie does not)."""
    st = _stat(pid)
    return st is not None and st[2] == start and st[1] not in ("Z", "X")


def _ancestors() -> list[tuple[int, int]]:
    """``(pid, start time)`` of every ancestor, nearest first."""
    out: list[tuple[int, int]] = []
    pid = os.getppid()
    while pid > 1:
        st = _stat(pid)
        if st is None:
            break
        out.append((pid, st[2]))
        pid = st[0]
    return out


def find_server() -> tuple[tuple[int, int], list[tuple[int, int]]] | None:
    """The server to watch and the vLLM processes between it and this one, or ``None`` when
    this process is not one of a server's vLLM processes."""
    ancestors = _ancestors()
    wanted = os.environ.get(ENV, "")
    if wanted.isdigit():
        for i, (pid, start) in enumerate(ancestors):
            if pid == int(wanted):
                return (pid, start), ancestors[:i]
        return None  # inherited by a process the server did not start
    if not _is_vllm(os.getpid()):
        return None
    for i, (pid, start) in enumerate(ancestors):
        if not _is_vllm(pid):
            return (pid, start), ancestors[:i]
    return None


def _is_vllm(pid: int) -> bool:
    """One of vLLM's processes: titled ``VLLM::...``, or spawned and not yet titled (a worker
    imports the extension before it sets its title)."""
    cmdline = _cmdline(pid)
    return cmdline.startswith("VLLM::") or "--multiprocessing-fork" in cmdline


def _wait_for_exit(pid: int, start: int) -> None:
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = -1
    try:
        if fd >= 0 and _alive(pid, start):  # the pidfd names the process we meant
            select.select([fd], [], [])
            return
    finally:
        if fd >= 0:
            os.close(fd)
    while _alive(pid, start):
        time.sleep(POLL_S)


def _signal(pid: int, start: int, sig: int) -> None:
    if _alive(pid, start):
        with contextlib.suppress(OSError):
            os.kill(pid, sig)


def _watch(server: tuple[int, int], between: list[tuple[int, int]]) -> None:
    _wait_for_exit(*server)
    log.warning("weightsync: server process %d is gone; stopping vLLM's processes", server[0])
    for pid, start in between:
        _signal(pid, start, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and any(_alive(p, s) for p, s in between):
        time.sleep(0.1)
    for pid, start in between:
        _signal(pid, start, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGTERM)  # vLLM's handler shuts the worker down cleanly...
    time.sleep(GRACE_S)
    os._exit(1)  # ...or it did not


def start() -> bool:
    """Start watching the server from this process (once); return whether it watches."""
    global _started
    if _started:
        return True
    try:
        found = find_server()
    except Exception:  # never let the watchdog stop a worker from starting
        log.exception("weightsync: cannot find the server process to watch")
        return False
    if found is None:
        return False
    _started = True
    threading.Thread(target=_watch, args=found, name="weightsync-watchdog", daemon=True).start()
    return True
