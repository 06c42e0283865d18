"""A worker actor's keyword arguments, read as ``weightsync serve``'s flags.

Every keyword is a flag of ``serve`` under its argument name (``--model-config`` is
``model_config``); a repeatable flag takes a list under its plural (``--allowed-weight-dir``
is ``allowed_weight_dirs``, ``--vllm-arg`` is ``vllm_args``, which also takes a mapping).
Names, choices and defaults come from ``serve``'s own parser, so an actor and a served
worker cannot drift apart; the values are checked as the parser would check the flag's
text (a choice, an integer, a boolean), strictly: ``"1"`` is not an integer here.
Two defaults differ from ``serve``: ``port`` is 0 (a free port: several actors share a
node) and ``initial_version`` is any JSON value rather than its text.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import Any, Final

from weightsync.core.errors import InvalidRequest

__all__ = ["ACTOR_DEFAULTS", "serve_actions", "serve_namespace"]

ACTOR_DEFAULTS: Final[Mapping[str, Any]] = {"port": 0}
"""Where an actor's default differs from ``serve``'s."""


def _repeatable(action: argparse.Action) -> bool:
    return isinstance(action.default, list)  # serve's repeatable flags append to a list


def _switch(action: argparse.Action) -> bool:
    return action.nargs == 0 and action.const is True  # a store_true flag


def serve_actions() -> dict[str, argparse.Action]:
    """``serve``'s arguments by keyword: the argument name, plural for a repeatable flag."""
    from weightsync.worker_app import serve_actions as flags

    return {(f"{dest}s" if _repeatable(a) else dest): a for dest, a in flags().items()}


def _wrong(key: str, what: str) -> InvalidRequest:
    return InvalidRequest(f"{key} must be {what}", code="wrong_type", field=key)


def _value(key: str, action: argparse.Action, value: Any) -> Any:
    """``value`` as ``serve``'s parser would hold it for the flag; raises ``InvalidRequest``."""
    if _switch(action):
        if type(value) is not bool:
            raise _wrong(key, "a boolean")
        return value
    if _repeatable(action):
        if key == "vllm_args" and isinstance(value, Mapping):
            value = [f"{k}={json.dumps(v)}" for k, v in value.items()]
        if isinstance(value, str) or not isinstance(value, list | tuple):
            raise _wrong(key, "a list of strings")
        if any(type(v) is not str for v in value):
            raise _wrong(key, "a list of strings")
        return list(value)
    if value is None and action.default is None:
        return None
    if action.type is int and (type(value) is not int):
        raise _wrong(key, "an integer")
    if action.type is float:
        if type(value) not in (int, float):
            raise _wrong(key, "a number")
        return float(value)
    if action.type is None and type(value) is not str:
        raise _wrong(key, "a string")
    if action.choices is not None and value not in action.choices:
        raise InvalidRequest(
            f"{key} must be one of {list(action.choices)}, got {value!r}", code="invalid_value", field=key
        )
    return value


def _version_text(value: Any) -> str:
    """A version as ``--initial-version``'s text (its JSON: a string stays a string)."""
    try:
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(
            f"initial_version must be a JSON value: {exc}", code="invalid_value", field="initial_version"
        ) from None


def serve_namespace(options: Mapping[str, Any]) -> argparse.Namespace:
    """``options`` (an actor's keywords) as the namespace ``weightsync serve`` parses its
    flags into, every flag not given at its default.

    ``initial_version`` is the version itself (any JSON value), written here as the flag's
    text.  Raises ``InvalidRequest``: ``unknown_field`` for a keyword no flag of ``serve``
    has (the message lists them), ``wrong_type`` or ``invalid_value`` for a value the flag
    would refuse.
    """
    actions = serve_actions()
    unknown = sorted(set(options) - set(actions))
    if unknown:
        raise InvalidRequest(
            f"unknown worker argument(s) {unknown}; the arguments are serve's flags: {sorted(actions)}",
            code="unknown_field",
            fields=unknown,
        )
    ns = argparse.Namespace(**{a.dest: a.default for a in actions.values()})
    for key, value in ACTOR_DEFAULTS.items():
        setattr(ns, key, value)
    for key, value in options.items():
        action = actions[key]
        if key == "initial_version":
            setattr(ns, action.dest, None if value is None else _version_text(value))
            continue
        setattr(ns, action.dest, _value(key, action, value))
    return ns
