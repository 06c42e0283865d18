"""Cross-site safety: what a web page in the operator's browser must not be able to do.

A loopback worker without a key is still reachable from any page the operator visits.
Browsers send some cross-site requests without asking the server first (a "simple
request": a form post, or ``fetch`` with a ``text/plain``, form or multipart body), and a
page can rebind its own DNS name to ``127.0.0.1``.  Three rules close both doors:

1. every POST needs ``Content-Type: application/json`` (415 ``unsupported_media_type``):
   a browser sends that type cross-site only after a CORS preflight, which this server
   never grants;
2. a request whose ``Origin`` header is present must come from the server's own origin
   (403 ``forbidden_origin``); ``Origin: null`` (sandboxed pages, files) is foreign too;
3. a request that arrived on a loopback address must name a loopback host (``localhost``,
   ``127.0.0.1``, ``[::1]``, any port) in its ``Host`` header, so a page whose name was
   rebound to ``127.0.0.1`` is refused (403 ``forbidden_host``).  A loopback-bound worker
   thus answers loopback names only; ``allowed_hosts`` adds names (a local reverse proxy's),
   and ``"*"`` allows any.  Requests that arrived on another interface (a worker bound
   beyond loopback, which needs a key) are not held to it.

GET routes (``/health``, ``/metrics``, ``/engine/routes``, ``/docs``) only pass the Host
rule: they change nothing, and the browser keeps their replies from a foreign page.

A request that repeats ``Host``, ``Origin`` or ``Content-Type`` is refused outright (400
``repeated_header``), GET included: the rules would read one copy and a proxy or the app
might act on the other.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from weightsync.core.errors import Forbidden, InvalidRequest, UnsupportedMediaType, WeightSyncError

from .replies import error_response

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def is_loopback_address(address: str | None) -> bool:
    """Whether the local address a connection arrived on is a loopback one (unknown counts)."""
    if not address:
        return True
    try:
        ip = ipaddress.ip_address(address.partition("%")[0])
    except ValueError:
        return True  # a Unix socket path: local, so held to the loopback rule
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


_HOST = re.compile(r"(?:\[(?P<ip6>[0-9a-f:.]+)\]|(?P<name>[^:\[\]]*))(?::[0-9]*)?")


def host_name(host: str) -> str:
    """The name in a ``Host`` header, without port or IPv6 brackets, lower-cased.

    Only ``name``, ``name:port``, ``[ipv6]`` and ``[ipv6]:port`` are taken apart (the port
    all digits); anything else (``[::1].evil.com``, ``localhost:evil.com``) comes back
    whole, so it matches no allowed name.
    """
    host = host.strip().lower()
    m = _HOST.fullmatch(host)
    if m is None:
        return host
    return m["ip6"] if m["ip6"] is not None else m["name"]


SINGLE_HEADERS = ("host", "origin", "content-type")
"""Headers the rules read: sent twice, one reader would see one copy and another the other."""


def request_headers(raw: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """ASGI headers as a dict with lower-cased names.

    Raises :class:`InvalidRequest` (``repeated_header``) for a repeated ``Host``,
    ``Origin`` or ``Content-Type``: which copy counts would be a guess.
    """
    headers: dict[str, str] = {}
    for k, v in raw:
        name = k.decode("latin-1").lower()
        if name in headers and name in SINGLE_HEADERS:
            raise InvalidRequest(
                f"the {name} header is sent more than once", code="repeated_header", header=name
            )
        headers[name] = v.decode("latin-1")
    return headers


class SitePolicy:
    """Which ``Host`` names a worker answers; see the module docstring for the rules."""

    def __init__(self, allowed_hosts: Iterable[str] | None = None) -> None:
        extra = {host_name(h) for h in allowed_hosts or ()}
        self.any_host = "*" in extra
        self.hosts = frozenset(LOOPBACK_HOSTS | extra)

    def check(
        self, method: str, scheme: str, headers: dict[str, str], local_address: str | None = None
    ) -> None:
        """Raise :class:`Forbidden` or :class:`UnsupportedMediaType` if the request breaks a rule.

        ``headers`` are lower-cased names; ``local_address`` is the address the connection
        arrived on (ASGI ``scope["server"][0]``).
        """
        host = headers.get("host")
        # Browsers always send Host; a client without one is not a web page.
        checked = not self.any_host and is_loopback_address(local_address)
        if host is not None and checked and host_name(host) not in self.hosts:
            raise Forbidden(
                f"Host {host!r} is not a name this worker serves (allowed: {sorted(self.hosts)}; "
                "see --allowed-host)",
                code="forbidden_host",
            )
        if method in SAFE_METHODS:
            return
        origin = headers.get("origin")
        if origin is not None and origin.lower() != f"{scheme}://{host or ''}".lower():
            raise Forbidden(f"cross-origin request from {origin!r} refused", code="forbidden_origin")
        media_type = headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type != "application/json":
            raise UnsupportedMediaType(
                f"the body must be sent as Content-Type: application/json, got {media_type or 'none'!r}"
            )


class SiteGuard:
    """ASGI middleware applying a :class:`SitePolicy` to every HTTP request before the app sees it."""

    def __init__(self, app: ASGIApp, allowed_hosts: Iterable[str] | None = None) -> None:
        self.app = app
        self.policy = SitePolicy(allowed_hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            try:
                headers = request_headers(scope["headers"])
                server = scope.get("server") or (None, None)
                self.policy.check(scope["method"], scope.get("scheme", "http"), headers, server[0])
            except WeightSyncError as exc:
                await error_response(exc)(scope, receive, send)
                return
        await self.app(scope, receive, send)
