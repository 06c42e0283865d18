"""Validated, streaming loading of safetensors checkpoints (single file or sharded).

Everything that can be checked is checked before the first weight is written:

1. the path, and every file opened under it (shards found by index or by directory
   listing, the index, the manifest), resolves inside an allowed root (symlinks cannot
   escape) and is a regular file, opened without blocking (a FIFO cannot wedge us);
2. the shard list (from ``model.safetensors.index.json`` or the directory) is complete,
   and every header parses and matches its file's length;
3. if our writer's manifest is present, every file's size and xxh3-128 checksum match,
   and so does every tensor's xxh3-64 when the manifest lists them (one read of each file);
4. names, shapes and dtypes match the engine's weights, and the checkpoint covers them all
   (unless ``allow_partial``; dtypes are cast only with ``allow_dtype_cast``).

Any failure there, whatever its exception type, is a refusal of the error family with a
4xx code: nothing was written.

Then shards are read sequentially with bounded ``readinto`` calls (never a memory mapping:
a file truncated underneath a mapping kills the process with SIGBUS, a short read is just
an error).  Tensors whose engine weight has the same dtype and layout are read straight
into it; others go through one reusable buffer.  Every tensor's bytes are hashed
(xxh3-64) as they arrive — the sink records these hashes — and compared with the
manifest's per-tensor hashes (or, for manifests without them, each file's xxh3-128 at the
end of the file), so a checkpoint rewritten between verification and copy is never
committed: the load fails with ``wrote=True`` and the worker becomes torn.
"""

from __future__ import annotations

import io
import os
import stat
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final

import attrs
import torch
import xxhash

from weightsync.core.errors import InvalidRequest, NotFound, WeightSyncError
from weightsync.core.requests import DiskSource
from weightsync.core.values import LoadStats, TensorSpec

from ..sink import PullTarget, Target, TensorSink, check_metadata, pull, torch_dtype
from .format import ShardHeader, TensorEntry, corrupt, open_regular, read_exactly, read_json_file

INDEX_NAME: Final = "model.safetensors.index.json"
MANIFEST_NAME: Final = "weightsync-manifest.json"
MANIFEST_FORMAT: Final = "weightsync/1"
MAX_JSON_FILE: Final = 64 << 20
CHUNK: Final = 1 << 20  # bytes per read: small enough to hash while still in cache


def _checksum(f: io.FileIO, buffer: bytearray) -> str:
    h = xxhash.xxh3_128()
    view = memoryview(buffer)
    while n := f.readinto(view):
        h.update(view[:n])
    return h.hexdigest()


def _checksum_tensors(f: io.FileIO, shard: ShardHeader, buffer: bytearray) -> tuple[str, dict[str, str]]:
    """The file's xxh3-128 and each tensor's xxh3-64, in one front-to-back read of ``f``
    (tensors lie back to back after the header: see :class:`ShardHeader`)."""
    whole = xxhash.xxh3_128()
    view = memoryview(buffer)
    hashes: dict[str, str] = {}

    def feed(nbytes: int, part_hash: Any | None) -> None:
        left = nbytes
        while left:
            n = f.readinto(view[: min(left, len(view))])
            if not n:
                raise corrupt(shard.path, "file shrank while it was read")
            whole.update(view[:n])
            if part_hash is not None:
                part_hash.update(view[:n])
            left -= n

    feed(shard.data_start, None)
    for entry in shard.tensors.values():  # file order
        h = xxhash.xxh3_64()
        feed(entry.nbytes, h)
        hashes[entry.spec.name] = h.hexdigest()
    while n := f.readinto(view):  # nothing, unless the file grew: the checksum then differs
        whole.update(view[:n])
    return whole.hexdigest(), hashes


def file_checksum(path: Path) -> str:
    """xxh3-128 of a regular file, read in bounded chunks (a shrinking file is no crash)."""
    with open_regular(path) as f:
        return _checksum(f, bytearray(CHUNK))


def _refusal(exc: BaseException) -> WeightSyncError:
    """The family error for an unexpected exception raised while validating (nothing written)."""
    if isinstance(exc, WeightSyncError):
        return exc
    if isinstance(exc, OSError):
        return InvalidRequest(f"cannot read the checkpoint: {exc}", code="read_failed")
    return InvalidRequest(
        f"checkpoint refused: {type(exc).__name__}: {str(exc)[:300]}", code="corrupt_checkpoint"
    )


def _within(resolved: Path, roots: Sequence[Path] | None) -> bool:
    return roots is None or any(resolved == r or resolved.is_relative_to(r) for r in roots)


def resolve_path(model_path: str, allowed_roots: Sequence[Path] | None) -> Path:
    """Resolve ``model_path``; raise ``NotFound`` or ``InvalidRequest`` (``path_not_allowed``,
    ``invalid_value``)."""
    try:
        path = Path(model_path)
        if not path.is_absolute():
            raise InvalidRequest(f"model_path must be absolute, got {model_path!r}", code="invalid_value")
        os.fsencode(path)  # a NUL byte or an unencodable character: refuse, not crash
        if "\0" in model_path:
            raise ValueError("embedded null byte")
    except (ValueError, TypeError):
        raise InvalidRequest(f"model_path {model_path!r} is not a valid path", code="invalid_value") from None
    try:
        resolved = path.resolve(strict=True)
    except (RuntimeError, OSError):
        raise NotFound(f"model_path {model_path!r} does not exist", code="path_not_found") from None
    roots = [Path(r).resolve() for r in allowed_roots] if allowed_roots is not None else None
    if not _within(resolved, roots):
        raise InvalidRequest(
            f"model_path {model_path!r} resolves to {str(resolved)!r}, outside the allowed weight "
            f"directories {[str(r) for r in roots or ()]}",
            code="path_not_allowed",
        )
    return resolved


def _member(directory: Path, name: str, roots: Sequence[Path] | None, missing: WeightSyncError) -> Path:
    """Resolve the file ``name`` of ``directory`` (which may be a symlink) against ``roots``."""
    try:
        resolved = (directory / name).resolve(strict=True)
    except (RuntimeError, OSError):
        raise missing from None
    if not _within(resolved, roots):
        raise InvalidRequest(
            f"{name} resolves to {str(resolved)!r}, outside the allowed weight directories",
            code="path_not_allowed",
        )
    return resolved


def _plain_name(name: Any) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\0" not in name


def _bad_index(why: str) -> InvalidRequest:
    return InvalidRequest(f"{INDEX_NAME} is not a valid index: {why}", code="bad_index")


def _bad_manifest(why: str) -> InvalidRequest:
    return InvalidRequest(f"{MANIFEST_NAME} is not a weightsync manifest: {why}", code="manifest_mismatch")


@attrs.define
class ReadMeter:
    """Time spent hashing while copying (the cost of the fused verification)."""

    hash_seconds: float = 0.0


@attrs.frozen
class DiskCheckpoint:
    """A checkpoint whose files and headers have been checked (but not yet its tensors' fit)."""

    root: Path
    shards: tuple[ShardHeader, ...]
    manifest: dict[str, Any] | None
    weight_map: dict[str, str] | None = None

    @property
    def entries(self) -> Iterator[TensorEntry]:
        for shard in self.shards:
            yield from shard.tensors.values()

    @property
    def version(self) -> Any:
        return self.manifest.get("version") if self.manifest else None

    @property
    def tensor_hashes(self) -> dict[str, str] | None:
        """The manifest's per-tensor xxh3-64 hashes (``None`` for older manifests)."""
        return self.manifest.get("tensors") if self.manifest else None

    @classmethod
    def open(cls, model_path: str, allowed_roots: Sequence[Path] | None = None) -> DiskCheckpoint:
        """Find and check every file of the checkpoint at ``model_path``.

        Raises ``NotFound`` (``path_not_found``, ``no_safetensors``, ``missing_shard``) or
        ``InvalidRequest`` (``path_not_allowed``, ``not_a_file``, ``corrupt_checkpoint``,
        ``bad_index``, ``manifest_mismatch``, ``invalid_value``, ``read_failed``) — nothing else.
        """
        try:
            return cls._open(model_path, allowed_roots)
        except Exception as exc:
            refusal = _refusal(exc)
            if refusal is exc:
                raise
            raise refusal from exc

    @classmethod
    def _open(cls, model_path: str, allowed_roots: Sequence[Path] | None) -> DiskCheckpoint:
        path = resolve_path(model_path, allowed_roots)
        roots = [Path(r).resolve() for r in allowed_roots] if allowed_roots is not None else None
        mode = path.stat().st_mode
        if stat.S_ISREG(mode):
            if ".safetensors" not in (path.suffix, Path(model_path).suffix):
                raise InvalidRequest(f"{model_path!r} is not a .safetensors file", code="no_safetensors")
            return cls(path.parent, (ShardHeader.read(path),), None)
        if not stat.S_ISDIR(mode):
            raise InvalidRequest(f"model_path {model_path!r} is not a file or directory", code="not_a_file")
        weight_map = cls._read_index(path, roots)
        if weight_map is not None:
            names = sorted(set(weight_map.values()))
        else:
            names = sorted(p.name for p in path.glob("*.safetensors"))
            if not names:
                raise NotFound(f"no .safetensors files in {str(path)!r}", code="no_safetensors")
        shards = []
        for name in names:
            where = f"listed in {INDEX_NAME} " if weight_map is not None else ""
            missing = NotFound(f"shard {name} {where}is missing", code="missing_shard")
            shards.append(ShardHeader.read(_member(path, name, roots, missing), name))
        manifest = cls._read_manifest(path, roots)
        ckpt = cls(path, tuple(shards), manifest, weight_map)
        ckpt._check_unique()
        if weight_map is not None:
            ckpt._check_index(weight_map)
        if manifest is not None:
            ckpt._check_manifest()
        return ckpt

    @staticmethod
    def _read_index(directory: Path, roots: Sequence[Path] | None) -> dict[str, str] | None:
        # lexists: a dangling symlink is a broken index, not an absent one.
        if not os.path.lexists(directory / INDEX_NAME):
            return None
        index = _member(directory, INDEX_NAME, roots, _bad_index("it does not resolve to a file"))
        value = read_json_file(index, MAX_JSON_FILE, _bad_index)
        weight_map = value.get("weight_map") if isinstance(value, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise _bad_index("no weight_map object")
        for name, fname in weight_map.items():
            if not _plain_name(fname):
                raise InvalidRequest(
                    f"index puts {name!r} in {str(fname)[:200]!r}, not a file of the checkpoint",
                    code="bad_index",
                )
        return weight_map

    @staticmethod
    def _read_manifest(directory: Path, roots: Sequence[Path] | None) -> dict[str, Any] | None:
        # lexists: a dangling symlink is a broken manifest, not an absent one.
        if not os.path.lexists(directory / MANIFEST_NAME):
            return None
        where = _member(directory, MANIFEST_NAME, roots, _bad_manifest("it does not resolve to a file"))
        manifest = read_json_file(where, MAX_JSON_FILE, _bad_manifest)
        if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
            raise _bad_manifest(f"format is not {MANIFEST_FORMAT!r}")
        files = manifest.get("files")
        if not isinstance(files, dict):
            raise _bad_manifest("files is not an object")
        for fname, meta in files.items():
            if (
                not isinstance(meta, dict)
                or type(meta.get("size")) is not int
                or not isinstance(meta.get("xxh3_128"), str)
            ):
                raise _bad_manifest(f"entry for {fname[:200]!r} lacks an integer size and a checksum")
        tensors = manifest.get("tensors")
        if tensors is not None and (
            not isinstance(tensors, dict) or not all(isinstance(h, str) for h in tensors.values())
        ):
            raise _bad_manifest("tensors is not an object of hashes")
        return manifest

    def _check_unique(self) -> None:
        owner: dict[str, str] = {}
        for shard in self.shards:
            for name in shard.tensors:
                if name in owner:
                    raise InvalidRequest(
                        f"tensor {name!r} is in both {owner[name]} and {shard.name}",
                        code="bad_index" if self.weight_map is not None else "corrupt_checkpoint",
                    )
                owner[name] = shard.name

    def _check_index(self, weight_map: dict[str, str]) -> None:
        by_name = {s.name: s for s in self.shards}
        for name, fname in weight_map.items():
            if name not in by_name[fname].tensors:
                raise InvalidRequest(f"index puts {name!r} in {fname}, which lacks it", code="bad_index")
        extra = [e.spec.name for e in self.entries if e.spec.name not in weight_map]
        if extra:
            raise InvalidRequest(f"tensors missing from the index: {extra[:5]}", code="bad_index")

    def _check_manifest(self) -> None:
        assert self.manifest is not None
        files = self.manifest["files"]
        names = {s.name for s in self.shards}
        if set(files) != names:
            raise InvalidRequest(
                f"the manifest lists {sorted(files)[:5]}, the checkpoint has {sorted(names)[:5]}",
                code="manifest_mismatch",
            )
        for shard in self.shards:
            if files[shard.name]["size"] != shard.size:
                raise InvalidRequest(
                    f"{shard.name}: size {shard.size} does not match the manifest", code="manifest_mismatch"
                )
        tensors = self.tensor_hashes
        if tensors is not None and set(tensors) != {e.spec.name for e in self.entries}:
            raise InvalidRequest("the manifest's tensor hashes do not name the checkpoint's tensors",
                                 code="manifest_mismatch")  # fmt: skip

    def verify_checksums(self) -> None:
        """Check every shard against the manifest's xxh3-128 and, in the same pass, every
        tensor against the manifest's xxh3-64 (files hashed in parallel).

        So a manifest whose per-tensor hashes are wrong is refused here, before the first
        write, not found out mid-copy (which would tear the worker).  Raises
        ``InvalidRequest`` (``manifest_mismatch``, ``corrupt_checkpoint``, ``read_failed``,
        ``not_a_file``) or ``NotFound`` (``missing_shard``) — nothing else.
        """
        if self.manifest is None:
            return
        files = self.manifest["files"]
        expected = self.tensor_hashes

        def checksum(shard: ShardHeader) -> tuple[str, dict[str, str]]:
            with self._reopen(shard) as f:
                if expected is None:
                    return _checksum(f, bytearray(CHUNK)), {}
                return _checksum_tensors(f, shard, bytearray(CHUNK))

        try:
            with ThreadPoolExecutor(max_workers=min(4, len(self.shards))) as pool:
                sums = list(pool.map(checksum, self.shards))
        except Exception as exc:
            raise _refusal(exc) from exc
        for shard, (digest, tensors) in zip(self.shards, sums, strict=True):
            if files[shard.name]["xxh3_128"] != digest:
                raise InvalidRequest(
                    f"{shard.name}: checksum does not match the manifest", code="manifest_mismatch"
                )
            for name, tensor_digest in tensors.items():
                assert expected is not None
                if expected[name] != tensor_digest:
                    raise InvalidRequest(
                        f"{shard.name}: tensor {name!r} does not match the manifest's hash",
                        code="manifest_mismatch",
                    )

    def _reopen(self, shard: ShardHeader) -> io.FileIO:
        """Open ``shard`` again, refusing it unless it is the very file that was validated."""
        try:
            f = open_regular(shard.path)
        except NotFound:
            raise NotFound(f"shard {shard.name} disappeared after validation", code="missing_shard") from None
        st = os.fstat(f.fileno())
        if st.st_size != shard.size or (shard.ino and (st.st_dev, st.st_ino) != (shard.dev, shard.ino)):
            f.close()
            raise corrupt(shard.path, "file changed since it was validated")
        return f

    def _read_shard(
        self, shard: ShardHeader, into: Callable[[TensorEntry], torch.Tensor], meter: ReadMeter
    ) -> Iterator[tuple[TensorEntry, torch.Tensor, str]]:
        """Read ``shard`` front to back; each tensor's bytes go into ``into(entry)`` (a
        contiguous tensor of its dtype and shape).  Yields ``(entry, tensor, xxh3-64 hex)``
        once the tensor's bytes are in and match the manifest; raises at the first mismatch."""
        expected = self.tensor_hashes
        whole = xxhash.xxh3_128() if self.manifest is not None and expected is None else None
        with self._reopen(shard) as f:
            if whole is not None:
                head = f.read(shard.data_start)
                if len(head) != shard.data_start:
                    raise corrupt(shard.path, "file shrank while it was read")
                whole.update(head)
            else:
                f.seek(shard.data_start)
            for entry in shard.tensors.values():  # file order, back to back
                tensor = into(entry)
                view = tensor.detach().reshape(-1).view(torch.uint8).numpy().data
                h = xxhash.xxh3_64()
                for at in range(0, entry.nbytes, CHUNK):
                    part = view[at : at + CHUNK]
                    if read_exactly(f, part) != len(part):
                        raise corrupt(shard.path, "file shrank while it was read")
                    t0 = time.perf_counter()
                    h.update(part)
                    if whole is not None:
                        whole.update(part)
                    meter.hash_seconds += time.perf_counter() - t0
                digest = h.hexdigest()
                if expected is not None and expected.get(entry.spec.name) != digest:
                    raise InvalidRequest(
                        f"{shard.name}: tensor {entry.spec.name!r} differs from the manifest "
                        "(the file changed after it was verified)",
                        code="manifest_mismatch",
                    )
                yield entry, tensor, digest
        files = self.manifest["files"] if self.manifest is not None else {}
        if whole is not None and files[shard.name]["xxh3_128"] != whole.hexdigest():
            raise InvalidRequest(
                f"{shard.name}: contents differ from the manifest (the file changed after it was verified)",
                code="manifest_mismatch",
            )

    def copy_into(self, target: Target, meter: ReadMeter | None = None) -> Iterator[None]:
        """Read every tensor into ``target``, shard by shard, stepping once per tensor: into
        the memory the target lends (the engine's own tensor, or a fresh one a pull target
        keeps), else through one reusable buffer.  Each tensor's xxh3-64, checked against the
        manifest as it was read, goes with it.

        Raises ``NotFound`` (``missing_shard``) or ``InvalidRequest`` (``corrupt_checkpoint``,
        ``manifest_mismatch``) when a file changed after validation, ``OSError`` on a read error.
        """
        meter = meter or ReadMeter()
        cpu = torch.device("cpu")
        spare = torch.empty(0, dtype=torch.uint8)

        def into(entry: TensorEntry) -> torch.Tensor:
            nonlocal spare
            lent = target.buffer(entry.spec, cpu)
            if lent is not None:
                return lent
            if spare.numel() < entry.nbytes:
                spare = torch.empty(entry.nbytes, dtype=torch.uint8)
            return _typed(spare[: entry.nbytes], entry)

        for shard in self.shards:
            for entry, tensor, digest in self._read_shard(shard, into, meter):
                target.accept(entry.spec, tensor, digest)
                yield

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, tensor)`` shard by shard, each tensor owning its memory (a consumer
        may keep it after advancing); raises like :meth:`copy_into`."""
        target = PullTarget()
        return pull(self.copy_into(target), target)


def _typed(buffer: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    dtype = torch_dtype(entry.spec.dtype)
    if entry.nbytes == 0:
        return torch.empty(entry.spec.shape, dtype=dtype)
    return buffer.view(dtype).reshape(entry.spec.shape)


class DiskReader:
    """The disk channel: :meth:`validate` (paths, files, headers, index, manifest and every
    checksum, names, shapes and dtypes; nothing written), then :meth:`stream`."""

    kind = "disk"

    def __init__(self, source: DiskSource, allowed_roots: Sequence[Path] | None = None) -> None:
        self.source = source
        self.allowed_roots = allowed_roots
        self.meter = ReadMeter()
        self._ckpt: DiskCheckpoint | None = None
        self._cast: list[str] = []
        self._validate_seconds = 0.0

    def validate(self, specs: Mapping[str, TensorSpec]) -> dict[str, str] | None:
        """Check the checkpoint against ``specs``.  Returns ``name -> xxh3-64`` of the tensors
        a load would write when the manifest declares them and nothing is cast, else ``None``.

        Raises 4xx errors of the family (see :meth:`DiskCheckpoint.open` and
        :meth:`DiskCheckpoint.verify_checksums`); an exception outside it can only come from
        the metadata check, and ``loading.refusal`` turns it into one."""
        t0 = time.perf_counter()
        ckpt = DiskCheckpoint.open(self.source.model_path, self.allowed_roots)
        self._cast = check_metadata(
            (e.spec for e in ckpt.entries),
            specs,
            allow_partial=self.source.allow_partial,
            allow_dtype_cast=self.source.allow_dtype_cast,
        )
        ckpt.verify_checksums()
        self._ckpt = ckpt
        self._validate_seconds = time.perf_counter() - t0
        declared = ckpt.tensor_hashes
        if declared is None or self._cast:  # a cast tensor's bytes are known only once cast
            return None
        return {e.spec.name: declared[e.spec.name] for e in ckpt.entries}

    def stream(self, target: Target) -> Iterator[None]:
        """Copy the validated checkpoint into ``target`` (see :meth:`DiskCheckpoint.copy_into`)."""
        assert self._ckpt is not None, "validate first"
        return self._ckpt.copy_into(target, self.meter)

    def close(self) -> None:
        """Nothing stays open between validation and the stream (each shard is reopened and
        checked to be the validated file)."""

    @property
    def files(self) -> int:
        return len(self._ckpt.shards) if self._ckpt is not None else 0

    def extra(self) -> dict[str, Any]:
        ckpt = self._ckpt
        assert ckpt is not None
        extra: dict[str, Any] = {
            "validate_seconds": round(self._validate_seconds, 6),
            "hash_seconds": round(self.meter.hash_seconds, 6),
            "verified": "tensors" if ckpt.tensor_hashes is not None else "files" if ckpt.manifest else "none",
        }
        if self._cast:
            extra["dtype_cast"] = len(self._cast)
        if ckpt.manifest is not None:
            extra["manifest_version"] = ckpt.version
        return extra


def load_checkpoint(
    source: DiskSource, sink: TensorSink, allowed_roots: Sequence[Path] | None = None
) -> LoadStats:
    """Validate ``source`` against ``sink``'s specs, then stream it into ``sink``
    (:func:`weightsync.transports.loading.load` over a :class:`DiskReader`).

    Raises ``LoadFailed`` with ``wrote`` telling whether the failure came after the first
    write; when nothing was written its ``cause`` is always a 4xx family error.  A
    checkpoint that changed after validation fails with ``wrote=True`` if any of it had
    been copied (``manifest_mismatch``, ``corrupt_checkpoint`` or ``missing_shard``).
    """
    from ..loading import load

    return load(DiskReader(source, allowed_roots), sink)
