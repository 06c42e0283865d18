"""Worker URLs, checked and normalised so that one worker is never counted twice, and the
paths sent to each worker, checked absolute."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

from weightsync.core.errors import InvalidRequest

_DEFAULT_PORT: Final = {"http": 80, "https": 443}


def worker_url(url: Any) -> str:
    """``url`` as a normalised worker base URL: scheme and host lower-cased, the default
    port written out, trailing slashes dropped (``HTTP://H:80/`` is ``http://h:80``).

    Raises ``InvalidRequest`` (``bad_worker_url``) unless it is an ``http``/``https`` URL
    with a host, a valid port, no credentials, query or fragment, and no whitespace or
    control characters.
    """

    def bad(why: str) -> InvalidRequest:
        return InvalidRequest(f"worker URL {str(url)[:200]!r} {why}", code="bad_worker_url")

    if not isinstance(url, str) or not url:
        raise bad("is empty")
    if any(c.isspace() or not c.isprintable() for c in url):
        raise bad("contains whitespace or control characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise bad(f"does not parse ({exc})") from None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORT:
        raise bad("is not an http:// or https:// URL")
    if not parts.hostname:
        raise bad("names no host")
    if "@" in parts.netloc:
        raise bad("carries credentials (use --api-key)")
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        raise bad("has a query or fragment")
    host = parts.hostname.lower()
    if ":" in host:
        host = f"[{host}]"
    path = parts.path.rstrip("/")
    return f"{scheme}://{host}:{port or _DEFAULT_PORT[scheme]}{path}"


def check_absolute(paths: Mapping[str, str], what: str) -> None:
    """Raise ``InvalidRequest`` (``invalid_value``) for the first of ``paths`` (one per worker
    URL) that is relative: a worker resolves it in its own directory.  ``what`` names the
    kind of path (``"checkpoint"``, ``"delta"``)."""
    for url, path in paths.items():
        if not Path(path).is_absolute():
            raise InvalidRequest(
                f"{what} path {path!r} for {url} is relative: workers resolve paths in their own "
                "directory, so give an absolute path",
                code="invalid_value",
            )
