"""Who may talk to an HTTP service of weightsync: the site rules and the bearer token, as
plain functions over header strings.

The worker and the router apply them through one ASGI middleware,
:class:`weightsync.edge.guard.SiteGuard`; the rules themselves live here, once.  See
``weightsync.edge.guard`` for the reasoning behind each rule.  Pure standard library: no
web framework is imported.
"""

from __future__ import annotations

import hmac
import ipaddress
import re
from collections.abc import Iterable

from weightsync.core.errors import Forbidden, InvalidRequest, Unauthorized, UnsupportedMediaType

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
    """Which ``Host`` names a server answers; see ``weightsync.edge.guard`` for the rules."""

    def __init__(self, allowed_hosts: Iterable[str] | None = None) -> None:
        extra = {host_name(h) for h in allowed_hosts or ()}
        self.any_host = "*" in extra
        self.hosts = frozenset(LOOPBACK_HOSTS | extra)

    def check(
        self,
        method: str,
        scheme: str,
        headers: dict[str, str],
        local_address: str | None = None,
        *,
        bodiless_ok: bool = False,
    ) -> None:
        """Raise :class:`Forbidden` or :class:`UnsupportedMediaType` if the request breaks a rule.

        ``headers`` are lower-cased names; ``local_address`` is the address the connection
        arrived on (ASGI ``scope["server"][0]``).  ``bodiless_ok`` lets a POST with no body
        and no ``Content-Type`` through when it carries no ``Origin`` (a browser always sends
        one on a cross-site POST, so such a request is no web page's): vLLM's client posts so.
        """
        host = headers.get("host")
        # Browsers always send Host; a client without one is not a web page.
        checked = not self.any_host and is_loopback_address(local_address)
        if host is not None and checked and host_name(host) not in self.hosts:
            raise Forbidden(
                f"Host {host!r} is not a name this server serves (allowed: {sorted(self.hosts)}; "
                "see --allowed-host)",
                code="forbidden_host",
            )
        if method in SAFE_METHODS:
            return
        origin = headers.get("origin")
        if origin is not None and origin.lower() != f"{scheme}://{host or ''}".lower():
            raise Forbidden(f"cross-origin request from {origin!r} refused", code="forbidden_origin")
        media_type = headers.get("content-type", "").partition(";")[0].strip().lower()
        if bodiless_ok and not media_type and origin is None and _bodiless(headers):
            return
        if media_type != "application/json":
            raise UnsupportedMediaType(
                f"the body must be sent as Content-Type: application/json, got {media_type or 'none'!r}"
            )


def _bodiless(headers: dict[str, str]) -> bool:
    return headers.get("content-length", "0").strip() == "0" and "transfer-encoding" not in headers


def is_loopback_host(host: str) -> bool:
    """Whether a bind address (``--host``) is a loopback one (``localhost`` included)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_api_key(api_key: str | None) -> None:
    """Raise ``InvalidRequest`` (``empty_api_key``) for an empty key, which would let a bare
    ``Bearer`` in; ``None`` means no key."""
    if api_key == "":
        raise InvalidRequest("the API key must not be empty (pass None for no key)", code="empty_api_key")


def check_bearer(authorization: str | None, api_key: str | None) -> None:
    """Raise ``Unauthorized`` unless ``authorization`` is ``Bearer <api_key>`` (nothing is
    checked when ``api_key`` is ``None``).  Compared in constant time."""
    if api_key is None:
        return
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), api_key.encode()):
        raise Unauthorized("missing or wrong bearer token", code="unauthorized")
