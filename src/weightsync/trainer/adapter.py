"""The trainer's side of LoRA adapters: :func:`save_adapter` writes one in PEFT's layout with
weightsync's manifest, and :func:`adapter_digest` is the digest a worker holding it reports.

::

    from weightsync.trainer import adapter_digest, save_adapter

    tensors = get_peft_model_state_dict(model)  # base_model.model.<module>.lora_A.weight, ...
    save_adapter(tensors, {"r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj"]},
                 "/ckpt/lora-7", version=7)
    expected = adapter_digest(tensors, {"r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj"]})

A directory written here is what PEFT's ``save_pretrained(safe_serialization=True)`` writes
(``adapter_config.json``, ``adapter_model.safetensors``), plus ``weightsync-manifest.json``: the
version, the file's size and checksum, every tensor's xxh3-64 and the adapter's digest, which a
worker checks before it serves a byte.  It appears at once or not at all, as a checkpoint does
(:func:`~weightsync.trainer.checkpoint.published`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from weightsync.core.errors import InvalidRequest
from weightsync.core.snapshot import TensorSpec
from weightsync.lora.config import AdapterConfig
from weightsync.lora.digest import adapter_digest as _combine
from weightsync.lora.names import parse_name
from weightsync.trainer.checkpoint import _empty_dir, _fsync, published
from weightsync.transports.adapters.checks import check_tensors
from weightsync.transports.disk.checks import file_checksum
from weightsync.transports.disk.manifest import MANIFEST_FORMAT, MANIFEST_NAME
from weightsync.transports.hashing import tensor_hashes
from weightsync.transports.sink import dtype_name

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"

Tensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def _checked(
    tensors: Tensors, config: AdapterConfig | dict[str, Any]
) -> tuple[dict[str, torch.Tensor], AdapterConfig]:
    """The tensors (contiguous, on the CPU) and the config, checked as a worker checks them
    against a model whose modules have the shapes the matrices imply.  Raises ``InvalidRequest``
    with the worker's codes (see :func:`~weightsync.transports.adapters.checks.check_tensors`),
    ``non_finite_adapter``, and the config's codes."""
    parsed = AdapterConfig.of(config)
    items = dict(tensors.items() if isinstance(tensors, Mapping) else tensors)
    implied: dict[str, list[int]] = {}  # module -> [in_features, out_features], as its matrices say
    for name, t in items.items():
        where = parse_name(name)
        if where is not None and t.dim() == 2:
            module, matrix = where
            dims = implied.setdefault(module, [0, 0])
            if matrix == "A":
                dims[0] = int(t.shape[1])
            else:
                dims[1] = int(t.shape[0])
    specs = [TensorSpec(name, dtype_name(t.dtype), tuple(t.shape)) for name, t in items.items()]
    check_tensors(specs, parsed, {m: (d[0], d[1]) for m, d in implied.items()})
    out = {}
    for name, t in items.items():
        cpu = t.detach().contiguous().cpu()
        if not bool(torch.isfinite(cpu).all()):
            raise InvalidRequest(f"{name!r} holds NaN or infinite values", code="non_finite_adapter")
        out[name] = cpu
    return out, parsed


def adapter_digest(tensors: Tensors, config: AdapterConfig | dict[str, Any]) -> str:
    """The digest a worker reports for the adapter of ``tensors`` (PEFT names) under ``config``
    (an :class:`~weightsync.lora.config.AdapterConfig` or PEFT's ``adapter_config.json`` as a
    dict): every matrix's bytes and the fields that change the math.  Raises ``InvalidRequest``
    as :func:`save_adapter` does for an adapter a worker would refuse."""
    checked, parsed = _checked(tensors, config)
    return _combine(tensor_hashes(checked.items()), parsed)


def save_adapter(
    tensors: Tensors,
    config: AdapterConfig | dict[str, Any],
    directory: str | os.PathLike[str],
    *,
    version: Any = None,
    overwrite: bool = False,
) -> Path:
    """Write the adapter ``tensors`` (PEFT names, as ``get_peft_model_state_dict`` returns them)
    with ``config`` to ``directory`` atomically, in PEFT's layout with weightsync's manifest
    naming ``version``; return its path.

    Raises ``InvalidRequest`` before writing anything for an adapter a worker would refuse
    (see :func:`adapter_digest`), ``FileExistsError`` when ``directory`` exists, is not an empty
    directory and ``overwrite`` is false (with it, the old directory is swapped out, then
    deleted)."""
    checked, parsed = _checked(tensors, config)
    final = Path(directory).absolute()
    if final.exists() and not overwrite and not _empty_dir(final):
        raise FileExistsError(f"{final} exists (pass overwrite=True to replace it)")
    with published(final) as tmp:
        mode = tmp.stat().st_mode & 0o644  # as the checkpoint writer: the umask mkdir applied
        weights = tmp / WEIGHTS_NAME
        save_file(checked, str(weights))
        os.chmod(weights, mode)
        hashes = tensor_hashes(checked.items())
        manifest = {
            "format": MANIFEST_FORMAT,
            "version": version,
            "created": time.time(),
            "files": {WEIGHTS_NAME: {"size": weights.stat().st_size, "xxh3_128": file_checksum(weights)}},
            "tensors": hashes,
            "adapter": {"digest": _combine(hashes, parsed), "config": json.loads(parsed.canonical())},
        }
        for name, obj in ((CONFIG_NAME, parsed.to_json()), (MANIFEST_NAME, manifest)):
            (tmp / name).write_text(json.dumps(obj, indent=1))
        for name in (WEIGHTS_NAME, CONFIG_NAME, MANIFEST_NAME):
            _fsync(tmp / name)
    return final
