"""The Python clients read well: every public method of WorkerClient and AsyncWorkerClient has
a docstring and says what it returns, and help() shows named defaults, not object reprs."""

from __future__ import annotations

import inspect
import pydoc
import typing

import pytest

from weightsync.trainer import replies
from weightsync.trainer.client import UNSET, AsyncWorkerClient, WorkerClient

CLIENTS = [WorkerClient, AsyncWorkerClient]
CLOSERS = {"close", "aclose"}  # the only public methods with nothing to return


def _public_methods(cls: type) -> list[str]:
    return sorted(n for n, v in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_"))


@pytest.mark.parametrize("cls", CLIENTS, ids=lambda c: c.__name__)
def test_every_public_method_has_a_docstring_and_a_return_annotation(cls: type) -> None:
    names = _public_methods(cls)
    assert "update_weights_from_disk" in names and "pause_generation" in names
    for name in names:
        method = getattr(cls, name)
        assert (method.__doc__ or "").strip(), f"{cls.__name__}.{name} has no docstring"
        returned = inspect.signature(method, eval_str=True).return_annotation
        if name in CLOSERS:
            continue
        assert returned not in (None, type(None), inspect.Signature.empty), (
            f"{cls.__name__}.{name} says it returns None"
        )
    assert (cls.__doc__ or "").strip()


def test_route_methods_return_the_typed_reply_of_their_route() -> None:
    hints = typing.get_type_hints(WorkerClient.get_weight_version)
    assert hints["return"] is replies.StateReply
    assert "version_current" in typing.get_type_hints(replies.StateReply)
    assert typing.get_type_hints(WorkerClient.update_weights_from_disk)["return"] is replies.UpdateReply
    assert typing.get_type_hints(WorkerClient.pause_generation)["return"] is replies.PauseReply


@pytest.mark.parametrize("cls", CLIENTS, ids=lambda c: c.__name__)
def test_help_shows_named_defaults_not_object_reprs(cls: type) -> None:
    text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
    assert "<object object" not in text
    assert "weight_version: 'Any' = UNSET" in text
    for line in text.splitlines():
        if (
            "-> None" in line or "-> 'None'" in line
        ):  # constructors, closers and context exits return None by nature
            assert any(
                f"{n}(" in line for n in (cls.__name__, "__init__", "__exit__", "__aexit__", *CLOSERS)
            ), line
    assert repr(UNSET) == "UNSET" and not UNSET
