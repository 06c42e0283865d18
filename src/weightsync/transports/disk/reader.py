"""Validated, streaming loading of safetensors checkpoints (single file or sharded).

Everything that can be checked is checked before the first weight is written:

1. the path exists and resolves inside an allowed root (symlinks cannot escape);
2. the shard list (from ``model.safetensors.index.json`` or the directory) is complete,
   and every header parses and matches its file's length;
3. if our writer's manifest is present, every file's size and xxh3-128 checksum match;
4. names, shapes and dtypes match the engine's weights, and the checkpoint covers them all
   (unless ``allow_partial``; dtypes are cast only with ``allow_dtype_cast``).

Then shards are applied one at a time, memory-mapped, each tensor copied straight from the
mapping into the engine's weight: peak extra memory is bounded by one shard's mapping and
no anonymous copy of a whole shard is ever made.  A failure after the first write is
reported with ``wrote=True`` and the worker becomes torn.
"""

from __future__ import annotations

import json
import mmap
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final

import attrs
import torch
import xxhash

from weightsync.core.errors import InvalidRequest, LoadFailed, NotFound, WeightSyncError
from weightsync.core.requests import DiskSource
from weightsync.core.values import LoadStats

from ..sink import TensorSink, check_metadata, torch_dtype
from .format import ShardHeader, TensorEntry, corrupt

INDEX_NAME: Final = "model.safetensors.index.json"
MANIFEST_NAME: Final = "weightsync-manifest.json"
MANIFEST_FORMAT: Final = "weightsync/1"


def file_checksum(path: Path) -> str:
    """xxh3-128 of a file, hashed from a memory mapping (no buffer copies)."""
    h = xxhash.xxh3_128()
    with path.open("rb") as f:
        if f.seek(0, 2) == 0:
            return h.hexdigest()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            h.update(mapped)
    return h.hexdigest()


def resolve_path(model_path: str, allowed_roots: Sequence[Path] | None) -> Path:
    """Resolve ``model_path``; raise ``NotFound`` or ``InvalidRequest`` (``path_not_allowed``)."""
    path = Path(model_path)
    if not path.is_absolute():
        raise InvalidRequest(f"model_path must be absolute, got {model_path!r}", code="invalid_value")
    try:
        resolved = path.resolve(strict=True)
    except (FileNotFoundError, RuntimeError, OSError):
        raise NotFound(f"model_path {model_path!r} does not exist", code="path_not_found") from None
    if allowed_roots is not None:
        roots = [Path(r).resolve() for r in allowed_roots]
        if not any(resolved == r or resolved.is_relative_to(r) for r in roots):
            raise InvalidRequest(
                f"model_path {model_path!r} resolves to {str(resolved)!r}, outside the allowed weight "
                f"directories {[str(r) for r in roots]}",
                code="path_not_allowed",
            )
    return resolved


@attrs.frozen
class DiskCheckpoint:
    """A checkpoint whose files and headers have been checked (but not yet its tensors' fit)."""

    root: Path
    shards: tuple[ShardHeader, ...]
    manifest: dict[str, Any] | None

    @property
    def entries(self) -> Iterator[TensorEntry]:
        for shard in self.shards:
            yield from shard.tensors.values()

    @property
    def version(self) -> Any:
        return self.manifest.get("version") if self.manifest else None

    @classmethod
    def open(cls, model_path: str, allowed_roots: Sequence[Path] | None = None) -> DiskCheckpoint:
        """Find and check every file of the checkpoint at ``model_path``.

        Raises ``NotFound`` (``path_not_found``, ``no_safetensors``, ``missing_shard``) or
        ``InvalidRequest`` (``path_not_allowed``, ``corrupt_checkpoint``, ``bad_index``,
        ``manifest_mismatch``).
        """
        path = resolve_path(model_path, allowed_roots)
        root = path if path.is_dir() else path.parent
        manifest = None
        if path.is_file():
            if path.suffix != ".safetensors":
                raise InvalidRequest(f"{model_path!r} is not a .safetensors file", code="no_safetensors")
            files = [path]
        else:
            files = cls._shard_files(path)
            manifest = cls._read_manifest(path)
        headers = []
        for f in files:
            try:
                headers.append(ShardHeader.read(f))
            except FileNotFoundError:
                raise NotFound(f"shard {f.name} is missing", code="missing_shard") from None
        ckpt = cls(root, tuple(headers), manifest)
        ckpt._check_index(path)
        if manifest is not None:
            ckpt._check_manifest_sizes()
        return ckpt

    @staticmethod
    def _shard_files(directory: Path) -> list[Path]:
        index = directory / INDEX_NAME
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                names = sorted(set(weight_map.values()))
            except (ValueError, KeyError, TypeError, AttributeError):
                raise InvalidRequest(f"{INDEX_NAME} is not a valid index", code="bad_index") from None
            files = []
            for name in names:
                f = (directory / name).resolve()
                if f.parent != directory.resolve():
                    raise InvalidRequest(
                        f"index names a file outside the checkpoint: {name!r}", code="bad_index"
                    )
                if not f.is_file():
                    raise NotFound(f"shard {name} listed in {INDEX_NAME} is missing", code="missing_shard")
                files.append(f)
            return files
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise NotFound(f"no .safetensors files in {str(directory)!r}", code="no_safetensors")
        return files

    @staticmethod
    def _read_manifest(directory: Path) -> dict[str, Any] | None:
        f = directory / MANIFEST_NAME
        if not f.exists():
            return None
        try:
            manifest = json.loads(f.read_text())
            if manifest.get("format") != MANIFEST_FORMAT or not isinstance(manifest.get("files"), dict):
                raise ValueError
        except (ValueError, AttributeError):
            raise InvalidRequest(
                f"{MANIFEST_NAME} is not a weightsync manifest", code="manifest_mismatch"
            ) from None
        return manifest  # type: ignore[no-any-return]

    def _check_index(self, path: Path) -> None:
        index = path / INDEX_NAME if path.is_dir() else None
        if index is None or not index.exists():
            return
        weight_map = json.loads(index.read_text())["weight_map"]
        by_file = {s.path.name: s for s in self.shards}
        for name, fname in weight_map.items():
            if name not in by_file[Path(fname).name].tensors:
                raise InvalidRequest(f"index puts {name!r} in {fname}, which lacks it", code="bad_index")
        listed = set(weight_map)
        extra = [e.spec.name for e in self.entries if e.spec.name not in listed]
        if extra:
            raise InvalidRequest(f"tensors missing from the index: {extra[:5]}", code="bad_index")

    def _check_manifest_sizes(self) -> None:
        assert self.manifest is not None
        files = self.manifest["files"]
        for shard in self.shards:
            meta = files.get(shard.path.name)
            if meta is None or meta.get("size") != shard.size:
                raise InvalidRequest(
                    f"{shard.path.name}: size {shard.size} does not match the manifest",
                    code="manifest_mismatch",
                )

    def verify_checksums(self) -> None:
        """Check every shard against the manifest's xxh3-128 (files hashed in parallel)."""
        if self.manifest is None:
            return
        files = self.manifest["files"]
        with ThreadPoolExecutor(max_workers=min(4, len(self.shards))) as pool:
            sums = list(pool.map(lambda s: file_checksum(s.path), self.shards))
        for shard, digest in zip(self.shards, sums, strict=True):
            if files[shard.path.name].get("xxh3_128") != digest:
                raise InvalidRequest(
                    f"{shard.path.name}: checksum does not match the manifest", code="manifest_mismatch"
                )

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, tensor)`` shard by shard; each tensor is a view into a mapping that
        is closed before the next shard is opened."""
        for shard in self.shards:
            try:
                f = shard.path.open("rb")
            except FileNotFoundError:
                raise NotFound(
                    f"shard {shard.path.name} disappeared after validation", code="missing_shard"
                ) from None
            with f:
                if f.seek(0, 2) != shard.size:
                    raise corrupt(shard.path, "file changed size since it was validated")
                # Copy-on-write: writable for torch.frombuffer, yet never written, so no page is copied.
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            for entry in sorted(shard.tensors.values(), key=lambda e: e.start):
                dtype = torch_dtype(entry.spec.dtype)
                if entry.end == entry.start:
                    yield entry.spec.name, torch.empty(entry.spec.shape, dtype=dtype)
                    continue
                raw = torch.frombuffer(
                    mapped, dtype=torch.uint8, count=entry.end - entry.start, offset=entry.start
                )
                yield entry.spec.name, raw.view(dtype).reshape(entry.spec.shape)
            # The mapping is unmapped when the last view of it is dropped (closing it while
            # a consumer still holds a view would be an error).
            del mapped


def load_checkpoint(
    source: DiskSource, sink: TensorSink, allowed_roots: Sequence[Path] | None = None
) -> LoadStats:
    """Validate ``source`` against ``sink``'s specs, then stream it into ``sink``.

    Raises ``LoadFailed`` with ``wrote`` telling whether the failure came after the first
    write; its ``cause`` carries the precise error (code and status) of a clean refusal.
    """
    t0 = time.perf_counter()
    try:
        ckpt = DiskCheckpoint.open(source.model_path, allowed_roots)
        cast = check_metadata(
            (e.spec for e in ckpt.entries),
            sink.specs,
            allow_partial=source.allow_partial,
            allow_dtype_cast=source.allow_dtype_cast,
        )
        ckpt.verify_checksums()
    except WeightSyncError as exc:
        raise LoadFailed(exc.message, wrote=False, cause=exc) from exc
    except OSError as exc:
        raise LoadFailed(f"cannot read checkpoint: {exc}", wrote=False, code="read_failed") from exc
    validated = time.perf_counter()
    try:
        for name, tensor in ckpt.stream():
            sink.write(name, tensor)
    except Exception as exc:
        what = exc.message if isinstance(exc, WeightSyncError) else repr(exc)
        raise LoadFailed(
            f"reading the checkpoint failed after validation: {what}",
            wrote=sink.wrote,
            cause=exc if isinstance(exc, WeightSyncError) else None,
            code="read_failed",
        ) from exc
    done = time.perf_counter()
    extra: dict[str, Any] = {"validate_seconds": round(validated - t0, 6)}
    if cast:
        extra["dtype_cast"] = len(cast)
    if ckpt.manifest is not None:
        extra["manifest_version"] = ckpt.version
    return LoadStats(
        tensors=sink.tensors, bytes=sink.bytes, seconds=done - t0, files=len(ckpt.shards), extra=extra
    )
