"""Admin calls to worker actors, as the httpx transport of the fleet's worker clients.

The fleet reaches a worker through :class:`~weightsync.trainer.client.AsyncWorkerClient`,
whose one seam is an httpx transport (the fleet's in-process tests put worker apps behind
one the same way).  :class:`ActorTransport` answers ``POST /engine/<route>`` by calling the
actor's method of that name with the body's fields and waiting for it no longer than the
client's timeout, which the client bounds by the phase's deadline.  Everything the client
decides stays the client's: deadlines, retries, and how a failure reads.  So an actor is
exactly as reachable as an HTTP worker:

* a reply is the route's reply; a refusal is its error object with its HTTP status (the
  worker app's own reply), read back into the same error family and ``code``;
* an actor whose class has no method for the route (one older than the route: ``clock``) is
  a 404 ``unknown_route``, as the HTTP app of such a worker answers, so what the client does
  for a route that is not there (the fleet's clock reading falls back) applies alike;
* an actor that died, or became unavailable, during the call (``RayActorError``,
  ``ActorDiedError``, ``ActorUnavailableError``) is a connection lost mid-request, and a
  named actor Ray does not know (yet) a connection refused: both ``unreachable``;
* no answer by the deadline is a read timeout: ``timeout``.  The call is not cancelled,
  as an HTTP worker's is not when its client gives up.

Each worker is a URL the journal can keep: ``http://<name>.<namespace>.ray:80`` for a
named actor (stable across drivers, and across a restart under the same name), else
``http://actor-<id>.ray:80`` (:func:`actor_url`), or the URL its :class:`ActorRef` gives
(its HTTP app's, so that a router in front of it names it alike).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Mapping
from typing import Any, Final
from urllib.parse import urlsplit

import attrs
import httpx
import ray
from ray.actor import ActorHandle

from weightsync.core.errors import InvalidRequest, WeightSyncError
from weightsync.core.routes import ROUTES
from weightsync.fleet.urls import worker_url

__all__ = ["ActorRef", "ActorTransport", "actor_url"]

_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}")


@attrs.frozen
class ActorRef:
    """One worker actor: its handle, or its name (and namespace) to look it up by.

    ``url`` stands for the worker in the fleet's results, progress lines and journal: by
    default one made from its name, else from its actor id (:func:`actor_url`).  Give the
    URL of the actor's HTTP app (``serve_http`` on a fixed ``port``) when a router fronts
    it: the fleet and the router then name the worker alike, so the router reads the
    journal's commits for it.  Calls still go to the actor.

    Raises ``InvalidRequest``: ``bad_worker`` (neither a handle nor a name, or a name that
    cannot be a URL's label), ``bad_worker_url`` (a ``url`` that is not a worker's base
    URL, or that has a path).
    """

    handle: ActorHandle | None = None
    name: str | None = None
    namespace: str | None = None
    url: str = attrs.field(default=None)

    def __attrs_post_init__(self) -> None:
        if self.handle is None and self.name is None:
            raise InvalidRequest("an actor is named by its handle or its name", code="bad_worker")
        if self.url is None:
            object.__setattr__(self, "url", actor_url(self))
            return
        url = worker_url(self.url)
        if urlsplit(url).path:
            raise InvalidRequest(f"worker URL {url!r} has a path: give the base URL", code="bad_worker_url")
        object.__setattr__(self, "url", url)


def actor_url(ref: ActorRef) -> str:
    """The worker URL made for ``ref`` from its name (``http://<name>.<namespace>.ray:80``),
    else its actor id (``http://actor-<id>.ray:80``).

    Raises ``InvalidRequest`` (``bad_worker``) for a name or namespace that cannot be one
    label of a host name (letters, digits, ``-`` and ``_``, up to 63)."""
    if ref.name is None:
        assert ref.handle is not None
        return worker_url(f"http://actor-{ref.handle._actor_id.hex()}.ray")
    for what, label in (("name", ref.name), ("namespace", ref.namespace)):
        if label is not None and not _NAME.fullmatch(label):
            raise InvalidRequest(
                f"actor {what} {label!r} must be letters, digits, '-' and '_' (up to 63) to name a "
                "fleet worker",
                code="bad_worker",
            )
    return worker_url(f"http://{ref.name}.{ref.namespace or '_'}.ray")


def _reply(status: int, body: Mapping[str, Any], request: httpx.Request) -> httpx.Response:
    return httpx.Response(status, json=dict(body), request=request)


def _method(handle: ActorHandle, name: str) -> Any:
    """``handle``'s method ``name``, or ``None`` where the actor's class has none (Ray's handle
    raises ``AttributeError``)."""
    try:
        return getattr(handle, name)
    except AttributeError:
        return None


class ActorTransport(httpx.AsyncBaseTransport):
    """Admin requests to the worker actors ``refs`` (by their :func:`actor_url`), answered by
    calling their methods (see the module docstring)."""

    def __init__(self, refs: Mapping[str, ActorRef]) -> None:
        self.refs = dict(refs)
        self._handles: dict[str, ActorHandle] = {u: r.handle for u, r in refs.items() if r.handle}

    async def _handle(self, url: str, request: httpx.Request) -> ActorHandle:
        if url not in self._handles:
            ref = self.refs[url]
            try:
                self._handles[url] = await asyncio.to_thread(ray.get_actor, ref.name, ref.namespace)
            except ValueError as exc:  # no such actor (not yet, or no longer)
                raise httpx.ConnectError(f"no actor {ref.name!r}: {exc}", request=request) from None
        return self._handles[url]

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        port = request.url.port  # None: the scheme's default
        url = worker_url(f"{request.url.scheme}://{request.url.host}" + (f":{port}" if port else ""))
        route = request.url.path.removeprefix("/engine/")
        if url not in self.refs:
            raise httpx.ConnectError(f"{url} is no worker actor of this fleet", request=request)
        raw = await request.aread()
        body = json.loads(raw) if raw.strip() else {}
        if route not in ROUTES and route != "routes":
            return _reply(404, {"status": "error", "code": "unknown_route", "message": route}, request)
        handle = await self._handle(url, request)
        method = _method(handle, route)
        if method is None:  # an actor class without the route's method, e.g. one older than it
            message = f"the worker actor has no method {route!r}"
            return _reply(404, {"status": "error", "code": "unknown_route", "message": message}, request)
        timeout = (request.extensions.get("timeout") or {}).get("read")
        try:
            ref = method.remote(**body)
            reply = await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout)
        except asyncio.TimeoutError:
            raise httpx.ReadTimeout(f"{url}: {route} did not answer in time", request=request) from None
        except ray.exceptions.RayActorError as exc:
            if self.refs[url].name is not None:  # looked up again: a restart may bring it back
                self._handles.pop(url, None)
            raise httpx.ReadError(f"actor {url} died or is unavailable: {exc}", request=request) from None
        except WeightSyncError as exc:  # Ray's RayTaskError(<class>) is an instance of the worker's class
            return _reply(exc.http_status, exc.to_reply(), request)
        except ray.exceptions.RayTaskError as exc:
            message = f"{type(exc.cause).__name__}: {exc.cause}"
            return _reply(500, {"status": "error", "code": "internal_error", "message": message}, request)
        return _reply(200, reply, request)
