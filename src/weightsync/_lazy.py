"""Lazy re-exports: a package names what it offers without importing it.

A worker process imports the channel it reads; it must not load the trainer wing or the
web stack because a package ``__init__`` happened to name them.  A package sets
``__all__, __getattr__ = lazy_package(__name__, {"Name": ".module", ...})`` (or only
``__getattr__`` with :func:`lazy_exports`) and each name is imported on first use; its
``if TYPE_CHECKING:`` imports (``Name as Name``, an explicit re-export) give checkers the types,
and ``__dir__ = lazy_dir(globals(), __all__)`` shows the names to ``dir()`` and to editors
before any is loaded.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def lazy_exports(package: str, where: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``where[name]`` (relative to ``package``) on first
    use and returns its attribute ``name``; other names raise ``AttributeError``."""

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(where[name], package), name)

    return __getattr__


def lazy_package(package: str, where: Mapping[str, str]) -> tuple[list[str], Callable[[str], Any]]:
    """``__all__`` and ``__getattr__`` of a package that offers ``where``'s names (name ->
    module, relative to ``package``), each imported on first use (see :func:`lazy_exports`)."""
    return list(where), lazy_exports(package, where)


def lazy_dir(namespace: Mapping[str, Any], names: Iterable[str]) -> Callable[[], list[str]]:
    """A module ``__dir__``: what the module's ``namespace`` (its ``globals()``) holds and the
    lazily exported ``names``, so ``dir(package)`` lists what it offers before any is loaded."""
    offered = tuple(names)

    def __dir__() -> list[str]:
        return sorted({*namespace, *offered})

    return __dir__
