"""HTTP transport: the worker app and router (the clients are the trainer's, in
:mod:`weightsync.trainer`).  Names load on first use."""

from __future__ import annotations

from typing import TYPE_CHECKING

from weightsync._lazy import lazy_dir, lazy_exports

if TYPE_CHECKING:
    from weightsync.serve.app import admin_router, create_app, install_error_handlers
    from weightsync.serve.server import ServerThread, serve

_WHERE = {
    "admin_router": ".app", "create_app": ".app", "install_error_handlers": ".app",
    "ServerThread": ".server", "serve": ".server",
}  # fmt: skip
__all__ = ["ServerThread", "admin_router", "create_app", "install_error_handlers", "serve"]
__getattr__ = lazy_exports(__name__, _WHERE)
__dir__ = lazy_dir(globals(), __all__)
