"""The house rules a reader relies on, checked over the whole of ``src/weightsync``: no class
stands on a weightsync base class from another module unless that base is a protocol, an
abstract base, an error or an attrs value (objects are composed, not stacked); no module is
over 400 lines; ``core/`` stays one package a reader can hold in mind."""

from __future__ import annotations

import abc
import importlib
import inspect
import pkgutil
from pathlib import Path
from typing import Protocol

import attrs
import pytest

import weightsync

SRC = Path(weightsync.__file__).parent
# Modules whose import needs an optional stack that a plain install may lack.
OPTIONAL = ("weightsync.engines.vllm", "weightsync.ray.verl_plugin")


def modules() -> list[str]:
    names = []
    for info in pkgutil.walk_packages([str(SRC)], prefix="weightsync."):
        if not info.name.startswith(OPTIONAL) and not info.name.endswith("__main__"):
            names.append(info.name)
    return sorted(names)


def allowed_base(base: type) -> bool:
    """A base a weightsync class may take from another module."""
    return (
        issubclass(base, BaseException)
        or attrs.has(base)
        or getattr(base, "_is_protocol", False)
        or Protocol in base.__mro__
        or inspect.isabstract(base)
        or (
            isinstance(base, abc.ABCMeta)
            and any(getattr(v, "__isabstractmethod__", False) for v in vars(base).values())
        )
    )


def towers() -> list[str]:
    found = []
    for name in modules():
        module = importlib.import_module(name)
        for cls in vars(module).values():
            if not inspect.isclass(cls) or cls.__module__ != name:
                continue
            for base in cls.__bases__:
                home = getattr(base, "__module__", "")
                if home.startswith("weightsync.") and home != name and not allowed_base(base):
                    found.append(f"{name}.{cls.__qualname__}({home}.{base.__qualname__})")
    return found


def test_no_class_stands_on_a_weightsync_class_from_another_module() -> None:
    assert towers() == []


def test_the_tower_check_sees_a_tower(monkeypatch: pytest.MonkeyPatch) -> None:
    # A class of one module built on a plain class of another is what the check must refuse.
    from weightsync.core import command_queue

    class Stacked(command_queue.CommandQueue):
        pass

    Stacked.__module__ = "weightsync.core.events"
    Stacked.__qualname__ = "Stacked"
    from weightsync.core import events

    monkeypatch.setattr(events, "Stacked", Stacked, raising=False)
    assert towers() == ["weightsync.core.events.Stacked(weightsync.core.command_queue.CommandQueue)"]


def test_no_module_is_over_400_lines() -> None:
    long = {
        str(p.relative_to(SRC)): n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400
    }
    assert long == {}


def test_core_holds_at_most_25_modules_subpackages_included() -> None:
    core = sorted(str(p.relative_to(SRC)) for p in (SRC / "core").rglob("*.py"))
    assert len(core) <= 25, core
