"""HTTP transport: the worker app and router (the clients are in :mod:`weightsync.trainer`).
Names load on first use."""

from __future__ import annotations

from typing import TYPE_CHECKING

from weightsync._lazy import lazy_exports

if TYPE_CHECKING:
    from weightsync.trainer.client import AsyncWorkerClient, WorkerClient, raise_for_reply
    from weightsync.trainer.fleet import Fleet, FleetError

    from .app import admin_router, create_app, install_error_handlers
    from .server import ServerThread, serve

_WHERE = {
    "admin_router": ".app", "create_app": ".app", "install_error_handlers": ".app",
    "ServerThread": ".server", "serve": ".server",
    "AsyncWorkerClient": "weightsync.trainer.client", "WorkerClient": "weightsync.trainer.client",
    "raise_for_reply": "weightsync.trainer.client",
    "Fleet": "weightsync.trainer.fleet", "FleetError": "weightsync.trainer.fleet",
}  # fmt: skip
__all__ = [
    "AsyncWorkerClient", "Fleet", "FleetError", "ServerThread", "WorkerClient", "admin_router",
    "create_app", "install_error_handlers", "raise_for_reply", "serve",
]  # fmt: skip
__getattr__ = lazy_exports(__name__, _WHERE)
