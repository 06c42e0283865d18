"""Path policy for checkpoints: which files a worker may read.

A request names an absolute ``model_path``; it and every file read under it (shards found
by index or by listing, the index, the manifest) must resolve — symlinks followed — inside
one of the allowed roots (``None``: anywhere).  A name the checkpoint itself lists (an index
entry) must be a plain file name, so it cannot climb out of the checkpoint's directory.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from weightsync.core.errors import InvalidRequest, NotFound, WeightSyncError

Roots = Sequence[Path] | None


def resolved_roots(allowed_roots: Sequence[str | Path] | None) -> list[Path] | None:
    """The allowed roots, resolved (``None``: anywhere)."""
    return [Path(r).resolve() for r in allowed_roots] if allowed_roots is not None else None


def within(resolved: Path, roots: Roots) -> bool:
    """Whether the resolved path ``resolved`` lies in one of the resolved ``roots``."""
    return roots is None or any(resolved == r or resolved.is_relative_to(r) for r in roots)


def resolve_path(model_path: str, allowed_roots: Sequence[str | Path] | None) -> Path:
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
    roots = resolved_roots(allowed_roots)
    if not within(resolved, roots):
        raise InvalidRequest(
            f"model_path {model_path!r} resolves to {str(resolved)!r}, outside the allowed weight "
            f"directories {[str(r) for r in roots or ()]}",
            code="path_not_allowed",
        )
    return resolved


def member(directory: Path, name: str, roots: Roots, missing: WeightSyncError) -> Path:
    """Resolve the file ``name`` of ``directory`` (which may be a symlink) against ``roots``;
    raise ``missing`` when it does not resolve, ``InvalidRequest`` (``path_not_allowed``) when
    it resolves outside them."""
    try:
        resolved = (directory / name).resolve(strict=True)
    except (RuntimeError, OSError):
        raise missing from None
    if not within(resolved, roots):
        raise InvalidRequest(
            f"{name} resolves to {str(resolved)!r}, outside the allowed weight directories",
            code="path_not_allowed",
        )
    return resolved


def present(directory: Path, name: str) -> bool:
    """Whether ``directory`` has an entry ``name`` (a dangling symlink is present: a broken
    index or manifest, not an absent one)."""
    return os.path.lexists(directory / name)


def plain_name(name: Any) -> bool:
    """Whether ``name`` is a plain file name (no directory part, not ``.``/``..``)."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\0" not in name
