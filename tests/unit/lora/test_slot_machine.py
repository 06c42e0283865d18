"""The adapter slots against a pure model, by hypothesis: random loads (verified, refused,
mismatched, failing in the engine), replacements, unloads and base commands (pause, resume,
updates that tear), interleaved.  After every step the slot table, the engine's served
adapters and the model agree; no adapter command changes the base's state and no base
command changes a slot; the cap is never exceeded."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import attrs
import pytest
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from weightsync.core import Controller, Declared, DiskSource, PauseRequest, UpdateRequest, WeightSyncError
from weightsync.core.errors import EngineFailure, InvalidRequest
from weightsync.core.snapshot import UNDECLARED, PauseMode, Version
from weightsync.lora.commands import AdapterSlots
from weightsync.lora.requests import LoadAdapter
from weightsync.testing import ScriptableEngine

NAMES = ("a", "b", "c", "base")
CAPACITY = 2


@attrs.frozen
class FakePrepared:
    path: str
    digest: str
    manifest_version: Any = None
    has_version: bool = False
    rank: int = 4
    lora_alpha: float = 8.0
    target_modules: tuple[str, ...] = ("q_proj",)
    nbytes: int = 64


class FakeAdapters:
    """An engine's adapters, in memory.  ``ok:<k>`` is an adapter of digest ``d<k>``;
    ``v:<k>:<ver>`` one whose manifest names ``<ver>``; ``bad`` is refused by prepare;
    ``boom`` prepares, then fails to install (nothing served changes)."""

    def __init__(self) -> None:
        self.served: dict[str, tuple[str, Version, bool]] = {}
        self.calls = 0

    async def prepare_adapter(self, path: str) -> FakePrepared:
        self.calls += 1
        await asyncio.sleep(0)
        if path == "bad":
            raise InvalidRequest("no such adapter", code="not_an_adapter")
        kind, key, *rest = [*path.split(":"), ""]
        if kind == "v":
            return FakePrepared(path, f"d{key}", rest[0], True)
        return FakePrepared(path, f"d{key}")

    async def install_adapter(
        self, name: str, prepared: FakePrepared, version: Version, current: bool
    ) -> None:
        if prepared.path.startswith("boom"):
            raise EngineFailure("the engine failed to serve it")
        self.served[name] = (prepared.digest, version, current)

    async def evict_adapter(self, name: str) -> None:
        del self.served[name]


@attrs.frozen
class Expected:
    digest: str
    version: Version = UNDECLARED
    label_digest: str | None = None


class SlotMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.engine = FakeAdapters()
        self.slots = AdapterSlots(self.engine, CAPACITY, reserved=("base",))
        self.base = ScriptableEngine()
        self.controller = self.run_async(self._controller())
        self.model: dict[str, Expected] = {}

    async def _controller(self) -> Controller:
        return Controller(self.base)

    def run_async(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        self.loop.close()

    def outcome(self, coro: Any) -> tuple[Any, WeightSyncError | None]:
        base, table = self.controller.snapshot(), self.slots.table
        try:
            return self.run_async(coro), None
        except WeightSyncError as exc:
            assert self.slots.table == table, "a refused slot command changed the table"
            return None, exc
        finally:
            assert self.controller.snapshot() == base, "a slot command changed the base's state"

    @rule(
        name=st.sampled_from(NAMES),
        path=st.sampled_from(("ok:1", "ok:2", "v:3:x", "v:4:y", "bad", "boom:5")),
        version=st.sampled_from((None, "x", "z")),
        replace=st.booleans(),
    )
    def load(self, name: str, path: str, version: str | None, replace: bool) -> None:
        given = None if version is None else Declared(version)
        _, error = self.outcome(self.slots.load(LoadAdapter(name, path, given, replace)))
        expected = self.expect_load(name, path, given, replace)
        if isinstance(expected, str):
            assert error is not None and error.code == expected, (expected, error)
            return
        assert error is None, error
        self.model[name] = expected

    def expect_load(self, name: str, path: str, given: Declared | None, replace: bool) -> Expected | str:
        if name == "base":
            return "reserved_name"
        if name in self.model and not replace:
            return "adapter_exists"
        if name not in self.model and len(self.model) >= CAPACITY:
            return "adapter_slots_full"
        if path == "bad":
            return "not_an_adapter"
        kind, key, *rest = path.split(":")
        manifest = Declared(rest[0]) if kind == "v" else None
        if given is not None and manifest is not None and given != manifest:
            return "version_mismatch"
        if kind == "boom":
            return "engine_failure"
        digest, label = f"d{key}", given or manifest
        if label is not None:
            return Expected(digest, label, digest)
        before = self.model.get(name)
        return Expected(digest, before.version, before.label_digest) if before else Expected(digest)

    @rule(name=st.sampled_from(NAMES))
    def unload(self, name: str) -> None:
        slot, error = self.outcome(self.slots.unload(name))
        if name not in self.model:
            assert error is not None and error.code == "adapter_not_found"
            return
        assert error is None and slot.name == name
        del self.model[name]

    @rule(mode=st.sampled_from(list(PauseMode)))
    def base_pause(self, mode: PauseMode) -> None:
        self.base_command(self.controller.pause(PauseRequest(mode, False)))

    @rule()
    def base_resume(self) -> None:
        self.base_command(self.controller.resume())

    @rule(kind=st.sampled_from(("ok:new", "tear", "invalid")))
    def base_update(self, kind: str) -> None:
        source = DiskSource(kind)
        self.base_command(
            self.controller.update(UpdateRequest(source, allow_unpaused=True, reset_prefix_cache=False))
        )

    def base_command(self, coro: Any) -> None:
        table = self.slots.table
        with contextlib.suppress(WeightSyncError):
            self.run_async(coro)
        assert self.slots.table == table, "a base command changed an adapter slot"

    @invariant()
    def slots_agree_with_the_model_and_the_engine(self) -> None:
        table = self.slots.table
        assert set(table.slots) == set(self.model) == set(self.engine.served)
        assert table.taken <= CAPACITY
        for name, want in self.model.items():
            slot = table.slot(name)
            assert slot.residency == "resident", slot
            assert (slot.digest, slot.version, slot.label_digest) == (
                want.digest,
                want.version,
                want.label_digest,
            )
            current = isinstance(want.version, Declared) and want.label_digest == want.digest
            assert slot.version_current == current
            assert self.engine.served[name] == (want.digest, want.version, current)


def test_the_slots_conform_to_the_pure_model() -> None:
    run_state_machine_as_test(
        SlotMachine, settings=settings(max_examples=300, stateful_step_count=30, deadline=None)
    )


def test_the_machine_catches_a_slot_table_that_forgets_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    from weightsync.lora import _slots

    broken = tuple(
        _slots.Row("begin_load", "absent", "loading") if row.condition == "room" else row
        for row in _slots.RESIDENCY_TABLE
    )
    monkeypatch.setattr(_slots, "RESIDENCY_TABLE", broken)
    _slots._index.cache_clear()
    try:
        with pytest.raises(AssertionError, match="adapter_slots_full"):
            run_state_machine_as_test(
                SlotMachine,
                settings=settings(
                    max_examples=300, stateful_step_count=30, deadline=None, phases=(Phase.generate,)
                ),
            )
    finally:
        _slots._index.cache_clear()


def test_reads_see_a_load_under_way_and_a_failed_one_leaves_the_slot_as_it_was() -> None:
    async def main() -> None:
        gate = asyncio.Event()

        class Slow(FakeAdapters):
            async def prepare_adapter(self, path: str) -> FakePrepared:
                await gate.wait()
                return await super().prepare_adapter(path)

        engine = Slow()
        slots = AdapterSlots(engine, 1)
        gate.set()
        await slots.load(LoadAdapter("a", "v:1:one"))
        gate.clear()
        replacing = asyncio.ensure_future(slots.load(LoadAdapter("a", "bad", replace=True)))
        await asyncio.sleep(0.01)
        assert slots.table.slot("a").residency == "replacing" and slots.serving("a")
        assert engine.served["a"][1] == Declared("one")  # the old version is still served
        gate.set()
        with pytest.raises(InvalidRequest):
            await replacing
        slot = slots.table.slot("a")
        assert (slot.residency, slot.version, slot.digest, slot.loads) == (
            "resident",
            Declared("one"),
            "d1",
            1,
        )
        first = asyncio.ensure_future(slots.load(LoadAdapter("b", "ok:2")))  # the one slot is taken
        with pytest.raises(WeightSyncError) as err:
            await first
        assert err.value.code == "adapter_slots_full" and err.value.http_status == 409

    asyncio.run(main())
