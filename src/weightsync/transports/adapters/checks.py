"""An adapter's tensors checked against its config and the model, from the headers alone.

Before a byte of a matrix is read, every tensor of ``adapter_model.safetensors`` must be a PEFT
LoRA matrix (:mod:`weightsync.lora.names`) of a module the model has and the config targets,
each module must have both matrices, and their shapes must be what ``r`` and the module say:
A ``[r, in_features]``, B ``[out_features, r]``.  Each refusal is a 400 with its own code.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final

from weightsync.core.errors import InvalidRequest
from weightsync.core.snapshot import TensorSpec
from weightsync.lora.config import AdapterConfig
from weightsync.lora.names import parse_name

FLOATS: Final = frozenset({"float32", "float16", "bfloat16", "float64"})
"""The dtypes an adapter's matrices may have (the engine casts them to its own)."""

ModuleShapes = Mapping[str, tuple[int, int]]
"""A model's linear modules an adapter may target: path -> ``(in_features, out_features)``."""


def _refuse(code: str, message: str, **details: object) -> InvalidRequest:
    return InvalidRequest(message, code=code, **details)


def check_tensors(
    specs: Iterable[TensorSpec], config: AdapterConfig, modules: ModuleShapes
) -> dict[str, dict[str, str]]:
    """The adapter's modules: path -> ``{"A": name, "B": name}`` (PEFT names), once every check
    of the module docstring passed.

    Raises ``InvalidRequest``: ``empty_adapter`` (no tensors), ``unknown_adapter_tensor`` (a
    name that is no LoRA matrix), ``unknown_module`` (a module the model does not have),
    ``untargeted_module`` (one the config's ``target_modules`` does not name),
    ``bad_adapter_dtype``, ``adapter_shape_mismatch``, ``incomplete_adapter`` (a module with
    one matrix)."""
    found: dict[str, dict[str, str]] = {}
    for spec in specs:
        parsed = parse_name(spec.name)
        if parsed is None:
            raise _refuse(
                "unknown_adapter_tensor",
                f"{spec.name[:200]!r} is not a LoRA matrix (base_model.model.<module>.lora_A.weight or "
                "lora_B.weight); biases, DoRA magnitudes and embedding adapters are not applied here",
                tensor=spec.name[:200],
            )
        module, matrix = parsed
        if module not in modules:
            raise _refuse(
                "unknown_module",
                f"{spec.name[:200]!r} adapts {module[:200]!r}, which is not a linear module of this model",
                tensor=spec.name[:200],
            )
        if not config.targets(module):
            raise _refuse(
                "untargeted_module",
                f"{spec.name[:200]!r} adapts {module!r}, which target_modules {list(config.target_modules)} "
                "does not name",
                tensor=spec.name[:200],
            )
        if spec.dtype not in FLOATS:
            raise _refuse(
                "bad_adapter_dtype",
                f"{spec.name!r} is {spec.dtype}; a LoRA matrix is one of {sorted(FLOATS)}",
                tensor=spec.name,
            )
        in_features, out_features = modules[module]
        want = (config.r, in_features) if matrix == "A" else (out_features, config.r)
        if tuple(spec.shape) != want:
            raise _refuse(
                "adapter_shape_mismatch",
                f"{spec.name!r} has shape {list(spec.shape)}; with r={config.r} and {module} "
                f"({in_features} in, {out_features} out) lora_{matrix} must be {list(want)}",
                tensor=spec.name,
            )
        found.setdefault(module, {})[matrix] = spec.name
    if not found:
        raise _refuse("empty_adapter", "the adapter holds no tensors: it would change nothing")
    for module, matrices in found.items():
        if len(matrices) != 2:
            missing = "B" if "A" in matrices else "A"
            raise _refuse("incomplete_adapter", f"{module} has no lora_{missing} matrix", module=module)
    return found
