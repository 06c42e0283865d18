"""The safetensors file format, read without trusting it.

A safetensors file is ``u64 little-endian header length N``, ``N`` bytes of JSON, then the
data.  We parse and check headers ourselves (cheaply, before any weight is touched) so every
corruption is found up front: an impossible header length, bad JSON, offsets outside the
data, a byte size that disagrees with dtype × shape, or a file whose length is not exactly
header + data (a truncated shard).  The rules are the safetensors library's: integer
shapes and offsets, tensors laid out back to back from offset 0 without gaps or overlaps.

Every file is opened through :func:`open_regular`: without blocking (a FIFO cannot wedge
the worker) and only if it is a regular file.  JSON is parsed by :func:`parse_json`, which
refuses non-finite numbers, duplicate keys and deep nesting with a family error.
"""

from __future__ import annotations

import errno
import fcntl
import io
import math
import os
import stat
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import attrs

from weightsync.core.dtypes import BY_SAFETENSORS, itemsize
from weightsync.core.errors import InvalidRequest, NotFound, WeightSyncError
from weightsync.core.snapshot import TensorSpec
from weightsync.core.validation import strict_loads

MAX_HEADER: Final = 100 << 20
MAX_JSON_DEPTH: Final = 64
CHUNK: Final = 4 << 20
"""Bytes per read, hashed right after it while still in cache.  Measured on a 2-core machine
under load, 4-8 MiB reads ran 3-5x faster than 1 MiB reads."""


def corrupt(path: Path, why: str) -> InvalidRequest:
    return InvalidRequest(
        f"{path.name}: corrupt safetensors file: {why}", code="corrupt_checkpoint", file=str(path)
    )


def open_regular(path: Path) -> io.FileIO:
    """Open ``path`` for reading, unbuffered, refusing anything but a regular file.

    The open never blocks (``O_NONBLOCK``: a FIFO without a writer cannot wedge us) and
    does not follow a final symlink (callers pass resolved paths, so one there was swapped
    in after resolution).  Raises ``NotFound`` (``missing_shard``) or ``InvalidRequest``
    (``not_a_file``); other ``OSError`` s propagate.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise NotFound(f"{path.name} does not exist", code="missing_shard", file=str(path)) from None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            raise InvalidRequest(
                f"{path.name} is not a regular file", code="not_a_file", file=str(path)
            ) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InvalidRequest(f"{path.name} is not a regular file", code="not_a_file", file=str(path))
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return io.FileIO(fd, "rb", closefd=True)
    except BaseException:
        os.close(fd)
        raise


@attrs.frozen
class FileIdentity:
    """The file a path names as ``stat`` sees it: device, inode, size, and modification and
    change times in nanoseconds.  A write, a truncation, a rename over the name or a
    ``touch`` changes it (nothing can set a change time back)."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def from_stat(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    @classmethod
    def at(cls, path: Path) -> FileIdentity | None:
        """The identity of what ``path`` names (symlinks followed; nothing is opened, so a
        FIFO cannot block), ``None`` when nothing, or a dangling link, is there."""
        try:
            return cls.from_stat(os.stat(path))
        except (OSError, ValueError):
            return None


def read_exactly(f: io.FileIO, view: memoryview) -> int:
    """Fill ``view`` from ``f``; return how many bytes arrived (fewer only at end of file)."""
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    return got


def _depth_exceeds(value: Any, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > limit:
                return True
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return False


def parse_json(raw: bytes, refuse: Callable[[str], WeightSyncError]) -> Any:
    """Parse strict JSON: UTF-8, finite numbers, unique keys, nesting at most 64 deep.

    Any failure is raised as ``refuse(reason)``.
    """
    try:
        value = strict_loads(raw, finite=True)
    except RecursionError:
        raise refuse("nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, our hooks
        raise refuse(f"not valid JSON ({str(exc)[:200]})") from None
    if _depth_exceeds(value, MAX_JSON_DEPTH):
        raise refuse(f"nested more than {MAX_JSON_DEPTH} deep")
    return value


def read_json_file(path: Path, max_bytes: int, refuse: Callable[[str], WeightSyncError]) -> Any:
    """Read and :func:`parse_json` a small regular file of at most ``max_bytes``.  A file that
    says it is empty is refused unread: pseudo-files (``/proc``) say so, and reading one can
    block."""
    with open_regular(path) as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise refuse("the file is empty")
        raw = f.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise refuse(f"larger than {max_bytes} bytes")
    return parse_json(raw, refuse)


def _int(value: Any) -> int:
    if type(value) is not int:
        raise TypeError(f"{value!r} is not an integer")
    return value


@attrs.frozen
class TensorEntry:
    spec: TensorSpec
    start: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@attrs.frozen
class ShardHeader:
    """A checked header: the file's tensors with absolute offsets (in file order), its
    exact size, and the identity of the file that was checked (device, inode, and the
    modification and change times, in nanoseconds).

    ``path`` is the resolved file; ``name`` the name the checkpoint lists it under (an
    index entry or a directory entry), which may be a symlink to ``path``.
    """

    path: Path
    tensors: dict[str, TensorEntry]
    size: int
    name: str = ""
    dev: int = 0
    ino: int = 0
    mtime_ns: int = 0
    ctime_ns: int = 0

    @property
    def identity(self) -> FileIdentity:
        """The identity of the file whose header this is, as it was when it was opened."""
        return FileIdentity(self.dev, self.ino, self.size, self.mtime_ns, self.ctime_ns)

    @property
    def data_bytes(self) -> int:
        return sum(t.end - t.start for t in self.tensors.values())

    @property
    def data_start(self) -> int:
        return min((t.start for t in self.tensors.values()), default=self.size)

    @classmethod
    def read(cls, path: Path, name: str | None = None) -> ShardHeader:
        """Parse and check ``path``'s header.

        Raises ``InvalidRequest`` (``corrupt_checkpoint``, ``not_a_file``) or ``NotFound``
        (``missing_shard``); an unreadable file raises ``OSError``.
        """
        with open_regular(path) as f:
            st = os.fstat(f.fileno())
            size = st.st_size
            if size < 8:  # never read what the file does not say it holds (a /proc file says 0)
                raise corrupt(path, f"file is {size} bytes, too short for a header")
            prefix = f.read(8)
            if len(prefix) < 8:
                raise corrupt(path, f"file is {size} bytes, too short for a header")
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER or n > size - 8:
                raise corrupt(path, f"header length {n} is impossible for a {size}-byte file")
            raw = f.read(n)
        if len(raw) != n:
            raise corrupt(path, "file shrank while its header was read")
        header = parse_json(raw, lambda why: corrupt(path, f"header is {why}"))
        if not isinstance(header, dict):
            raise corrupt(path, "header is not a JSON object")
        metadata = header.pop("__metadata__", {})
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise corrupt(path, "__metadata__ is not an object of strings")
        base = 8 + n
        placed: list[tuple[int, int, str, str, tuple[int, ...]]] = []
        for tname, meta in header.items():
            try:
                dtype_code = meta["dtype"]
                if not isinstance(dtype_code, str) or dtype_code not in BY_SAFETENSORS:
                    raise KeyError(dtype_code)
                shape = tuple(_int(d) for d in meta["shape"])
                offsets = [_int(o) for o in meta["data_offsets"]]
                begin, stop = offsets
            except (KeyError, TypeError, ValueError):
                raise corrupt(path, f"bad entry for tensor {tname!r}") from None
            if any(d < 0 for d in shape) or not 0 <= begin <= stop:
                raise corrupt(path, f"bad shape or offsets for tensor {tname!r}")
            dtype = BY_SAFETENSORS[dtype_code]
            if stop - begin != math.prod(shape) * itemsize(dtype):
                raise corrupt(path, f"tensor {tname!r}: {stop - begin} bytes for {dtype_code} {list(shape)}")
            placed.append((begin, stop, tname, dtype, shape))
        placed.sort(key=lambda p: (p[0], p[1]))
        tensors: dict[str, TensorEntry] = {}
        cursor = 0
        for begin, stop, tname, dtype, shape in placed:
            if begin != cursor:
                what = "overlaps the one before" if begin < cursor else "leaves a gap before it"
                raise corrupt(path, f"tensor {tname!r} at offset {begin} {what} (expected {cursor})")
            cursor = stop
            tensors[tname] = TensorEntry(TensorSpec(tname, dtype, shape), base + begin, base + stop)
        if base + cursor != size:
            what = "truncated" if base + cursor > size else "has trailing bytes"
            raise corrupt(path, f"file {what}: {size} bytes, header promises {base + cursor}")
        return cls(
            path, tensors, size, name or path.name, st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns
        )
