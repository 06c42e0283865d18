"""The adapter slots' commands: the slot table plus an engine, safe to embed in any server.

Rules it keeps (those of the base's controller, for slots):

1. Slot commands run one at a time, in arrival order, and once one has arrived it is carried
   out even if its caller goes away.  They have a queue of their own: a load that reads an
   adapter never holds up a pause, a declaration or an update of the base, and nothing here
   reads or writes the base's state.
2. Reads (:attr:`AdapterSlots.table`) never wait: they see the last committed table, a slot
   ``loading``, ``replacing`` or ``evicting`` while its command runs.
3. Legality is decided before the engine is touched (the steps of
   :class:`~weightsync.lora.slots.SlotTable` follow the tables of :mod:`~weightsync.lora._slots`),
   so a refused command has no side effect; a load that fails after it began puts the slot
   back as it was (the engine's prepare serves nothing, its install is all or nothing).
4. A slot's version is committed only once the engine serves the verified adapter under it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import attrs

from weightsync.core.errors import InvalidRequest, WeightSyncError
from weightsync.lora._slots import REFUSED, SUCCEEDED
from weightsync.lora.engine import AdapterEngine
from weightsync.lora.requests import LoadAdapter
from weightsync.lora.slots import AdapterFacts, Slot, SlotTable, load_version

log = logging.getLogger("weightsync.lora")
T = TypeVar("T")


@attrs.frozen
class LoadOutcome:
    """What a load did: the slot as committed, and whether it replaced a served version."""

    slot: Slot
    replaced: bool


class AdapterSlots:
    """The LoRA slots of one worker over ``engine`` (an engine's
    :class:`~weightsync.lora.engine.AdapterEngine`), at most ``capacity`` loaded at once;
    ``reserved``: names no adapter may take (the base model's).  Every command raises the
    :mod:`weightsync.core.errors` family and leaves the table unchanged when it refuses."""

    def __init__(self, engine: AdapterEngine, capacity: int, *, reserved: Iterable[str] = ()) -> None:
        if capacity < 1:
            raise ValueError("an adapter table holds at least one slot")
        self.engine = engine
        self.reserved = frozenset(reserved)
        self._table = SlotTable(capacity)
        self._lock = asyncio.Lock()
        self._running: set[asyncio.Task[None]] = set()

    @property
    def table(self) -> SlotTable:
        """The last committed table; never waits for a command under way."""
        return self._table

    def serving(self, name: str) -> bool:
        """Whether a request naming ``name`` is served by an adapter now."""
        return self._table.serving(name)

    async def load(self, request: LoadAdapter) -> LoadOutcome:
        """Load the adapter at ``request.path`` under ``request.name``, verified, and commit its
        version (:func:`~weightsync.lora.slots.load_version`) once the engine serves it.

        Raises, nothing changed: ``InvalidRequest`` (``reserved_name`` for the base's name,
        ``adapter_exists`` for a loaded name without ``replace``, and the adapter's refusals),
        ``IllegalState`` (``adapter_slots_full``, ``adapter_busy``, ``version_mismatch``),
        ``NotFound`` (the path), or what the engine raises."""
        name = request.name
        if name in self.reserved:
            raise InvalidRequest(
                f"the adapter name {name!r} is the base model's", code="reserved_name", field="lora_name"
            )

        async def run() -> LoadOutcome:
            before = self._table
            if before.serving(name) and not request.replace:
                raise InvalidRequest(
                    f"an adapter is loaded as {name!r} already: unload it first, or load it in place "
                    "(load_inplace: true)",
                    code="adapter_exists",
                    field="lora_name",
                )
            self._table = before.load_begun(name)  # legality first: full, busy
            try:
                prepared = await self.engine.prepare_adapter(request.path)
                version = load_version(request.version, prepared.manifest_version, prepared.has_version)
                facts = AdapterFacts(
                    prepared.path,
                    prepared.rank,
                    prepared.lora_alpha,
                    prepared.target_modules,
                    prepared.nbytes,
                )
                after = self._table.load_ended(
                    name, SUCCEEDED, version=version, digest=prepared.digest, facts=facts
                )
                slot = after.slot(name)
                await self.engine.install_adapter(name, prepared, slot.version, slot.version_current)
            except BaseException:
                self._table = self._table.load_ended(name, REFUSED)
                raise
            self._table = after
            return LoadOutcome(slot, before.serving(name))

        return await self._run(run)

    async def unload(self, name: str) -> Slot:
        """Stop serving ``name`` (requests that hold its version finish with it) and forget the
        slot; return it as it was.  Raises ``NotFound`` (``adapter_not_found``), ``IllegalState``
        (``adapter_busy``), or what the engine raises (the slot stays resident)."""

        async def run() -> Slot:
            slot = self._table.slot(name)
            self._table = self._table.evict_begun(name)
            try:
                await self.engine.evict_adapter(name)
            except BaseException:
                self._table = self._table.evict_refused(name)
                raise
            self._table = self._table.evicted(name)
            return slot

        return await self._run(run)

    async def _run(self, command: Callable[[], Awaitable[T]]) -> T:
        """Run ``command`` after every command that arrived before it, in a task its caller's
        cancellation does not reach; return its result or raise its exception."""
        done: asyncio.Future[T] = asyncio.get_running_loop().create_future()

        async def locked() -> None:
            async with self._lock:
                try:
                    result = await command()
                except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):
                    done.cancel()
                    raise
                except BaseException as exc:
                    if not isinstance(exc, WeightSyncError):
                        log.exception("adapter command failed")
                    if not done.cancelled():
                        done.set_exception(exc)
                    return
                if not done.cancelled():
                    done.set_result(result)

        task = asyncio.get_running_loop().create_task(locked())
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        return await done

    def to_reply(self) -> dict[str, Any]:
        """The slots as replies report them (see :meth:`SlotTable.to_reply`)."""
        return self._table.to_reply()
