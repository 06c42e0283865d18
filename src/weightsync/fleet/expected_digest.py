"""The coordinator's own digest of a checkpoint, taken beside the prepare's dry runs.

A disk transaction's expected digest (the one every worker must end on) is computed here
from the checkpoint: from its manifest's per-tensor hashes, or by reading it whole when it
has none.  That takes time — reading a large checkpoint, or only loading the hashing code
the first time — so it runs in a thread of its own while the workers dry-run, and the
prepare waits for it only within a bound (:func:`digest_by`), saying so while it waits: a
line when the dry runs answered before the hash ended, and progress lines after that, like
any other step's.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable

from weightsync.fleet.fanout import Fanout

__all__ = ["digest_by", "in_thread"]


def in_thread(fn: Callable[[], str | None]) -> asyncio.Future[str | None]:
    """``fn()`` in a daemon thread of its own (not the loop's executor, which ``asyncio.run``
    waits for at its end, nor one an interpreter's exit waits for), as a future of this loop."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[str | None] = loop.create_future()

    def settle(value: str | None, error: BaseException | None) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(value)

    def run() -> None:
        value, error = None, None
        try:
            value = fn()
        except BaseException as exc:  # handed to the loop; the thread only reports
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, value, error)

    future.add_done_callback(lambda f: f.cancelled() or f.exception())  # an error nobody awaits is read
    threading.Thread(target=run, name="weightsync-expected-digest", daemon=True).start()
    return future


async def digest_by(
    fanout: Fanout,
    phase: str,
    hashing: asyncio.Future[str | None],
    deadline: float,
    say: Callable[[str, str], None],
) -> str | None:
    """The digest ``hashing`` computes, if it is known within half of what is left before
    ``deadline`` once the dry runs answered (the other half is the later phases'), else
    ``None``: unknown, so the workers' dry runs decide, as when the path cannot be read here.
    A hash still running then finishes in its thread and is dropped; the loop never waits on
    it.

    While it waits, ``say(what, detail)`` is told that the checkpoint is being hashed and, if
    the hash outlasts its bound, that the digest is unknown; ``fanout``'s progress lines
    (under ``phase``) fill the time between.
    """
    if not hashing.done():
        say("hashing the checkpoint", "the digest every worker must end on; the dry runs answered")
        started = time.monotonic()
        until = started + max(0.0, deadline - started) / 2

        def owed(_: object) -> str:
            return f"hashing the checkpoint, {time.monotonic() - started:.1f}s so far"

        if await fanout.waiting(phase, [hashing], until, owed):
            say("expected digest unknown", "hashing the checkpoint outlasted the prepare")
            return None
    return hashing.result()
