"""Retry-safe updates: an update that carries an idempotency key is carried out once.

HTTP clients retry: TRL's session retries a POST three times on 500, 502 and 503, and an
operator re-sends an update whose answer was lost.  Run twice, an update re-joins a
collective no trainer feeds, or applies a delta twice.  So an update may carry a key — the
body's ``idempotency_key``, or the ``Idempotency-Key`` header (:data:`HEADER_KEY`, set by the
front door for the request) — and the worker keeps a record per key (:class:`Records`):

- the first request with a key runs; its reply (or refusal) is recorded with the digest the
  worker held before (``base_digest``) and after (``target_digest``);
- a repeat with the same key and the same body is answered from the record — the same reply,
  marked ``"replayed": true``, no second collective, no second apply; a repeat that arrives
  while the first still runs waits for it and gets its answer;
- a repeat whose first attempt ended without an answer of the error family (its outcome is
  uncertain) is refused ``409 outcome_uncertain``, naming what the worker holds now;
- the same key with another body is ``409 idempotency_key_reused``: it changes nothing (a
  broadcast it declared is drained, as a refused update's is: ``docs/proof.md``); a repeat
  joins no collective, since its trainer broadcast once, for the first.

A key is 1–255 printable ASCII characters (``400 invalid_value`` otherwise).  The record keeps
the last :data:`MAX_RECORDS` keys, per worker (its controller).  The front doors call
:func:`keyed_dispatch` where they would call :func:`~weightsync.core.routes.dispatch`.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import json
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, Final

import attrs

from weightsync.core import events
from weightsync.core.controller import Controller
from weightsync.core.errors import IllegalState, InvalidRequest, WeightSyncError
from weightsync.core.routes import ROUTES, declared_stream, dispatch

__all__ = [
    "FIELD",
    "HEADER_KEY",
    "KEYED",
    "MAX_RECORDS",
    "Records",
    "check_key",
    "keyed_dispatch",
    "take_key",
]

FIELD: Final = "idempotency_key"
"""The body field that carries the key (weightsync's own routes)."""

HEADER: Final = "Idempotency-Key"
"""The header alias (any route, the dialects' included)."""

HEADER_KEY: Final[contextvars.ContextVar[str | None]] = contextvars.ContextVar(
    "weightsync_idempotency_key", default=None
)
"""The request's ``Idempotency-Key`` header, set by the front door while it handles it."""

MAX_RECORDS: Final = 1024
MAX_KEY: Final = 255

Reply = dict[str, Any]


def check_key(key: Any) -> str:
    """``key`` if it is a usable key.  Raises ``InvalidRequest`` (``invalid_value``)."""
    if not (type(key) is str and 0 < len(key) <= MAX_KEY and key.isascii() and key.isprintable()):
        raise InvalidRequest(
            f"{FIELD} must be 1 to {MAX_KEY} printable ASCII characters", code="invalid_value", field=FIELD
        )
    return key


def take_key(body: Any) -> tuple[str | None, Any]:
    """The request's key (the body's field, else the header's) and the body without the field.
    Raises ``InvalidRequest`` for a bad key, or a body field and a header that differ."""
    header = HEADER_KEY.get()
    if isinstance(body, dict) and FIELD in body:
        rest = {k: v for k, v in body.items() if k != FIELD}
        key = check_key(body[FIELD])
        if header is not None and header != key:
            raise InvalidRequest(
                f"the {HEADER} header and the body's {FIELD} differ", code="conflicting_options", field=FIELD
            )
        return key, rest
    return (None if header is None else check_key(header)), body


@attrs.define
class _Entry:
    route: str
    fingerprint: str
    base_digest: str | None
    done: asyncio.Future[Reply]


class Records:
    """One worker's idempotency records (see the module)."""

    def __init__(self, limit: int = MAX_RECORDS) -> None:
        self.limit = limit
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    async def run(
        self, key: str, route: str, body: Any, held: Callable[[], Reply], call: Callable[[], Awaitable[Reply]]
    ) -> Reply:
        """``call()`` once for ``key``; a repeat answers from the record.  ``held()`` is the
        worker's state now (``get_weight_version``'s reply)."""
        fingerprint = _fingerprint(route, body)
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            if (entry.route, entry.fingerprint) != (route, fingerprint):
                raise IllegalState(
                    f"idempotency key {key!r} was used for another request ({entry.route}): nothing was done",
                    code="idempotency_key_reused",
                    field=FIELD,
                )
            reply = await asyncio.shield(entry.done)  # a repeat of a running update waits for it
            return {**reply, "replayed": True}
        loop = asyncio.get_running_loop()
        entry = _Entry(route, fingerprint, held().get("digest"), loop.create_future())
        self._entries[key] = entry
        while len(self._entries) > self.limit:
            self._entries.popitem(last=False)
        entry.done.add_done_callback(lambda f: f.cancelled() or f.exception())  # read by a repeat, if any
        try:
            reply = await call()
        except WeightSyncError as exc:
            entry.done.set_exception(exc)
            raise
        except BaseException as exc:
            now = held()
            entry.done.set_exception(
                IllegalState(
                    f"the first request with idempotency key {key!r} ended without an answer "
                    f"({type(exc).__name__}): its outcome is uncertain. The worker holds version "
                    f"{now.get('version')!r}, digest {now.get('digest')} (before it: {entry.base_digest})",
                    code="outcome_uncertain",
                    field=FIELD,
                )
            )
            raise
        entry.done.set_result(
            {
                **reply,
                "idempotency": {
                    "key": key,
                    "base_digest": entry.base_digest,
                    "target_digest": reply.get("digest"),
                },
            }
        )
        return entry.done.result()


def _fingerprint(route: str, body: Any) -> str:
    text = json.dumps([route, body], sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


KEYED: Final = frozenset({*(name for name, r in ROUTES.items() if r.update), "init_weights_update_group"})
"""The routes an idempotency key makes retry-safe: every weight update, and a group join."""

_RECORDS: Final[weakref.WeakKeyDictionary[Controller, Records]] = weakref.WeakKeyDictionary()


async def keyed_dispatch(controller: Controller, route: str, body: Any) -> Reply:
    """:func:`~weightsync.core.routes.dispatch`, once per idempotency key for the routes of
    :data:`KEYED` (see the module); any other route, or a request without a key, as it is."""
    if route not in KEYED:
        return await dispatch(controller, route, body)
    try:
        key, body = take_key(body)
    except WeightSyncError as exc:
        events.route_refused(route, exc)
        await controller.settle_refused(declared_stream(route, body))  # a trainer may be sending already
        raise
    if key is None:
        return await dispatch(controller, route, body)
    records = _RECORDS.setdefault(controller, Records())
    try:
        return await records.run(
            key,
            route,
            body,
            lambda: controller.snapshot().to_reply(),
            lambda: dispatch(controller, route, body),
        )
    except WeightSyncError as exc:
        if exc.code == "idempotency_key_reused":  # another update, never run: its stream is owed
            await controller.settle_refused(declared_stream(route, body))
        raise
