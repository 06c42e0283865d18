"""Running the worker app with uvicorn: in the foreground (``weightsync serve``) or in a
background thread (tests, the demo, notebooks)."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn

from weightsync.core.errors import InvalidRequest
from weightsync.edge.logs import server_config
from weightsync.edge.origin import is_loopback_host as is_loopback


def check_exposure(host: str, api_key: str | None, allowed_weight_dirs: Any) -> None:
    """Refuse to bind beyond loopback without a token and allowed weight directories."""
    if is_loopback(host):
        return
    if not api_key:
        raise InvalidRequest(
            f"refusing to bind {host}: beyond loopback an API key is required "
            "(--api-key or WEIGHTSYNC_API_KEY)",
            code="api_key_required",
        )
    if not allowed_weight_dirs:
        raise InvalidRequest(
            f"refusing to bind {host}: beyond loopback --allowed-weight-dir is required",
            code="allowed_weight_dir_required",
        )


GRACEFUL_SHUTDOWN_S = 3
"""How long a shutdown waits for open requests once queued and kept ones were aborted."""

log = logging.getLogger("weightsync.http")


class Server(uvicorn.Server):
    """uvicorn's server, whose shutdown is bounded: it first aborts the engine's queued, kept
    and running requests (``app.state.abort_in_flight``, set by ``create_app``), so a
    completion waiting on a paused worker cannot hold the process open; whatever is still
    running after ``timeout_graceful_shutdown`` seconds is cancelled by uvicorn."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        abort = getattr(getattr(self.config.app, "state", None), "abort_in_flight", None)
        if abort is not None:
            try:
                await asyncio.wait_for(abort(), timeout=self.config.timeout_graceful_shutdown)
            except Exception:  # never let the abort stop the shutdown
                log.exception("aborting in-flight requests at shutdown failed")
        await super().shutdown(sockets)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``port`` 0 picks a free one).

    Binding comes first, before any engine starts, so that a busy port is a one-line error at
    once rather than a traceback after a long engine start.

    :raises InvalidRequest: ``address_in_use`` when the port is taken, ``bind_failed`` when the
        address cannot be bound at all (unknown host name, an address this machine lacks).
    """
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (OSError, UnicodeError) as exc:
        raise InvalidRequest(f"cannot bind {host}:{port}: {exc}", code="bind_failed") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise InvalidRequest(
                f"cannot bind {host}:{port}: the port is already in use (another worker?); "
                "stop it or pick another --port",
                code="address_in_use",
            ) from None
        raise InvalidRequest(
            f"cannot bind {host}:{port}: {exc.strerror or exc}", code="bind_failed"
        ) from None
    sock.set_inheritable(True)
    return sock


def bound_url(sock: socket.socket) -> str:
    """``http://host:port`` of a bound socket (the real port, also when 0 was asked for)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def serve(
    app: Any,
    host: str,
    port: int,
    *,
    log_level: str = "info",
    log_format: str = "text",
    graceful_s: int = GRACEFUL_SHUTDOWN_S,
    sock: socket.socket | None = None,
    on_started: Callable[[], None] | None = None,
) -> None:
    """Serve ``app`` on the running loop until interrupted (Ctrl-C or SIGTERM stop it within
    about ``graceful_s`` seconds, aborting requests still queued or kept).

    ``sock`` is a socket from :func:`bind` (else ``host:port`` is bound here); ``on_started``
    runs once the server accepts connections and the app's start-up (the engine's) is done.
    ``log_level`` applies to uvicorn's loggers and to ``weightsync``'s (whose
    ``weightsync.events`` records say what the worker did); ``log_format`` is ``text`` or
    ``json`` (one JSON object a line, uvicorn's lines too): see :func:`.logs.log_config`.
    """
    config = server_config(
        app,
        host,
        port,
        log_level,
        log_format,
        # One line per request only when asked for (debug): at info a worker says what it
        # did (its events), not every poll a router sends it.
        access_log=log_level in ("debug", "trace"),
        timeout_graceful_shutdown=graceful_s,
    )
    server = Server(config)
    task = asyncio.ensure_future(server.serve(sockets=[sock] if sock is not None else None))
    if on_started is not None:
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        if server.started:
            on_started()
    await task


class ServerThread:
    """Serve an app on an ephemeral loopback port in a daemon thread.

    >>> with ServerThread(app) as server:
    ...     WorkerClient(server.url).get_weight_version()
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0) -> None:
        self.app = app
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Accepted connections inherit this: responses are not held back by Nagle.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        self._sock = sock
        self.host, self.port = sock.getsockname()[:2]
        config = uvicorn.Config(
            app, log_level="warning", lifespan="on", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S
        )
        self.server = Server(config)
        self.thread = threading.Thread(target=self._run, name=f"weightsync-http-{self.port}", daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.server.serve(sockets=[self._sock]))
        finally:
            self.loop.close()

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the worker server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self._sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
