"""HTTP transport: the worker app and router, and typed clients."""

from __future__ import annotations

from .app import admin_router, create_app, install_error_handlers
from .client import AsyncWorkerClient, WorkerClient, raise_for_reply
from .fleet import Fleet, FleetError
from .server import ServerThread, serve

__all__ = [
    "AsyncWorkerClient", "Fleet", "FleetError", "ServerThread", "WorkerClient", "admin_router", "create_app",
    "install_error_handlers", "raise_for_reply", "serve",
]  # fmt: skip
