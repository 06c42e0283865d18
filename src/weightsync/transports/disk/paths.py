"""Path policy for checkpoints: which files a worker may read.

A request names an absolute ``model_path``; it and every file read under it (shards found
by index or by listing, the index, the manifest) must resolve — symlinks followed — inside
one of the allowed roots (``None``: anywhere).  A name the checkpoint itself lists (an index
entry) must be a plain file name, so it cannot climb out of the checkpoint's directory.  A
path that cannot be resolved because its symlinks loop is ``symlink_loop``, not "missing".
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from weightsync.core.errors import InvalidRequest, NotFound, WeightSyncError

Roots = Sequence[Path] | None


def _loop(what: str) -> InvalidRequest:
    return InvalidRequest(f"{what} is a loop of symbolic links", code="symlink_loop")


def _resolved(path: Path, what: str, missing: WeightSyncError) -> Path:
    """``path`` with every symlink followed; ``InvalidRequest`` (``symlink_loop``) when they
    loop (Python raises ``RuntimeError`` or an ``ELOOP`` ``OSError``, by version), ``missing``
    when it does not resolve otherwise."""
    try:
        return path.resolve(strict=True)
    except RuntimeError:
        raise _loop(what) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _loop(what) from None
        raise missing from None


def resolved_roots(allowed_roots: Sequence[str | Path] | None) -> list[Path] | None:
    """The allowed roots, resolved (``None``: anywhere).  A root whose symlinks now loop
    allows nothing (resolving it raises nothing: no path can lie inside it)."""
    if allowed_roots is None:
        return None
    roots = []
    for r in allowed_roots:
        try:
            roots.append(Path(r).resolve())
        except (RuntimeError, OSError):
            continue
    return roots


def within(resolved: Path, roots: Roots) -> bool:
    """Whether the resolved path ``resolved`` lies in one of the resolved ``roots``."""
    return roots is None or any(resolved == r or resolved.is_relative_to(r) for r in roots)


def resolve_path(
    model_path: str, allowed_roots: Sequence[str | Path] | None, *, field: str = "model_path"
) -> Path:
    """Resolve ``model_path`` (the request's ``field``, which the refusals name); raise
    ``NotFound`` (``path_not_found``) or ``InvalidRequest`` (``path_not_allowed``,
    ``invalid_value``, ``symlink_loop``)."""
    try:
        path = Path(model_path)
        if not path.is_absolute():
            raise InvalidRequest(f"{field} must be absolute, got {model_path!r}", code="invalid_value")
        os.fsencode(path)  # a NUL byte or an unencodable character: refuse, not crash
        if "\0" in model_path:
            raise ValueError("embedded null byte")
    except (ValueError, TypeError):
        raise InvalidRequest(f"{field} {model_path!r} is not a valid path", code="invalid_value") from None
    missing = NotFound(f"{field} {model_path!r} does not exist", code="path_not_found")
    resolved = _resolved(path, f"{field} {model_path!r}", missing)
    roots = resolved_roots(allowed_roots)
    if not within(resolved, roots):
        raise InvalidRequest(
            f"{field} {model_path!r} resolves to {str(resolved)!r}, outside the allowed weight "
            f"directories {[str(r) for r in roots or ()]}",
            code="path_not_allowed",
        )
    return resolved


def member(directory: Path, name: str, roots: Roots, missing: WeightSyncError) -> Path:
    """Resolve the file ``name`` of ``directory`` (which may be a symlink) against ``roots``;
    raise ``missing`` when it does not resolve, ``InvalidRequest`` (``symlink_loop``) when its
    symlinks loop, (``path_not_allowed``) when it resolves outside them."""
    resolved = _resolved(directory / name, name, missing)
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
