"""Values given on a command line, read the way the routes read a body.

One rule for every version flag (``serve --initial-version``, ``fleet update --version``):
the text as strict JSON (:mod:`weightsync.core.validation`) when it is JSON, else the text
itself as a plain string, so ``--version step-3`` and ``--version '"step-3"'`` name the same
version and ``--version 7`` names the number 7.  Either way the value must be one every reply
can write back (:func:`weightsync.core.snapshot.json_problem`).

One rule for every API-key flag (``serve``, ``router``, ``fleet``): the flag, else its
environment variable, else no key; an empty key (which would let a bare ``Bearer`` in) and
one no HTTP client can send in an ``Authorization`` header are refused before anything starts.

The flags every server takes (``serve``, ``router``): where it binds (:func:`add_bind_arguments`)
and which Host names a loopback request may carry (:func:`add_allowed_host_argument`).

One variable for tests alone: ``$WEIGHTSYNC_TEST_CLOCK_OFFSET_S`` shifts a worker's clock
(:func:`worker_clock`).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Callable
from typing import Final

from weightsync.core.errors import InvalidRequest
from weightsync.core.snapshot import JSONValue, json_problem
from weightsync.core.validation import strict_loads


def version_argument(flag: str, text: str) -> JSONValue:
    """The version ``text`` names on the command line (``flag`` names it in errors).

    Raises ``InvalidRequest`` (``invalid_value``) for a value no reply can write back (a lone
    surrogate, a non-finite number, nested more than 32 deep, over 64 KiB) or nested deeper
    than the JSON parser's stack.
    """
    try:
        value: JSONValue = strict_loads(text)
    except RecursionError:
        raise InvalidRequest(
            f"{flag} is nested too deeply to parse", code="invalid_value", field=flag
        ) from None
    except ValueError:
        value = text
    problem = json_problem(value)
    if problem is not None:
        raise InvalidRequest(f"{flag} must be a JSON value: {problem}", code="invalid_value", field=flag)
    return value


API_KEY_ENV: Final = "WEIGHTSYNC_API_KEY"


def add_api_key_argument(
    parser: argparse.ArgumentParser,
    what: str,
    *,
    flag: str = "--api-key",
    env: str = API_KEY_ENV,
    otherwise: str = "none",
) -> None:
    """Add ``flag`` to ``parser``, to be read with :func:`api_key_argument`; ``what`` is its
    help, to which the default (``$env``, else ``otherwise``) is appended."""
    parser.add_argument(flag, default=None, help=f"{what} (default: ${env}, else {otherwise})")


def api_key_argument(flag: str, given: str | None, env: str = API_KEY_ENV) -> str | None:
    """The key ``flag`` gave, else the one in ``$env``, else ``None`` (no key).

    Raises ``InvalidRequest``: ``empty_api_key`` for an empty key, ``invalid_api_key`` for one
    that is not printable ASCII or has surrounding spaces (no request could ever send it).
    """
    key = os.environ.get(env) if given is None else given
    if key is None:
        return None
    if key == "":
        raise InvalidRequest(
            f"the API key is empty ({flag} or {env}): give a token, or none", code="empty_api_key"
        )
    if not (key.isascii() and key.isprintable()) or key != key.strip():
        raise InvalidRequest(
            "the API key must be printable ASCII without surrounding spaces (HTTP clients cannot "
            "send anything else in an Authorization header, so no request would ever authenticate)",
            code="invalid_api_key",
        )
    return key


def add_bind_arguments(
    parser: argparse.ArgumentParser, port: int, needs: str, port_help: str = "TCP port"
) -> None:
    """Add ``--host`` (default ``127.0.0.1``: loopback) and ``--port`` (default ``port``) to
    ``parser``; ``needs`` says what binding beyond loopback requires (``"an --api-key is"``)."""
    parser.add_argument(
        "--host", default="127.0.0.1", help=f"address to bind; beyond loopback {needs} required"
    )
    parser.add_argument("--port", type=int, default=port, help=port_help)


def add_allowed_host_argument(parser: argparse.ArgumentParser, help: str) -> None:
    """Add ``--allowed-host NAME`` (repeatable; ``[]`` by default: loopback names only) to ``parser``."""
    parser.add_argument("--allowed-host", action="append", default=[], metavar="NAME", help=help)


LOG_LEVELS: Final = ("trace", "debug", "info", "warning", "error", "critical")


def add_log_arguments(parser: argparse.ArgumentParser, info: str) -> None:
    """Add ``--log-level`` (default ``info``: ``info`` names what that level logs) and
    ``--log-format`` (``text``, or ``json``: one JSON object a line) to ``parser``."""
    parser.add_argument(
        "--log-level",
        default="info",
        choices=LOG_LEVELS,
        help=f"log level (default info: {info}; warning: problems only)",
    )
    parser.add_argument(
        "--log-format",
        default="text",
        choices=("text", "json"),
        help="log lines as text, or one JSON object a line (ts, level, logger, message and the event's fields)",
    )


TEST_CLOCK_OFFSET: Final = "WEIGHTSYNC_TEST_CLOCK_OFFSET_S"


def worker_clock() -> Callable[[], float]:
    """The worker's wall clock: ``time.time``, shifted by ``$WEIGHTSYNC_TEST_CLOCK_OFFSET_S``
    seconds only where that is set.

    The variable exists for tests alone: it starts a real worker process whose clock runs off
    the coordinator's (a minute behind, say) without touching the machine's clock, which is
    how a test proves that a fleet declaration's expiry (``not_after``) holds whatever the
    skew.  Raises ``InvalidRequest`` (``invalid_value``) unless it is a finite number.
    """
    text = os.environ.get(TEST_CLOCK_OFFSET)
    if text is None:
        return time.time
    try:
        offset = float(text)
    except ValueError:
        offset = math.nan
    if not math.isfinite(offset):
        raise InvalidRequest(
            f"{TEST_CLOCK_OFFSET} must be a number of seconds, got {text!r}", code="invalid_value"
        )
    return lambda: time.time() + offset
