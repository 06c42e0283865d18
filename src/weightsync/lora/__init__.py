"""weightsync.lora: LoRA adapters as versioned, verified, atomic slots, in pure Python.

* :mod:`.config` — an ``adapter_config.json`` read strictly: the fields that change the math;
* :mod:`.names` — PEFT's tensor names for the A/B matrices;
* :mod:`.digest` — an adapter's digest (matrices and math config), the same on both sides;
* :mod:`._slots` — one slot's legal moves, as data (residency × version);
* :mod:`.slots` — every slot of a worker as one frozen value, and the pure steps that move it;
* :mod:`.commands` — :class:`~.commands.AdapterSlots`, the slots' commands over an engine;
* :mod:`.engine` — what the slots need of an engine; :mod:`.requests` — the commands' bodies;
* :mod:`.diagram` — the slot machine drawn for ``docs/state-machine.md``.

Imports nothing of weightsync but :mod:`weightsync.core`, and nothing heavy: the reading of
adapters from disk is a weight channel (:mod:`weightsync.transports.adapters`), their math the
engines' (:mod:`weightsync.engines.reference.lora_batch`).
"""
