"""verl's checkpoint-engine interface, one for one, for the tests where verl is not installed.

It reproduces verl 0.9.1's ``verl/checkpoint_engine/base.py``: the class
``CheckpointEngineRegistry`` (``register`` as a decorator factory, ``get``, ``new``, the
``ValueError`` for an unregistered backend) and the abstract class ``CheckpointEngine``
(``prepare``, the classmethod ``build_topology``, ``init_process_group``, ``finalize``,
``send_weights``, ``receive_weights``, ``wire_format``) with verl's names, arguments and
abstractness; nothing else of verl (its manager, worker groups and rollout servers) is here.
:func:`verl_api` gives the real ones when verl imports, and this module's otherwise.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections.abc import Generator
from typing import Any, ClassVar, NamedTuple

import torch


class CheckpointEngineRegistry:
    """verl/checkpoint_engine/base.py ``CheckpointEngineRegistry``."""

    _registry: ClassVar[dict[str, type[CheckpointEngine]]] = {}

    def register(backend: str):  # type: ignore[no-untyped-def]  # verl's own signature: no self
        def wrapper(cls: type[CheckpointEngine]) -> type[CheckpointEngine]:
            CheckpointEngineRegistry._registry[backend] = cls
            return cls

        return wrapper

    @classmethod
    def get(cls, backend: str) -> type[CheckpointEngine]:
        if backend not in cls._registry:
            raise ValueError(
                f"Checkpoint engine {backend} not registered, registered backends: {sorted(cls._registry)}"
            )
        return cls._registry[backend]

    @classmethod
    def new(cls, backend: str, *args: Any, **kwargs: Any) -> CheckpointEngine:
        return cls.get(backend)(*args, **kwargs)


class CheckpointEngine(ABC):
    """verl/checkpoint_engine/base.py ``CheckpointEngine``."""

    wire_format = "named_tensors"

    @abstractmethod
    def prepare(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    @abstractmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        raise NotImplementedError

    @abstractmethod
    def init_process_group(self, **kwargs: Any) -> None:
        raise NotImplementedError

    @abstractmethod
    def finalize(self) -> None:
        raise NotImplementedError

    @abstractmethod
    async def send_weights(
        self, weights: Generator[tuple[str, torch.Tensor], None, None], global_steps: int | None = None
    ) -> Any:
        raise NotImplementedError

    @abstractmethod
    async def receive_weights(
        self, global_steps: int | None = None
    ) -> Generator[tuple[str, torch.Tensor], None, None]:
        raise NotImplementedError


class VerlApi(NamedTuple):
    registry: Any
    base: type
    real: bool


def verl_api() -> VerlApi:
    """verl's ``CheckpointEngineRegistry`` and ``CheckpointEngine`` when verl imports here,
    else this module's.  (verl's import warns of Ray's deprecated state API: not ours.)"""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from verl.checkpoint_engine import CheckpointEngine as Base
            from verl.checkpoint_engine import CheckpointEngineRegistry as Registry
    except ImportError:
        return VerlApi(CheckpointEngineRegistry, CheckpointEngine, False)
    return VerlApi(Registry, Base, True)
