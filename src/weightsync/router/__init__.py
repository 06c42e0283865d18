"""A version-aware router in front of a fleet: completions go only to workers serving a
committed (version, epoch, digest) that the request's freshness policy allows; fleet updates
run through it, batch by batch.  See ``docs/router.md``.

Names load on first use, so the top-level CLI can register ``router`` without importing
the web stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from weightsync._lazy import lazy_dir, lazy_exports

if TYPE_CHECKING:
    from weightsync.router._state import STATES, TABLE, Label, RoutingMachine, observe
    from weightsync.router.app import create_router_app
    from weightsync.router.policy import Policy, choose, parse_policy, request_policy
    from weightsync.router.service import Router

_WHERE = {
    "STATES": "._state", "TABLE": "._state", "Label": "._state", "RoutingMachine": "._state",
    "observe": "._state", "create_router_app": ".app", "Policy": ".policy", "choose": ".policy",
    "parse_policy": ".policy", "request_policy": ".policy", "Router": ".service",
}  # fmt: skip
__all__ = [
    "STATES", "TABLE", "Label", "Policy", "Router", "RoutingMachine", "choose", "create_router_app",
    "observe", "parse_policy", "request_policy",
]  # fmt: skip
__getattr__ = lazy_exports(__name__, _WHERE)
__dir__ = lazy_dir(globals(), __all__)
