"""What every worker client does on the wire: check a worker URL, build its headers, open
connections without Nagle's stall, and turn a reply into its value or the error family.
"""

from __future__ import annotations

import functools
import socket
import ssl
from typing import Any

import httpx

from weightsync.core import errors

Reply = dict[str, Any]


def raise_for_reply(status: int, reply: Any, url: str = "") -> Reply:
    """Return ``reply`` if it is a success; raise the error family otherwise."""
    if isinstance(reply, dict) and reply.get("status") == "ok" and status < 400:
        return reply
    if not isinstance(reply, dict):
        raise errors.EngineFailure(f"{url}: HTTP {status} with a non-JSON-object body", code="bad_reply")
    exc = errors.WeightSyncError.from_reply(reply, status)
    exc.details.setdefault("url", url)
    raise exc


def decode(response: httpx.Response) -> Reply:
    try:
        body = response.json()
    except ValueError:
        body = None
    return raise_for_reply(response.status_code, body, str(response.url))


def check_url(url: str) -> str:
    """``url`` without a trailing slash, once it is a worker's base URL: ``http`` or ``https``,
    with a host, and nothing after the port but an optional path prefix.

    :raises InvalidRequest: ``bad_worker_url``, naming the fix (``127.0.0.1:8000`` → add
        ``http://``).
    """
    if not isinstance(url, str):
        raise errors.InvalidRequest(
            f"a worker URL must be a string, not {type(url).__name__}", code="bad_worker_url"
        )
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError, TypeError):
        parsed = None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host:
        hint = f" (did you mean 'http://{url}'?)" if "://" not in url else ""
        raise errors.InvalidRequest(
            f"{url!r} is not a worker URL: give http://HOST:PORT or https://HOST:PORT{hint}",
            code="bad_worker_url",
        )
    return url.rstrip("/")


def headers(api_key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {api_key}"} if api_key else {}


# httpx writes a request's headers and body separately; without TCP_NODELAY, Nagle's
# algorithm holds the body until the server's delayed ACK (~40 ms per request on Linux).
NODELAY = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]


@functools.cache
def _tls() -> ssl.SSLContext:
    # One verifying TLS context for every client of the process: building one reads the CA
    # bundle, 30-100 ms (more under load), and a transport built without one builds its own
    # even for http:// workers — once per worker per fleet transaction, in the event loop.
    return httpx.create_ssl_context()


def sync_transport() -> httpx.HTTPTransport:
    """An httpx transport with ``TCP_NODELAY`` (no ~40 ms Nagle stall per request)."""
    return httpx.HTTPTransport(socket_options=NODELAY, verify=_tls())


def async_transport() -> httpx.AsyncHTTPTransport:
    """The async :func:`sync_transport`."""
    return httpx.AsyncHTTPTransport(socket_options=NODELAY, verify=_tls())


def decode_completion(response: httpx.Response) -> Reply:
    """The completion object of a ``/v1/completions`` reply; raises the error family for an
    error reply."""
    body = response.json()
    if response.status_code >= 400:
        raise_for_reply(response.status_code, body, str(response.url))
    return body  # type: ignore[no-any-return]
