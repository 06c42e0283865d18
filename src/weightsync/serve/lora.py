"""LoRA adapters at the worker's front door: the slots a worker serves (``serve --max-loras``),
which adapter a generation request's ``model`` names, and how ``/v1/models`` lists them.

With ``--max-loras 0`` (the default) a worker serves no adapters and a request's ``model`` is
metadata, as it always was.  With ``--max-loras N`` it serves up to ``N`` adapters beside its
base, and ``model`` chooses: absent, or the base's name, is the base; the name of an adapter
served now is that adapter; any other name is refused (``404 model_not_found``), never served
by the base, since a request meant for an adapter answered by the base is exactly the silent
staleness the slots exist to prevent.  TRL's ``<lora>-v<version>`` names are names like any.
"""

from __future__ import annotations

from typing import Any

from weightsync.core.errors import InvalidRequest, NotFound
from weightsync.lora.commands import AdapterSlots
from weightsync.lora.engine import ServesAdapters


def adapter_slots(engine: Any, max_loras: int) -> AdapterSlots | None:
    """The slots of a worker on ``engine`` with ``max_loras`` of them (``None`` for 0: LoRA is
    off).  Raises ``InvalidRequest`` (``invalid_value``) for a negative count or an engine that
    serves no adapters."""
    if max_loras < 0:
        raise InvalidRequest("--max-loras must be 0 (no adapters) or a count of slots", code="invalid_value")
    if max_loras == 0:
        return None
    if not isinstance(engine, ServesAdapters):
        raise InvalidRequest(
            f"--max-loras: engine {engine.name!r} serves no LoRA adapters here (the reference engine does)",
            code="invalid_value",
        )
    return AdapterSlots(engine.adapters, max_loras, reserved=(engine.name,))


class ModelSelection:
    """Which adapter a generation request's ``model`` names, on a worker whose base answers to
    ``base`` (see the module docstring)."""

    def __init__(self, base: str, slots: AdapterSlots | None) -> None:
        self.base = base
        self.slots = slots

    def adapter(self, model: str | None) -> str | None:
        """The adapter ``model`` names (``None``: the base).  Raises ``NotFound``
        (``model_not_found``) for a name that is neither the base's nor an adapter's."""
        if self.slots is None or model is None or model == self.base:
            return None
        if self.slots.serving(model):
            return model
        loaded = sorted(self.slots.table.slots)
        raise NotFound(
            f"The model `{model[:200]}` does not exist: this worker serves `{self.base}` and the adapters "
            f"{loaded[:20]}",
            code="model_not_found",
            field="model",
        )

    def cards(self, created: int) -> list[dict[str, Any]]:
        """``/v1/models``' entries for the adapters, as vLLM lists them (``id`` the adapter's
        name, ``root`` where it was read from, ``parent`` the base), each with its slot."""
        if self.slots is None:
            return []
        out = []
        for slot in self.slots.table.slots.values():
            if not slot.served:
                continue
            root = slot.facts.path if slot.facts is not None else None
            card = {"id": slot.name, "object": "model", "created": created, "owned_by": "weightsync"}
            out.append({**card, "root": root, "parent": self.base, "lora": slot.to_reply()})
        return out
