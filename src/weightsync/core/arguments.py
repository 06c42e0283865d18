"""Values given on a command line, read the way the routes read a body.

One rule for every version flag (``serve --initial-version``, ``fleet update --version``):
the text as strict JSON (:mod:`weightsync.core.strictjson`) when it is JSON, else the text
itself as a plain string, so ``--version step-3`` and ``--version '"step-3"'`` name the same
version and ``--version 7`` names the number 7.  Either way the value must be one every reply
can write back (:func:`weightsync.core.values.json_problem`).
"""

from __future__ import annotations

from . import strictjson
from .errors import InvalidRequest
from .values import JSONValue, json_problem


def version_argument(flag: str, text: str) -> JSONValue:
    """The version ``text`` names on the command line (``flag`` names it in errors).

    Raises ``InvalidRequest`` (``invalid_value``) for a value no reply can write back (a lone
    surrogate, a non-finite number, nested more than 32 deep, over 64 KiB) or nested deeper
    than the JSON parser's stack.
    """
    try:
        value: JSONValue = strictjson.loads(text)
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
