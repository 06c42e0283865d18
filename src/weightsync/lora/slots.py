"""The adapter slots as one frozen value, and the pure steps that move them.

:class:`SlotTable` holds every slot a worker has (:class:`Slot`: residency, version, digest,
what the adapter is) and the cap on them (``serve --max-loras``).  Each step takes a command's
inputs and returns the next table, or raises the refusal of
:data:`~weightsync.lora._slots.REFUSALS` and leaves nothing changed (the value is frozen): the
choreography of :class:`~weightsync.lora._slots.LoadSteps` and
:class:`~weightsync.lora._slots.UnloadSteps`, beside the tables that decide its legality.  The
commands (:mod:`weightsync.lora.commands`) compute a step before calling the engine and
commit what it returned.

A load's version is the one the request names, else the one the adapter's manifest names
(:func:`load_version`); a request naming another than the manifest's is refused (``409
version_mismatch``): a label is a claim about the bytes, the manifest the trainer's own word.
A load that names none keeps the slot's label, which then no longer describes the bytes held
(``version_current: false``) unless they are the very ones it was declared for, as the base's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

import attrs

from weightsync.core.errors import IllegalState
from weightsync.core.snapshot import UNDECLARED, Declared, Version
from weightsync.lora._slots import REFUSED, SUCCEEDED, LoadSteps, UnloadSteps, moved_all


@attrs.frozen
class AdapterFacts:
    """What a loaded adapter is: where it was read from, its rank, ``lora_alpha``, target
    modules, and its matrices' bytes."""

    path: str
    rank: int
    lora_alpha: float
    target_modules: tuple[str, ...]
    nbytes: int

    def to_reply(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "r": self.rank,
            "lora_alpha": self.lora_alpha,
            "target_modules": list(self.target_modules),
            "bytes": self.nbytes,
        }


@attrs.frozen
class Slot:
    """One adapter name: its residency, its version (``UNDECLARED`` or ``Declared``), the digest
    of the adapter held (``None`` before the first load succeeded), the digest held when the
    label was declared, what the adapter is, and how many loads succeeded under the name."""

    name: str
    residency: str = "absent"
    version: Version = UNDECLARED
    digest: str | None = None
    label_digest: str | None = None
    facts: AdapterFacts | None = None
    loads: int = 0

    @property
    def states(self) -> dict[str, str]:
        return {"residency": self.residency, "version": _version_state(self.version)}

    @property
    def version_current(self) -> bool:
        """Whether the label was declared for the very adapter held."""
        return (
            isinstance(self.version, Declared)
            and self.digest is not None
            and self.label_digest == self.digest
        )

    @property
    def served(self) -> bool:
        """Whether requests naming it are served (a version is held: resident, or replacing)."""
        return self.residency in ("resident", "replacing")

    def to_reply(self) -> dict[str, Any]:
        """The slot as replies report it."""
        declared = isinstance(self.version, Declared)
        return {
            "name": self.name,
            "residency": self.residency,
            "version": self.version.value if isinstance(self.version, Declared) else None,
            "version_declared": declared,
            "version_current": self.version_current,
            "digest": self.digest,
            "loads": self.loads,
            **({"adapter": self.facts.to_reply()} if self.facts is not None else {}),
        }


def _version_state(version: Version) -> str:
    return "declared" if isinstance(version, Declared) else "undeclared"


def load_version(given: Declared | None, manifest_version: Any, has_version: bool) -> Declared | None:
    """The version a load declares: ``given``, else the manifest's (when it names one), else
    none.  Raises ``IllegalState`` (``version_mismatch``) when both name one and they differ."""

    def text(value: Any) -> str:
        return json.dumps(value, sort_keys=True)

    if given is not None and has_version and text(given.value) != text(manifest_version):
        raise IllegalState(
            f"the load names version {text(given.value)[:80]} but the adapter's manifest says "
            f"{text(manifest_version)[:80]}: name the manifest's version, or none",
            code="version_mismatch",
            field="weight_version",
        )
    if given is not None:
        return given
    return Declared(manifest_version) if has_version else None


_EMPTY: Final[Mapping[str, Slot]] = {}


@attrs.frozen
class SlotTable:
    """Every slot of a worker (absent ones are not kept) and ``capacity``, the most that may be
    loaded at once (``serve --max-loras``)."""

    capacity: int
    slots: Mapping[str, Slot] = _EMPTY

    def slot(self, name: str) -> Slot:
        """The slot ``name`` (an ``absent`` one when nothing is under it)."""
        return self.slots.get(name) or Slot(name)

    @property
    def taken(self) -> int:
        return len(self.slots)

    def serving(self, name: str) -> bool:
        """Whether a request naming ``name`` is served by an adapter."""
        slot = self.slots.get(name)
        return slot is not None and slot.served

    def _with(self, slot: Slot) -> SlotTable:
        rest = {n: s for n, s in self.slots.items() if n != slot.name}
        return SlotTable(self.capacity, rest if slot.residency == "absent" else {**rest, slot.name: slot})

    def _moved(self, name: str, triggers: tuple[str, ...]) -> Slot:
        slot = self.slot(name)
        states = moved_all(triggers, slot.states, name, {"room": self.taken < self.capacity})
        return attrs.evolve(slot, residency=states["residency"])

    # ------------------------------------------------------------------ steps

    def load_begun(self, name: str) -> SlotTable:
        """When a load of ``name`` may start.  Raises ``IllegalState``: ``adapter_slots_full``
        (a first load with every slot taken), ``adapter_busy``."""
        return self._with(self._moved(name, LoadSteps.begin))

    def load_ended(
        self,
        name: str,
        ending: str,
        *,
        version: Declared | None = None,
        digest: str | None = None,
        facts: AdapterFacts | None = None,
    ) -> SlotTable:
        """After the load of ``name`` (begun on this table) ended with ``ending``: on
        ``succeeded`` the slot holds the adapter of ``digest`` and ``facts``, labelled
        ``version`` when given (else its label stays); on ``refused`` it is as it was."""
        slot = self.slot(name)
        states = moved_all(LoadSteps.ending(ending, version is not None), slot.states, name)
        if ending == REFUSED:
            return self._with(attrs.evolve(slot, residency=states["residency"]))
        assert ending == SUCCEEDED
        label_version, label_digest = (
            (version, digest) if version is not None else (slot.version, slot.label_digest)
        )
        loaded = Slot(name, states["residency"], label_version, digest, label_digest, facts, slot.loads + 1)
        return self._with(loaded)

    def evict_begun(self, name: str) -> SlotTable:
        """When an unload of ``name`` may start.  Raises ``NotFound`` (``adapter_not_found``),
        ``IllegalState`` (``adapter_busy``)."""
        return self._with(self._moved(name, UnloadSteps.begin))

    def evicted(self, name: str) -> SlotTable:
        """After the engine stopped serving ``name``: the slot is forgotten."""
        return self._with(self._moved(name, UnloadSteps.done))

    def evict_refused(self, name: str) -> SlotTable:
        """After the engine failed to stop serving ``name``: still resident, unchanged."""
        return self._with(self._moved(name, UnloadSteps.refused))

    def to_reply(self) -> dict[str, Any]:
        """The table as replies report it: the cap, and every slot by name."""
        return {
            "max_loras": self.capacity,
            "adapters": [self.slots[n].to_reply() for n in sorted(self.slots)],
        }
