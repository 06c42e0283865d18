"""Trainer-side checkpoint writer: a reader never sees a half-written checkpoint.

``save_checkpoint`` writes shards, the HF-style index and a manifest (per-file size and
xxh3-128 checksum, per-tensor xxh3-64, the content digest they combine into, version,
creation time) into a hidden temporary sibling directory,
fsyncs every file and the directory, and only then renames it into place.  A crash before
the rename leaves nothing at the target path (only a hidden ``.name.tmp-*`` sibling).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from weightsync.core.dtypes import safetensors_code
from weightsync.core.errors import InvalidRequest
from weightsync.core.held import weights_digest
from weightsync.transports.disk.checks import DiskCheckpoint, file_checksum
from weightsync.transports.disk.manifest import INDEX_NAME, MANIFEST_FORMAT, MANIFEST_NAME
from weightsync.transports.hashing import tensor_hash
from weightsync.transports.sink import PullTarget, dtype_name, pull


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _shard(named: list[tuple[str, torch.Tensor]], shard_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, t))
        size += n
    return shards


def _empty_dir(path: Path) -> bool:
    """Whether ``path`` is a directory (not a link to one) with nothing in it."""
    if path.is_symlink() or not path.is_dir():
        return False
    with os.scandir(path) as entries:
        return next(entries, None) is None


def _before_rename(tmp: Path, final: Path) -> None:
    """Hook for tests that simulate a crash between writing and publishing."""


@contextlib.contextmanager
def published(final: Path) -> Iterator[Path]:
    """A hidden temporary sibling of ``final`` to write a directory into: when the block ends
    it is synced and renamed into place in one step (an existing ``final`` is swapped out by
    rename first, then deleted); when the block raises, it is removed and ``final`` is as it
    was.  The caller syncs the files it wrote."""
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    old = None
    try:
        yield tmp
        _fsync(tmp)
        _before_rename(tmp, final)
        if final.exists():
            old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    directory: str | os.PathLike[str],
    *,
    version: Any = None,
    shard_bytes: int = 5 << 30,
    overwrite: bool = False,
    progress: Callable[[int, int, str], None] | None = None,
) -> Path:
    """Write a sharded safetensors checkpoint to ``directory`` atomically; return its path.

    ``progress(done, total, what)``, when given, is called as the work advances: ``done`` of
    ``total`` units (each byte of the weights counts three times: written, hashed per tensor,
    checksummed per file), ``what`` a short description of the current step.

    Raises ``InvalidRequest`` (``unsupported_dtype``) before writing anything when a tensor's
    dtype has no safetensors code in :data:`weightsync.core.dtypes.DTYPES` (``complex128``,
    or a dtype outside the table), and ``FileExistsError`` if ``directory`` exists, is not an
    empty directory, and ``overwrite`` is false.  An existing empty directory (a ``mkdir``
    made ahead of time) is replaced like a missing one.  With ``overwrite`` the old checkpoint
    is swapped out by rename, then deleted.  Every file is written world-readable (``0o644``
    less the process umask), like any file the process creates, so a worker running as
    another user can read it.
    """
    final = Path(directory).absolute()
    items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
    for name, t in items:
        try:
            safetensors_code(dtype_name(t.dtype))
        except InvalidRequest as exc:
            raise InvalidRequest(f"tensor {name!r}: {exc.message}", code=exc.code) from None
    if final.exists() and not overwrite and not _empty_dir(final):
        raise FileExistsError(f"{final} exists (pass overwrite=True to replace it)")
    with published(final) as tmp:
        mode = tmp.stat().st_mode & 0o644  # mkdir applied the umask to 0o777: reuse it, no os.umask race
        shards = _shard(items, shard_bytes)
        weight_map: dict[str, str] = {}
        files: dict[str, dict[str, Any]] = {}
        tensors: dict[str, str] = {}
        total = 0
        work = 3 * sum(t.numel() * t.element_size() for _, t in items)
        done = 0

        def advance(n: int, what: str) -> None:
            nonlocal done
            done += n
            if progress is not None:
                progress(done, work, what)

        for i, shard in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            path = tmp / fname
            shard_size = sum(t.numel() * t.element_size() for _, t in shard)
            contents = {n: t.detach().contiguous().cpu() for n, t in shard}
            if progress is not None:
                progress(done, work, f"writing {fname}")
            save_file(contents, str(path))
            os.chmod(path, mode)  # safetensors creates 0600 files; match the index and manifest
            _fsync(path)
            advance(shard_size, f"hashing the tensors of {fname}")
            for n, t in contents.items():
                tensors[n] = tensor_hash(t)
                advance(t.numel() * t.element_size(), f"hashing the tensors of {fname}")
            files[fname] = {"size": path.stat().st_size, "xxh3_128": file_checksum(path)}
            advance(shard_size, f"checksummed {fname}")
            total += shard_size
            weight_map.update(dict.fromkeys((n for n, _ in shard), fname))
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        manifest = {
            "format": MANIFEST_FORMAT,
            "version": version,
            "created": time.time(),
            "files": files,
            "tensors": tensors,  # lets a reader verify each tensor as it copies it
            "digest": weights_digest(tensors),  # what a worker holding exactly these weights reports
        }
        for name, obj in ((INDEX_NAME, index), (MANIFEST_NAME, manifest)):
            (tmp / name).write_text(json.dumps(obj, indent=1))
            _fsync(tmp / name)
    return final


def checkpoint_hashes(path: str | Path) -> dict[str, str]:
    """The xxh3-64 of every tensor of the checkpoint at ``path``, as a worker loading it
    records them: the manifest's per-tensor hashes when it declares them, else hashed from
    the shards.  The checkpoint is opened and checked by the disk channel's own reader (no
    FIFO can block it, no JSON can be too deep or too large).

    Raises the refusal a worker would (a 4xx family error) when the checkpoint is refused."""
    ckpt = DiskCheckpoint.open(str(Path(path).absolute()))
    declared = ckpt.tensor_hashes
    return declared if declared is not None else ckpt.verify_checksums()


def checkpoint_tensors(path: str | Path) -> tuple[dict[str, torch.Tensor], Any]:
    """Every tensor of the checkpoint at ``path`` (checked by the disk channel's own reader,
    each checked against the manifest's hash as it is read) and the manifest's version."""
    ckpt = DiskCheckpoint.open(str(Path(path).absolute()))
    target = PullTarget()
    tensors = dict(pull(ckpt.copy_into(target, expected=ckpt.tensor_hashes), target))
    return tensors, ckpt.version
