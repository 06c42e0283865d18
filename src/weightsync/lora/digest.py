"""The digest of a LoRA adapter: what a worker holding it reports, and what the trainer that
wrote it computes (:func:`weightsync.trainer.adapter_digest`).

It covers every A/B matrix (each tensor's xxh3-64, by its PEFT name, as every weightsync
channel hashes a tensor) *and* the config fields that change the math (``r``, ``lora_alpha``,
``target_modules``, ``use_rslora``): two adapters with equal matrices but another ``lora_alpha``
compute different outputs, so they never share a digest.  The combination is the worker
digest's own (:func:`weightsync.core.held.weights_digest`), with the config as one more entry
under a name no tensor can have.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Final

from weightsync.core.held import weights_digest
from weightsync.lora.config import AdapterConfig

CONFIG_ENTRY: Final = "adapter_config.json"
"""The entry the config takes among the tensors' hashes (no PEFT tensor name ends in ``.json``)."""


def adapter_digest(hashes: Mapping[str, str], config: AdapterConfig) -> str:
    """The digest of an adapter whose tensors hash to ``hashes`` (PEFT name -> xxh3-64 hex)
    under ``config``.  Raises ``ValueError`` for a tensor named :data:`CONFIG_ENTRY`."""
    if CONFIG_ENTRY in hashes:
        raise ValueError(f"no tensor may be named {CONFIG_ENTRY!r}")
    config_hash = hashlib.blake2b(config.canonical().encode(), digest_size=16).hexdigest()
    return weights_digest({**hashes, CONFIG_ENTRY: config_hash})
