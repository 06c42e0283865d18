"""LoRA adapters from disk, in PEFT's layout, verified: :func:`read_adapter`.

An adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` (PEFT's
``save_pretrained``), and weightsync's manifest when its trainer side wrote it
(:func:`weightsync.trainer.save_adapter`).  It is read by the disk channel's own reader (path
policy, non-blocking opens of regular files only, checked safetensors headers, the manifest's
file and tensor checksums: :class:`~weightsync.transports.disk.checks.DiskCheckpoint`), then:

1. the config is parsed strictly (:class:`~weightsync.lora.config.AdapterConfig`);
2. the headers are checked against the config and the model's modules
   (:func:`~.checks.check_tensors`) before a byte of a matrix is read;
3. every byte is read once against the checksums, then copied, each tensor checked against
   the hash that pass found; every value must be finite;
4. the adapter's digest (:mod:`weightsync.lora.digest`) must equal the manifest's, when the
   manifest records one.

Nothing is written anywhere and nothing is unpickled (a directory holding only PEFT's pickled
``adapter_model.bin`` is refused).  Every failure, whatever its exception type, is a 4xx
family error.  The matrices are returned raw: the scale ``lora_alpha / r`` is the config's,
applied by whoever computes with them, once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import attrs
import torch

from weightsync.core.errors import InvalidRequest, NotFound
from weightsync.lora.config import AdapterConfig, bad_config
from weightsync.lora.digest import adapter_digest
from weightsync.transports.adapters.checks import ModuleShapes, check_tensors
from weightsync.transports.disk.checks import DiskCheckpoint
from weightsync.transports.disk.format import read_json_file
from weightsync.transports.disk.manifest import INDEX_NAME, MANIFEST_NAME, MAX_JSON_FILE, bad_manifest
from weightsync.transports.disk.paths import member, present, resolve_path, resolved_roots
from weightsync.transports.failures import refusal
from weightsync.transports.sink import PullTarget, pull

CONFIG_NAME: Final = "adapter_config.json"
WEIGHTS_NAME: Final = "adapter_model.safetensors"
PICKLED_NAME: Final = "adapter_model.bin"
MAX_CONFIG_BYTES: Final = 1 << 20

_NO_VERSION: Final = object()


@attrs.frozen(eq=False)
class Adapter:
    """A verified adapter: its config, its raw matrices by module (``(A, B)``, as the file
    holds them), every tensor's xxh3-64 by PEFT name, its digest, and the version its manifest
    names (:attr:`has_version` says whether it names one)."""

    path: str
    config: AdapterConfig
    matrices: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    hashes: Mapping[str, str]
    digest: str
    manifest_version: Any = _NO_VERSION

    @property
    def has_version(self) -> bool:
        return self.manifest_version is not _NO_VERSION

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.matrices.values() for t in pair)


def not_an_adapter(path: str, why: str) -> InvalidRequest:
    return InvalidRequest(
        f"{path[:200]!r} is not a LoRA adapter directory ({CONFIG_NAME} and {WEIGHTS_NAME}): {why}",
        code="not_an_adapter",
    )


def _open(path: str, roots: Sequence[Path] | None, field: str) -> DiskCheckpoint:
    directory = resolve_path(path, roots, field=field)
    if not directory.is_dir():
        raise not_an_adapter(path, "it is not a directory")
    if not present(directory, WEIGHTS_NAME):
        if present(directory, PICKLED_NAME):
            raise InvalidRequest(
                f"{path[:200]!r} holds {PICKLED_NAME} (pickled): adapters are loaded from safetensors only; "
                f"save it with safe_serialization=True",
                code="unsafe_adapter_format",
            )
        raise not_an_adapter(path, f"it has no {WEIGHTS_NAME}")
    if present(directory, INDEX_NAME):
        raise not_an_adapter(path, f"it holds {INDEX_NAME}, a model checkpoint's index")
    ckpt = DiskCheckpoint.open(path, roots)
    names = [shard.name for shard in ckpt.shards]
    if names != [WEIGHTS_NAME]:
        raise not_an_adapter(path, f"it holds {names[:5]}; an adapter is one {WEIGHTS_NAME}")
    return ckpt


def _config(ckpt: DiskCheckpoint, roots: Sequence[Path] | None) -> AdapterConfig:
    missing = NotFound(f"the adapter has no {CONFIG_NAME}", code="missing_adapter_config")
    where = member(ckpt.root, CONFIG_NAME, roots, missing)
    return AdapterConfig.from_json(read_json_file(where, MAX_CONFIG_BYTES, bad_config))


def _recorded_digest(ckpt: DiskCheckpoint, roots: Sequence[Path] | None) -> str | None:
    """The adapter digest the manifest records (``None``: no manifest, or none recorded)."""
    if ckpt.manifest is None:
        return None
    where = member(ckpt.root, MANIFEST_NAME, roots, bad_manifest("it does not resolve to a file"))
    adapter = read_json_file(where, MAX_JSON_FILE, bad_manifest).get("adapter")
    if adapter is None:
        return None
    if not isinstance(adapter, dict) or not isinstance(adapter.get("digest"), str):
        raise bad_manifest("adapter is not an object with a digest")
    digest: str = adapter["digest"]
    return digest


def _finite(name: str, tensor: torch.Tensor) -> None:
    if not bool(torch.isfinite(tensor).all()):
        raise InvalidRequest(f"{name!r} holds NaN or infinite values", code="non_finite_adapter", tensor=name)


def read_adapter(
    path: str,
    modules: ModuleShapes,
    allowed_roots: Sequence[str | Path] | None = None,
    *,
    field: str = "lora_path",
) -> Adapter:
    """The verified adapter at ``path`` (the request's ``field``) for a model whose linear
    modules are ``modules``; ``allowed_roots`` as for a checkpoint (``None``: anywhere).

    Raises 4xx family errors only, nothing having been written: ``NotFound``
    (``path_not_found``, ``missing_adapter_config``, ``missing_shard``) or ``InvalidRequest``
    (``not_an_adapter``, ``unsafe_adapter_format``, ``path_not_allowed``, ``corrupt_checkpoint``,
    ``manifest_mismatch``, ``read_failed``, the config's codes of
    :meth:`AdapterConfig.from_json <weightsync.lora.config.AdapterConfig.from_json>`, the
    tensors' of :func:`~.checks.check_tensors`, ``non_finite_adapter``)."""
    try:
        return _read(path, modules, allowed_roots, field)
    except Exception as exc:
        mapped = refusal(exc, "adapter", code="not_an_adapter", read_code="read_failed")
        mapped.details.setdefault("field", field)  # every refusal here is of the adapter at that path
        if mapped is exc:
            raise
        raise mapped from exc


def _read(
    path: str, modules: ModuleShapes, allowed_roots: Sequence[str | Path] | None, field: str
) -> Adapter:
    roots = resolved_roots(allowed_roots)
    ckpt = _open(path, roots, field)
    config = _config(ckpt, roots)
    layout = check_tensors((e.spec for e in ckpt.entries), config, modules)
    recorded = _recorded_digest(ckpt, roots)
    hashes = ckpt.verify_checksums()
    digest = adapter_digest(hashes, config)
    if recorded is not None and recorded != digest:
        raise InvalidRequest(
            f"the adapter's digest {digest} is not the one its manifest records ({recorded[:64]}): its "
            f"{CONFIG_NAME} or its matrices changed after it was written",
            code="manifest_mismatch",
        )
    target = PullTarget()
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in pull(ckpt.copy_into(target, expected=hashes), target):
        _finite(name, tensor)
        tensors[name] = tensor
    matrices = {m: (tensors[names["A"]], tensors[names["B"]]) for m, names in layout.items()}
    named = ckpt.manifest is not None and ckpt.manifest.version is not None  # null names none
    version = ckpt.manifest.version if named and ckpt.manifest is not None else _NO_VERSION
    return Adapter(path, config, matrices, hashes, digest, version)
