"""A weightsync worker as a Ray actor: :data:`WorkerActor`.

The actor is ``weightsync serve`` without the process around it: its keyword arguments are
``serve``'s flags (:mod:`weightsync.ray.arguments`), checked as ``serve`` checks them, and
the engine, controller and app are built by the same function (``build_worker_app``) on the
actor's event loop.  Its methods are

* the admin routes, one method each (``get_weight_version``, ``pause_generation``,
  ``update_weights_from_disk`` …), taking the route's body fields as keywords and returning
  its reply; a refusal raises the error family with the route's ``code`` (through Ray, as
  ``RayTaskError(<class>)``, an instance of the same class whose ``code`` is the worker's);
* the methods vLLM's ``RayVLLMWeightSyncClient`` calls on an ``AsyncLLM`` actor
  (:mod:`weightsync.ray.vllm_methods`);
* :meth:`Worker.ready` (where it serves, once built), :meth:`Worker.routes` and
  :meth:`Worker.shutdown`.

Every call goes through the route registry's ``dispatch``, recorded in the worker's
metrics, exactly as the HTTP routes are; with ``serve_http=True`` the same app also serves
over HTTP (the router and curl reach the worker the actor is).  Ray's defaults for the
actor are :data:`DEFAULT_OPTIONS` (give more with ``WorkerActor.options(num_cpus=…,
num_gpus=…)``); ``replica_index`` is the actor's place among the fleet's replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final

import ray

from weightsync.core.engine import ClosingEngine, ParallelEngine
from weightsync.core.errors import EngineFailure, InvalidRequest
from weightsync.core.routes import ROUTES, Reply
from weightsync.ray.arguments import serve_namespace
from weightsync.ray.vllm_methods import VllmMethods
from weightsync.serve.dialects.common import Calls
from weightsync.serve.dialects.vllm import VllmDialect

__all__ = ["DEFAULT_OPTIONS", "Worker", "WorkerActor"]

DEFAULT_OPTIONS: Final[dict[str, Any]] = {"num_cpus": 0.5}
"""Ray's resources for a worker actor unless ``.options`` says otherwise: half a CPU, so a
test or a laptop runs a few; a real replica asks for its GPUs (``num_gpus``)."""

_WILDCARDS: Final = ("0.0.0.0", "::", "")


def _check(args: Any, serve_http: bool) -> None:
    """``serve``'s own checks of its flags, before anything is built."""
    from weightsync.worker_app import check_serve_arguments

    check_serve_arguments(args, serving_http=serve_http)


class Worker:
    """The body of :data:`WorkerActor` (see the module docstring).  Keywords: ``serve``'s
    flags, plus ``replica_index`` (this actor's place among the replicas, from 0) and
    ``serve_http`` (also serve the app on ``host``:``port``).

    Raises ``InvalidRequest`` for an argument ``serve`` would refuse; the actor then fails
    to start (Ray raises ``ActorDiedError`` naming the refusal on its first call).
    """

    async def __init__(self, *, replica_index: int = 0, serve_http: bool = False, **options: Any) -> None:
        from weightsync.worker_app import build_worker_app

        if type(replica_index) is not int or replica_index < 0:
            raise InvalidRequest(
                "replica_index must be an integer >= 0", code="invalid_value", field="replica_index"
            )
        if type(serve_http) is not bool:
            raise InvalidRequest("serve_http must be a boolean", code="wrong_type", field="serve_http")
        args = serve_namespace(options)
        _check(args, serve_http)
        self.replica_index = replica_index
        self._stack = contextlib.AsyncExitStack()
        self.app = build_worker_app(args)  # on the actor's event loop, as serve builds on its own
        self.controller = self.app.state.controller
        engine = self.controller.engine
        self.world_size = engine.world_size if isinstance(engine, ParallelEngine) else 1
        self.calls = Calls(self.controller, self.app.state.metrics)
        dialect = VllmDialect(
            self.controller,
            self.calls,
            self.world_size,
            exact=args.dialect == "vllm",
            auto_pause=args.auto_pause_updates,
            admission=self.app.state.admission if args.vllm_version != "0.32" else None,
        )
        self.vllm = VllmMethods(dialect, replica_index, self.world_size)
        self.url: str | None = None
        self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
        if self.restarted:
            self._paused_from_the_start()
        if serve_http:
            await self._serve(args)
        else:  # the app's own start-up and shut-down (the engine's), without a server
            await self._stack.enter_async_context(self.app.router.lifespan_context(self.app))

    def _paused_from_the_start(self) -> None:
        """Pause generation as the app starts, before its first request (HTTP or actor call).

        Ray restarted this actor (``max_restarts``): it holds the weights it was started
        with, which the fleet has most likely moved past.  Paused, it serves nothing until the
        fleet brings it onto its committed version and resumes it (``RayFleet.admit``, or the
        next transaction); a router fences it meanwhile."""
        inner = self.app.router.lifespan_context

        @contextlib.asynccontextmanager
        async def lifespan(app: Any) -> AsyncIterator[Any]:
            async with inner(app) as state:  # the engine's start
                await self.calls("pause_generation", {"mode": "abort"})
                yield state

        self.app.router.lifespan_context = lifespan

    async def _serve(self, args: Any) -> None:
        from weightsync.serve.server import bind, bound_url, serve

        sock = bind(args.host, args.port)
        started = asyncio.Event()
        server = asyncio.ensure_future(
            serve(
                self.app,
                args.host,
                args.port,
                log_level=args.log_level,
                log_format=args.log_format,
                sock=sock,
                on_started=started.set,
            )
        )
        waiting = asyncio.ensure_future(started.wait())
        await asyncio.wait({server, waiting}, return_when=asyncio.FIRST_COMPLETED)
        if not started.is_set():
            waiting.cancel()
            server.result()  # the server's own failure, if it raised one
            raise EngineFailure(
                "the worker's HTTP app did not start (see the actor's log)", code="start_failed"
            )
        self._stack.push_async_callback(self._stop, server)
        self.url = bound_url(sock)
        if args.host in _WILDCARDS:  # reachable from the other nodes at this node's address
            self.url = f"http://{ray.util.get_node_ip_address()}:{sock.getsockname()[1]}"

    async def _stop(self, server: asyncio.Future[None]) -> None:
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await server
        engine = self.controller.engine
        try:
            if isinstance(engine, ClosingEngine):  # the lifespan a cancelled server did not finish
                await engine.close()
        finally:
            for close in self.app.state.on_close:
                close()

    async def ready(self) -> Reply:
        """The built worker: its engine, world size, replica index, HTTP URL (``None``
        without ``serve_http``) and whether Ray restarted it (it then came back paused)."""
        return {
            "engine": self.controller.engine.name,
            "world_size": self.world_size,
            "replica_index": self.replica_index,
            "url": self.url,
            "restarted": self.restarted,
        }

    async def routes(self) -> Reply:
        """``GET /engine/routes``'s reply: the admin routes, the engine and its world size."""
        return {
            "status": "ok",
            "routes": sorted(ROUTES),
            "engine": self.controller.engine.name,
            "world_size": self.world_size,
        }

    async def shutdown(self) -> None:
        """Stop serving HTTP and close the engine (``AsyncLLM.shutdown``); the actor stays
        until it is killed or its handles are gone."""
        await self._stack.aclose()

    # vLLM's AsyncLLM methods (see weightsync.ray.vllm_methods)

    async def init_weight_transfer_engine(self, request: Any) -> None:
        await self.vllm.init_weight_transfer_engine(request)

    async def shutdown_weight_transfer_engine(self) -> None:
        await self.vllm.shutdown_weight_transfer_engine()

    async def start_weight_update(self) -> None:
        await self.vllm.start_weight_update()

    async def update_weights(self, request: Any) -> None:
        await self.vllm.update_weights(request)

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        await self.vllm.finish_weight_update(weight_version)

    async def update_weight_version(self, new_version: str) -> None:
        await self.vllm.update_weight_version(new_version)


def _route_method(name: str) -> Callable[..., Awaitable[Reply]]:
    async def method(self: Worker, **body: Any) -> Reply:
        reply = await self.calls(name, body)
        # as the worker's HTTP app answers it: the routing taints beside the state
        return self.app.state.taints.reported(reply) if name == "get_weight_version" else reply

    method.__name__ = name
    method.__qualname__ = f"Worker.{name}"
    method.__doc__ = f"{ROUTES[name].summary} The admin route ``{name}``: its body's fields as keywords."
    return method


for _name in ROUTES:  # before ray.remote reads the class: one method per admin route
    setattr(Worker, _name, _route_method(_name))

WorkerActor = ray.remote(**DEFAULT_OPTIONS)(Worker)
"""The worker actor class: ``WorkerActor.options(name=…, namespace=…, lifetime="detached")
.remote(engine="reference", model_config="tiny", replica_index=0)``."""
