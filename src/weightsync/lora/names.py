"""PEFT's tensor names for a LoRA adapter: ``base_model.model.<module path>.lora_A.weight``
(A, ``[r, in_features]``) and ``… .lora_B.weight`` (B, ``[out_features, r]``), where the module
path is the base model's own (``model.layers.0.self_attn.q_proj``)."""

from __future__ import annotations

from typing import Final

PREFIX: Final = "base_model.model."
MATRICES: Final = {"lora_A": "A", "lora_B": "B"}


def tensor_name(module: str, matrix: str) -> str:
    """The PEFT name of ``module``'s ``matrix`` (``"A"`` or ``"B"``)."""
    return f"{PREFIX}{module}.lora_{matrix}.weight"


def parse_name(name: str) -> tuple[str, str] | None:
    """``(module path, "A" | "B")`` for a PEFT LoRA tensor name, ``None`` for any other name
    (a bias, a DoRA magnitude, an embedding adapter, a name with the adapter's name left in)."""
    if not name.startswith(PREFIX) or not name.endswith(".weight"):
        return None
    module, _, kind = name[len(PREFIX) : -len(".weight")].rpartition(".")
    if not module or kind not in MATRICES or any(not part for part in module.split(".")):
        return None
    return module, MATRICES[kind]
