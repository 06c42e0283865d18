"""A checkpoint found and checked: :class:`DiskCheckpoint`.

:meth:`DiskCheckpoint.open` finds every file through the path policy (:mod:`.paths`),
reads every header (:mod:`.format`), the index and the manifest (:mod:`.manifest`), and
checks that they agree: the shard list is complete, no tensor is in two shards, the index
names exactly the tensors the shards hold, and the manifest's files and sizes are the
shards'.  :meth:`DiskCheckpoint.verify_checksums` then reads every byte once against the
manifest's checksums.  Any failure, whatever its exception type, is a 4xx family error:
nothing was written.
"""

from __future__ import annotations

import io
import os
import stat
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import xxhash

from weightsync.core.errors import InvalidRequest, NotFound, WeightSyncError
from weightsync.transports.disk.copy_loop import READERS, ReadMeter, copy_into
from weightsync.transports.disk.format import (
    CHUNK,
    FileIdentity,
    ShardHeader,
    TensorEntry,
    corrupt,
    open_regular,
)
from weightsync.transports.disk.manifest import INDEX_NAME, MANIFEST_NAME, Index, Manifest
from weightsync.transports.disk.paths import member, resolve_path, resolved_roots
from weightsync.transports.failures import refusal
from weightsync.transports.hashing import hasher

if TYPE_CHECKING:
    from weightsync.transports.sink import Target


def _refusal(exc: BaseException) -> WeightSyncError:
    return refusal(exc, "disk", code="corrupt_checkpoint", read_code="read_failed")


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
        h = hasher()
        feed(entry.nbytes, h)
        hashes[entry.spec.name] = h.hexdigest()
    if f.readinto(view[:1]):  # the file grew since its header was read: never read on after it
        raise corrupt(shard.path, "file grew while it was read")
    return whole.hexdigest(), hashes


def file_checksum(path: Path) -> str:
    """xxh3-128 of a regular file, read in bounded chunks (a shrinking file is no crash)."""
    with open_regular(path) as f:
        return _checksum(f, bytearray(CHUNK))


@attrs.frozen
class DiskCheckpoint:
    """A checkpoint whose files and headers have been checked (but not yet its tensors' fit).

    ``model_path`` is the path it was opened by; for a directory, ``identities`` holds the
    identity of the directory itself (``"."``), of its index and of its manifest (``None``:
    absent), each taken before it was listed or read (a shard's identity is in its header)."""

    root: Path
    shards: tuple[ShardHeader, ...]
    manifest: Manifest | None
    index: Index | None = None
    model_path: str = ""
    identities: Mapping[str, FileIdentity | None] = attrs.field(factory=dict)

    @property
    def entries(self) -> Iterator[TensorEntry]:
        for shard in self.shards:
            yield from shard.tensors.values()

    @property
    def version(self) -> Any:
        return self.manifest.version if self.manifest else None

    @property
    def tensor_hashes(self) -> dict[str, str] | None:
        """The manifest's per-tensor xxh3-64 hashes (``None`` for older manifests)."""
        tensors = self.manifest.tensors if self.manifest else None
        return dict(tensors) if tensors is not None else None

    @classmethod
    def open(cls, model_path: str, allowed_roots: Sequence[str | Path] | None = None) -> DiskCheckpoint:
        """Find and check every file of the checkpoint at ``model_path``.

        Raises ``NotFound`` (``path_not_found``, ``no_safetensors``, ``missing_shard``) or
        ``InvalidRequest`` (``path_not_allowed``, ``not_a_file``, ``corrupt_checkpoint``,
        ``bad_index``, ``manifest_mismatch``, ``invalid_value``, ``read_failed``) — nothing else.
        """
        try:
            return cls._open(model_path, allowed_roots)
        except Exception as exc:
            mapped = _refusal(exc)
            if mapped is exc:
                raise
            raise mapped from exc

    @classmethod
    def _open(cls, model_path: str, allowed_roots: Sequence[str | Path] | None) -> DiskCheckpoint:
        path = resolve_path(model_path, allowed_roots)
        roots = resolved_roots(allowed_roots)
        st = path.stat()
        if stat.S_ISREG(st.st_mode):
            if ".safetensors" not in (path.suffix, Path(model_path).suffix):
                raise InvalidRequest(f"{model_path!r} is not a .safetensors file", code="no_safetensors")
            return cls(path.parent, (ShardHeader.read(path),), None, model_path=model_path)
        if not stat.S_ISDIR(st.st_mode):
            raise InvalidRequest(f"model_path {model_path!r} is not a file or directory", code="not_a_file")
        # Taken before the listing and the reads: whatever changes after this differs from them.
        identities = {
            ".": FileIdentity.from_stat(st),
            INDEX_NAME: FileIdentity.at(path / INDEX_NAME),
            MANIFEST_NAME: FileIdentity.at(path / MANIFEST_NAME),
        }
        index = Index.from_index_file(path, roots)
        if index is not None:
            names = index.shard_names
        else:
            names = sorted(p.name for p in path.glob("*.safetensors"))
            if not names:
                raise NotFound(f"no .safetensors files in {str(path)!r}", code="no_safetensors")
        shards = []
        for name in names:
            where = f"listed in {INDEX_NAME} " if index is not None else ""
            missing = NotFound(f"shard {name} {where}is missing", code="missing_shard")
            shards.append(ShardHeader.read(member(path, name, roots, missing), name))
        manifest = Manifest.from_manifest_file(path, roots)
        ckpt = cls(path, tuple(shards), manifest, index, model_path, identities)
        ckpt._check_unique()
        ckpt._check_index()
        ckpt._check_manifest()
        return ckpt

    def _check_unique(self) -> None:
        owner: dict[str, str] = {}
        for shard in self.shards:
            for name in shard.tensors:
                if name in owner:
                    raise InvalidRequest(
                        f"tensor {name!r} is in both {owner[name]} and {shard.name}",
                        code="bad_index" if self.index is not None else "corrupt_checkpoint",
                    )
                owner[name] = shard.name

    def _check_index(self) -> None:
        if self.index is None:
            return
        weight_map = self.index.weight_map
        by_name = {s.name: s for s in self.shards}
        for name, fname in weight_map.items():
            if name not in by_name[fname].tensors:
                raise InvalidRequest(f"index puts {name!r} in {fname}, which lacks it", code="bad_index")
        extra = [e.spec.name for e in self.entries if e.spec.name not in weight_map]
        if extra:
            raise InvalidRequest(f"tensors missing from the index: {extra[:5]}", code="bad_index")

    def _check_manifest(self) -> None:
        if self.manifest is None:
            return
        files = self.manifest.files
        names = {s.name for s in self.shards}
        if set(files) != names:
            raise InvalidRequest(
                f"the manifest lists {sorted(files)[:5]}, the checkpoint has {sorted(names)[:5]}",
                code="manifest_mismatch",
            )
        for shard in self.shards:
            if files[shard.name].size != shard.size:
                raise InvalidRequest(
                    f"{shard.name}: size {shard.size} does not match the manifest", code="manifest_mismatch"
                )
        tensors = self.manifest.tensors
        if tensors is not None and set(tensors) != {e.spec.name for e in self.entries}:
            raise InvalidRequest(
                "the manifest's tensor hashes do not name the checkpoint's tensors", code="manifest_mismatch"
            )

    def verify_checksums(self) -> dict[str, str]:
        """Read every byte of the checkpoint once (files in parallel, as many at once as the
        copy reads tensors; bounded reads) and
        return every tensor's xxh3-64; with a manifest, check every shard against its
        xxh3-128 and every tensor against its xxh3-64 in the same pass.

        So a manifest whose per-tensor hashes are wrong is refused here, before the first
        write, not found out mid-copy (which would tear the worker).  Raises
        ``InvalidRequest`` (``manifest_mismatch``, ``corrupt_checkpoint``, ``read_failed``,
        ``not_a_file``) or ``NotFound`` (``missing_shard``) — nothing else.
        """
        try:
            with ThreadPoolExecutor(max_workers=max(1, min(READERS, len(self.shards)))) as pool:
                sums = list(pool.map(self._hash_shard, self.shards))
        except Exception as exc:
            raise _refusal(exc) from exc
        hashes: dict[str, str] = {}
        for shard, (digest, tensors) in zip(self.shards, sums, strict=True):
            if self.manifest is not None and self.manifest.files[shard.name].xxh3_128 != digest:
                raise InvalidRequest(
                    f"{shard.name}: checksum does not match the manifest", code="manifest_mismatch"
                )
            declared = self.manifest.tensors if self.manifest is not None else None
            for name, tensor_digest in tensors.items():
                if declared is not None and declared[name] != tensor_digest:
                    raise InvalidRequest(
                        f"{shard.name}: tensor {name!r} does not match the manifest's hash",
                        code="manifest_mismatch",
                    )
            hashes.update(tensors)
        return hashes

    def _hash_shard(self, shard: ShardHeader) -> tuple[str, dict[str, str]]:
        with self.reopen(shard) as f:
            return _checksum_tensors(f, shard, bytearray(CHUNK))

    def reopen(self, shard: ShardHeader) -> io.FileIO:
        """Open ``shard`` again, refusing it unless it is the very file that was validated: the
        same device, inode, size, modification and change times (``corrupt_checkpoint``)."""
        try:
            f = open_regular(shard.path)
        except NotFound:
            raise NotFound(f"shard {shard.name} disappeared after validation", code="missing_shard") from None
        # The whole identity: a rewrite in place keeps the size, device and inode but not the
        # modification time, and nothing can set the change time back.
        st = os.fstat(f.fileno())
        if st.st_size != shard.size or (shard.ino and FileIdentity.from_stat(st) != shard.identity):
            f.close()
            raise corrupt(shard.path, "file changed since it was validated")
        return f

    def copy_into(
        self, target: Target, meter: ReadMeter | None = None, expected: Mapping[str, str] | None = None
    ) -> Iterator[None]:
        """Read every tensor into ``target``, each checked against ``expected`` as it is read
        (see :func:`.copy_loop.copy_into`)."""
        return copy_into(self, target, meter, expected)
