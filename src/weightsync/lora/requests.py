"""Adapter commands as typed, frozen requests, parsed from untrusted JSON at the edge.

The bodies are vLLM's (``/v1/load_lora_adapter``: ``lora_name``, ``lora_path``,
``load_inplace``; ``/v1/unload_lora_adapter``: ``lora_name``, ``lora_int_id``) plus weightsync's
``weight_version`` on a load (any JSON value: the adapter's version).  Unknown fields are
refused, types are strict, as for every request (:mod:`weightsync.core.validation`).
"""

from __future__ import annotations

from typing import Any, Final

import attrs

from weightsync.core.errors import InvalidRequest, NotSupported
from weightsync.core.snapshot import Declared
from weightsync.core.validation import Body, boolean, declared, integer, string

MAX_NAME: Final = 256


def adapter_name(field: str, value: Any) -> str:
    """A slot's name: 1 to :data:`MAX_NAME` characters, none of them a control character or a
    space (TRL's ``<lora>-v<version>``, Hugging Face's ``org/name`` are names)."""
    text = string(field, value)
    if len(text) > MAX_NAME or any(c.isspace() or not c.isprintable() for c in text):
        raise InvalidRequest(
            f"{field} must be 1 to {MAX_NAME} printable characters without spaces",
            code="invalid_value",
            field=field,
        )
    return text


@attrs.frozen
class LoadAdapter:
    """Load the adapter at ``path`` under ``name`` (``replace``: a name already loaded is loaded
    again, vLLM's ``load_inplace``), labelled ``version`` (``None``: the manifest's, if any)."""

    name: str
    path: str
    version: Declared | None = None
    replace: bool = False

    @classmethod
    def from_vllm(cls, body: Any) -> LoadAdapter:
        """vLLM's body.  Raises ``InvalidRequest``; ``NotSupported`` for ``is_3d_lora_weight``."""
        b = Body(body, ("lora_name", "lora_path", "load_inplace", "is_3d_lora_weight", "weight_version"))
        name = b.get("lora_name", adapter_name)
        path = b.get("lora_path", string)
        if b.get("is_3d_lora_weight", boolean, False):
            raise NotSupported("3D (fused MoE) LoRA weights are not served here", field="is_3d_lora_weight")
        version = b.get("weight_version", declared, None)
        return cls(name, path, version, b.get("load_inplace", boolean, False))


@attrs.frozen
class UnloadAdapter:
    """Unload the adapter loaded under ``name``."""

    name: str

    @classmethod
    def from_vllm(cls, body: Any) -> UnloadAdapter:
        """vLLM's body (``lora_int_id`` is accepted and unused: names are unique here)."""
        b = Body(body, ("lora_name", "lora_int_id"))
        b.get("lora_int_id", lambda f, v: v if v is None else integer(f, v), None)
        return cls(b.get("lora_name", adapter_name))
