"""Completion forwarding: pick a worker for each request under its freshness policy, send
it on, retry once elsewhere if the worker fails before answering, and label the reply with
the weights that served it.

This is the router's hot path, so the hop to the worker is an ``aiohttp`` session rather
than the ``httpx`` client the rest of weightsync uses: it writes a request in one send and
parses the reply in C, which on loopback cuts the hop's cost several times over (measured
by ``benchmarks/router.py``).  The reply is parsed once, strictly (no ``NaN``, no repeated
keys, no stray surrogates), to read its label and check it is a JSON object, and relayed as
the worker's bytes with the router's two fields spliced in.  A worker's reply is bounded: at
most ``MAX_REPLY_BYTES`` (else ``bad_reply``), and the whole hop within the router's request
timeout (else the worker counts as failed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections import Counter
from typing import Any, Final

import aiohttp

from weightsync.core.errors import WeightSyncError
from weightsync.core.snapshot import json_problem
from weightsync.core.validation import strict_loads
from weightsync.router._state import Label, canonical
from weightsync.router.answers import Answer, NoWorker, Reply, WorkerFailed, error_answer
from weightsync.router.bounded import TooLarge, read_bounded
from weightsync.router.logs import Refusals
from weightsync.router.metrics import RouterMetrics
from weightsync.router.policy import BODY_FIELDS, Policy, Refusal, choose
from weightsync.router.streams import StreamFailed, Upstream, first_data, first_event
from weightsync.router.view import FleetView

__all__ = ["MAX_REPLY_BYTES", "Forwarding", "labelled"]

MAX_REPLY_BYTES: Final = 64 << 20
"""The largest completion reply the router reads from a worker (a bigger one is ``bad_reply``)."""


async def _read_reply(response: aiohttp.ClientResponse) -> bytes:
    """A worker's reply, refused (``TooLarge``) past ``MAX_REPLY_BYTES``."""
    return await read_bounded(
        response.headers.get("content-length"), response.content.iter_any(), MAX_REPLY_BYTES
    )


def _parse(raw: bytes) -> Any:
    """The reply as strict JSON, or ``None`` when it is not (bad bytes, too deep)."""
    try:
        # Decoded strictly first: ``json.loads`` of bytes lets lone surrogates through.
        return strict_loads(raw.decode(json.detect_encoding(raw)), finite=True)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None


class Forwarding:
    """Routes completions over the workers of ``view`` through a session of its own.

    ``headers``: sent with every request.  ``timeout_s``: the bound of each hop.
    ``poll_interval_s``: how often the poller reads the workers (a refusal's ``Retry-After``).
    """

    def __init__(
        self,
        view: FleetView,
        metrics: RouterMetrics,
        *,
        headers: dict[str, str],
        timeout_s: float,
        poll_interval_s: float,
    ) -> None:
        self.view = view
        self.metrics = metrics
        self.timeout_s = timeout_s
        self.poll_interval_s = poll_interval_s
        self._headers = headers
        self._session: aiohttp.ClientSession | None = None
        self.refusals = Refusals()

    def open(self) -> None:
        """Open the session (on the loop that routes).

        Each connect, and each wait for the worker's next bytes, is bounded by the hop's
        timeout.  Idle connections are dropped after 2 s, before a worker's server would close
        them (uvicorn: 5 s), so a request never races a server-side close on a reused
        connection.
        """
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=1024, keepalive_timeout=2.0),
            headers=self._headers,
            timeout=aiohttp.ClientTimeout(
                total=None, connect=self.timeout_s, sock_connect=self.timeout_s, sock_read=self.timeout_s
            ),
            auto_decompress=False,
        )

    async def close(self) -> None:
        """Close the session (nothing to do when never opened)."""
        if self._session is not None:
            await self._session.close()

    def retry_after(self) -> str:
        """The ``Retry-After`` of a refusal: one poll interval, at least a second."""
        return str(max(1, math.ceil(self.poll_interval_s)))

    async def complete(
        self, body: Reply, policy: Policy, raw: bytes | None = None, path: str = "/v1/completions"
    ) -> Answer | Upstream:
        """Route one generation request to ``path`` on a worker: ``body`` is the request's
        JSON object, ``raw`` its bytes (forwarded as they are when the body has no freshness
        fields, which are dropped).  A request with ``"stream": true`` that the worker answers
        with a stream is an :class:`~weightsync.router.streams.Upstream` to relay."""
        session = self._session
        assert session is not None, "the session is not open"
        if raw is None or any(k in body for k in BODY_FIELDS):
            raw = json.dumps({k: v for k, v in body.items() if k not in BODY_FIELDS}).encode()
        payload = raw
        stream = body.get("stream") is True
        failed: list[str] = []
        mismatched: list[str] = []
        for _ in range(2):
            candidates, start = self.view.candidates()
            newest = self.view.newest_epoch
            pick = choose(candidates, policy, newest, exclude=frozenset(failed), start=start)
            if isinstance(pick, Refusal):
                return self._refuse(pick, failed, mismatched, policy)
            worker = self.view.workers[pick.url]
            worker.in_flight += 1
            owned = False
            try:
                # The whole hop is bounded: a worker trickling its reply counts as failing.
                if stream:
                    opened = await self._open_stream(session, f"{pick.url}{path}", payload)
                    if isinstance(opened, Upstream):
                        data = first_data(opened.first)
                        labels = (
                            self._served_labels(pick.url, pick.label, _stamps(data))
                            if isinstance(data, dict)
                            else None
                        )
                        if labels is None or not all(policy.allows(lb, newest) for lb in labels):
                            opened.response.close()  # not a byte of it is relayed: as for a whole reply
                            self._fence(pick.url, failed, mismatched)
                            continue
                        owned = True  # the relay gives the in-flight count back when it ends
                        return self._streamed(pick.url, labels[0], opened, worker)
                    status, body_bytes = opened
                else:
                    async with (
                        asyncio.timeout(self.timeout_s),
                        session.post(f"{pick.url}{path}", data=payload) as response,
                    ):
                        status, body_bytes = response.status, await _read_reply(response)
            except TooLarge as exc:
                self.metrics.routed_to(pick.url, "worker_error").inc()
                too_large = WorkerFailed(f"{pick.url} answered with a reply that {exc}", code="bad_reply")
                return error_answer(too_large, worker=pick.url)
            except (aiohttp.ClientError, asyncio.TimeoutError, StreamFailed) as exc:
                failed.append(pick.url)
                if isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError):
                    # Nobody is listening: out of routing now.  A connection that broke
                    # mid-request may be a dying worker or one dropped socket: the poller decides.
                    self.view.failed(pick.url, "unreachable")
                self.metrics.routed_to(pick.url, "failed").inc()
                continue
            finally:
                if not owned:
                    worker.in_flight -= 1
            reply = _parse(body_bytes)
            # SGLang's /generate answers a batch with a list of objects, its stamps in meta_info.
            batch = (
                status < 400
                and isinstance(reply, list)
                and bool(reply)
                and all(isinstance(r, dict) for r in reply)
            )
            if (not isinstance(reply, dict) and not batch) or status >= 400:
                return self._relay_error(pick.url, status, reply, body_bytes)
            labels = self._served_labels(pick.url, pick.label, _stamps(reply))
            if labels is None or not all(policy.allows(lb, newest) for lb in labels):
                # Not a byte is relayed of weights the request's policy or the fleet's
                # commits do not allow: the worker is fenced at once, the request goes elsewhere.
                self._fence(pick.url, failed, mismatched)
                continue
            return self._relay(pick.url, labels[0], status, reply, body_bytes)
        if mismatched:
            return self._refuse(Refusal("no_worker", ""), failed, mismatched, policy)
        gave_up = WorkerFailed(f"the worker(s) {failed} failed before returning anything", workers=failed)
        self.metrics.refusals.labels(gave_up.code).inc()
        self.refusals.note(gave_up.code, gave_up.message)
        return error_answer(gave_up, worker=failed[-1])

    async def models(self) -> Answer:
        """A routable worker's ``GET /v1/models`` (every worker serves the same model)."""
        session = self._session
        assert session is not None, "the session is not open"
        candidates, start = self.view.candidates()
        pick = choose(candidates, Policy(), self.view.newest_epoch, start=start)
        if isinstance(pick, Refusal):
            return self._refuse(pick, [], [], Policy())
        try:
            async with asyncio.timeout(self.timeout_s), session.get(f"{pick.url}/v1/models") as response:
                status, raw = response.status, await _read_reply(response)
        except (aiohttp.ClientError, asyncio.TimeoutError, TooLarge) as exc:
            return error_answer(
                WorkerFailed(f"{pick.url} failed: {exc}", workers=[pick.url]), worker=pick.url
            )
        reply = _parse(raw)
        if not isinstance(reply, dict):
            return error_answer(WorkerFailed(f"{pick.url} answered without a JSON object", code="bad_reply"))
        return Answer(status, reply, raw=raw)

    async def _open_stream(
        self, session: aiohttp.ClientSession, url: str, payload: bytes
    ) -> Upstream | tuple[int, bytes]:
        """Post a streaming request: the open stream once its first event came, or the
        worker's whole reply when it answered without a stream (a refusal).  Raises what the
        hop raises, ``StreamFailed`` when the stream ends before an event."""
        async with asyncio.timeout(self.timeout_s):
            response = await session.post(url, data=payload)
            try:
                if response.status != 200 or response.content_type != "text/event-stream":
                    with contextlib.closing(response):
                        return response.status, await _read_reply(response)
                first = await first_event(response)
            except BaseException:
                response.close()
                raise
        return Upstream(url, response, first, lambda: None)

    def _streamed(self, url: str, served: Label, up: Upstream, worker: Any) -> Upstream:
        """``up`` with the router's headers (the committed label its first event names),
        giving ``worker``'s in-flight count back at its end."""
        self.metrics.routed_to(url, "ok").inc()

        def release() -> None:
            worker.in_flight -= 1

        up.url, up.release = url, release
        up.headers = {
            "x-weightsync-weight-version": served.canonical_version,
            "x-weightsync-weight-epoch": "null" if served.epoch is None else str(served.epoch),
            "x-weightsync-worker": url,
        }
        return up

    def _fence(self, url: str, failed: list[str], mismatched: list[str]) -> None:
        """``url`` answered from weights the request may not get: fenced at once, and the
        request tried elsewhere."""
        failed.append(url)
        mismatched.append(url)
        self.view.mismatched(url, "reply_mismatch")
        self.metrics.routed_to(url, "mismatch").inc()

    def _served_labels(self, url: str, sent: Label, reply: Reply) -> list[Label] | None:
        """The committed labels a successful reply names, in the order its tokens came from
        them: the one the worker was picked on, then possibly the one committed for it since
        (a push that landed mid-request: async RL's samples cross versions, each span of
        weights the fleet committed for it); ``None`` when any span names other weights
        (another version, a label kept over new weights, another digest) or goes back."""
        if json_problem(reply.get("weight_version")):
            return None
        declared = reply.get("weight_version_declared") is True
        # ``weight_version_current`` says whether a declared label still describes the weights
        # (false: weights loaded under a label kept from before).  A worker reports it false
        # for as long as nothing was declared, so of an undeclared label it says nothing: there
        # the spans' digests tell the weights apart, as they do for a declared label too.
        if declared and reply.get("weight_version_current") is False:
            return None
        labels = [sent, *[c for c in (self.view.committed.get(url),) if c is not None and c != sent]]
        spans = reply.get("weight_version_spans")
        spans = spans if isinstance(spans, list) else []
        lead = spans[0].get("digest") if spans and isinstance(spans[0], dict) else None
        first = _named(labels, declared, reply.get("weight_version"), lead)  # the reply's own stamp
        served: list[Label] = []
        for sp in spans:
            if not isinstance(sp, dict) or json_problem(sp.get("version")) is not None:
                return None
            span_declared = sp.get("version_declared") is True
            if span_declared and sp.get("version_current") is False:
                return None
            label = _named(labels, span_declared, sp.get("version"), sp.get("digest"))
            if label is None or (served and labels.index(label) < labels.index(served[-1])):
                return None
            if not served or label != served[-1]:
                served.append(label)
        if first is None or (served and served[0] != first):
            return None
        return served or [first]

    def _refuse(self, refusal: Refusal, failed: list[str], mismatched: list[str], policy: Policy) -> Answer:
        if mismatched:  # a reply named weights the request may not get: fenced, none relayed
            exc: WeightSyncError = NoWorker(
                f"{mismatched[0]} answered from weights the fleet did not commit or the request's "
                f"policy does not allow (the request asked for {policy.describe()}); it is fenced and nothing of its "
                "reply was relayed",
                code="reply_mismatch",
            )
            self.metrics.refusals.labels(exc.code).inc()
            self.refusals.note(exc.code, exc.message)
            return error_answer(exc, {"retry-after": self.retry_after()}, worker=mismatched[0])
        if failed:  # nobody else qualifies for the retry
            exc = WorkerFailed(
                f"{failed[0]} failed before returning anything, and no other worker qualifies "
                f"({refusal.message})",
                workers=failed,
            )
            self.metrics.refusals.labels(exc.code).inc()
            self.refusals.note(exc.code, exc.message)
            return error_answer(exc, worker=failed[0])
        self.metrics.refusals.labels(refusal.code).inc()
        message = refusal.message
        if refusal.code == "no_worker":
            states = Counter(w.state for w in self.view.workers.values())
            message = (
                "no worker is routable now (" + ", ".join(f"{n} {s}" for s, n in sorted(states.items())) + ")"
            )
        self.refusals.note(refusal.code, message)
        return error_answer(NoWorker(message, code=refusal.code), {"retry-after": self.retry_after()})

    def _relay_error(self, url: str, status: int, reply: Any, raw: bytes) -> Answer:
        self.metrics.routed_to(url, "worker_error").inc()
        if not isinstance(reply, dict):
            exc = WorkerFailed(f"{url} answered HTTP {status} without a JSON object", code="bad_reply")
            return error_answer(exc, worker=url)
        return labelled(status, reply, raw, {"worker": url})

    def _relay(self, url: str, served: Label, status: int, reply: Any, raw: bytes) -> Answer:
        self.metrics.routed_to(url, "ok").inc()
        headers = {
            "x-weightsync-weight-version": served.canonical_version,
            "x-weightsync-weight-epoch": "null" if served.epoch is None else str(served.epoch),
        }
        if isinstance(reply, list):  # SGLang's batch: relayed as it is, labelled by headers
            return Answer(status, {}, {**headers, "x-weightsync-worker": url}, raw=raw)
        return labelled(status, reply, raw, {"worker": url, "weight_epoch": served.epoch}, headers)


def _stamps(reply: Any) -> Reply:
    """Where a reply carries its weight stamps: the object itself, or SGLang's ``meta_info``
    (of the first sequence of a batch; every sequence of one request ran on one worker)."""
    first = reply[0] if isinstance(reply, list) else reply
    meta = first.get("meta_info")
    if not isinstance(meta, dict):
        return dict(first)
    if meta.get("weight_version_declared") is not True:  # SGLang says "default" while undeclared
        return {**meta, "weight_version": None}
    return meta


def labelled(
    status: int, reply: Reply, raw: bytes, fields: Reply, headers: dict[str, str] | None = None
) -> Answer:
    """The worker's ``reply`` (parsed from ``raw``) with ``fields`` set, as an answer.

    The answer's bytes are ``raw`` with the fields spliced in before its closing brace, which
    reads exactly as ``reply`` updated with them and dumped again (the fields are new keys,
    added last); when a field is already there, or ``raw`` is not plain UTF-8, it is dumped
    again.  (``raw`` repeats no key: the reply is parsed strictly, so every reader of the
    relayed bytes reads the one value the router read.)
    """
    fresh = not any(k in reply for k in fields)
    reply.update(fields)
    body = raw.rstrip()
    # (A byte-order mark reads as "utf-8-sig", UTF-16 and UTF-32 as themselves.)
    if not fresh or not body.endswith(b"}") or json.detect_encoding(body) != "utf-8":
        return Answer(status, reply, headers or {})
    tail = json.dumps(fields, separators=(",", ":")).encode()
    spliced = body[:-1] + (b"," if len(reply) > len(fields) else b"") + tail[1:]
    return Answer(status, reply, headers or {}, raw=spliced)


def _named(labels: list[Label], declared: bool, version: Any, digest: Any) -> Label | None:
    """The first of ``labels`` a stamp names: the same declaredness and version, and the
    label's digest where both are known."""
    for label in labels:
        if (
            label.declared == declared
            and label.canonical_version == canonical(version)
            and (label.digest is None or digest in (None, label.digest))
        ):
            return label
    return None
