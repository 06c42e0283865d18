"""The JSON files beside a checkpoint's shards: two as typed, frozen values, one by name.

:class:`Index` is ``model.safetensors.index.json`` (HF's ``weight_map``: tensor -> shard);
:class:`Manifest` is our writer's ``weightsync-manifest.json`` (format, version, per-file
size and xxh3-128, optionally per-tensor xxh3-64).  Each is built by a named constructor
that reads the file through the path policy and refuses anything malformed with one family
error (``bad_index``, ``manifest_mismatch``); past that point nothing re-checks types.
:data:`DELTA_NAME` is the file that makes a directory a delta checkpoint (``weightsync
delta``: :mod:`weightsync.transports.delta.manifest` reads it), which a full load refuses.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

import attrs

from weightsync.core.errors import InvalidRequest
from weightsync.transports.disk.format import read_json_file
from weightsync.transports.disk.paths import Roots, member, plain_name, present

INDEX_NAME: Final = "model.safetensors.index.json"
MANIFEST_NAME: Final = "weightsync-manifest.json"
MANIFEST_FORMAT: Final = "weightsync/1"
DELTA_NAME: Final = "weightsync-delta.json"
MAX_JSON_FILE: Final = 64 << 20


def bad_index(why: str) -> InvalidRequest:
    return InvalidRequest(f"{INDEX_NAME} is not a valid index: {why}", code="bad_index")


def bad_manifest(why: str) -> InvalidRequest:
    return InvalidRequest(f"{MANIFEST_NAME} is not a weightsync manifest: {why}", code="manifest_mismatch")


_ABSENT: Final = object()


def _read_beside(directory: Path, name: str, roots: Roots, refuse: Callable[[str], InvalidRequest]) -> Any:
    """The JSON value of the file ``name`` beside the shards, or ``_ABSENT`` when there is none."""
    if not present(directory, name):
        return _ABSENT
    where = member(directory, name, roots, refuse("it does not resolve to a file"))
    return read_json_file(where, MAX_JSON_FILE, refuse)


@attrs.frozen
class Index:
    """``weight_map``: which shard (a plain file name) holds each tensor."""

    weight_map: Mapping[str, str]

    @property
    def shard_names(self) -> list[str]:
        return sorted(set(self.weight_map.values()))

    @classmethod
    def from_json(cls, value: Any) -> Index:
        """Raises ``InvalidRequest`` (``bad_index``)."""
        weight_map = value.get("weight_map") if isinstance(value, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise bad_index("no weight_map object")
        for name, fname in weight_map.items():
            if not plain_name(fname):
                raise InvalidRequest(
                    f"index puts {name!r} in {str(fname)[:200]!r}, not a file of the checkpoint",
                    code="bad_index",
                )
        return cls(weight_map)

    @classmethod
    def from_index_file(cls, directory: Path, roots: Roots) -> Index | None:
        """The index of the checkpoint directory ``directory`` (``None`` when it has none).
        Raises ``InvalidRequest`` (``bad_index``, ``path_not_allowed``, ``not_a_file``)."""
        value = _read_beside(directory, INDEX_NAME, roots, bad_index)
        return cls.from_json(value) if value is not _ABSENT else None


@attrs.frozen
class FileEntry:
    """What the manifest says of one shard file."""

    size: int
    xxh3_128: str


@attrs.frozen
class Manifest:
    """Our writer's manifest: the checkpoint's ``version``, every shard's size and xxh3-128,
    and (newer manifests) every tensor's xxh3-64."""

    version: Any
    files: Mapping[str, FileEntry]
    tensors: Mapping[str, str] | None

    @classmethod
    def from_json(cls, value: Any) -> Manifest:
        """Raises ``InvalidRequest`` (``manifest_mismatch``)."""
        if not isinstance(value, dict) or value.get("format") != MANIFEST_FORMAT:
            raise bad_manifest(f"format is not {MANIFEST_FORMAT!r}")
        files = value.get("files")
        if not isinstance(files, dict):
            raise bad_manifest("files is not an object")
        entries = {}
        for fname, meta in files.items():
            if (
                not isinstance(meta, dict)
                or type(meta.get("size")) is not int
                or not isinstance(meta.get("xxh3_128"), str)
            ):
                raise bad_manifest(f"entry for {fname[:200]!r} lacks an integer size and a checksum")
            entries[fname] = FileEntry(meta["size"], meta["xxh3_128"])
        tensors = value.get("tensors")
        if tensors is not None and (
            not isinstance(tensors, dict) or not all(isinstance(h, str) for h in tensors.values())
        ):
            raise bad_manifest("tensors is not an object of hashes")
        return cls(value.get("version"), entries, tensors)

    @classmethod
    def from_manifest_file(cls, directory: Path, roots: Roots) -> Manifest | None:
        """The manifest of the checkpoint directory ``directory`` (``None`` when it has none).
        Raises ``InvalidRequest`` (``manifest_mismatch``, ``path_not_allowed``, ``not_a_file``)."""
        value = _read_beside(directory, MANIFEST_NAME, roots, bad_manifest)
        return cls.from_json(value) if value is not _ABSENT else None
