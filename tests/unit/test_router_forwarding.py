"""The router's hop to a worker treats the worker's reply as hostile: a reply that is not
strict JSON, one too large, or one trickled past the request timeout is refused with a code,
never relayed, never a 500, never a request held forever.  The workers are real loopback
HTTP servers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from aiohttp import web

from weightsync.router import forwarding
from weightsync.router.answers import Answer
from weightsync.router.forwarding import Forwarding
from weightsync.router.metrics import RouterMetrics
from weightsync.router.policy import Policy
from weightsync.router.view import FleetView

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
GUARD_S = 30.0  # a hop that never ends fails the test instead of hanging it


def polled(version: str | None = "v0", declared: bool = True) -> dict[str, Any]:
    return {
        "status": "ok", "version": version, "version_declared": declared, "epoch": None, "digest": "d0",
        "paused": False, "torn": False, "update_in_flight": False,
    }  # fmt: skip


@asynccontextmanager
async def router_over(
    handler: Handler, timeout_s: float = 10.0, poll: dict[str, Any] | None = None
) -> AsyncIterator[Forwarding]:
    """A ``Forwarding`` over two routable loopback workers that both answer with ``handler``,
    whose polls both said ``poll`` (:func:`polled`: ``"v0"`` declared), adopted as the baseline."""
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    sites = [web.TCPSite(runner, "127.0.0.1", 0) for _ in range(2)]
    for site in sites:
        await site.start()
    urls = [f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}" for site in sites]  # type: ignore[union-attr]
    view = FleetView(urls)
    replies = {u: poll or polled() for u in urls}
    seqs = {u: view.workers[u].seq for u in urls}
    view.adopt(replies)
    for u in urls:
        view.observed(u, replies[u], seqs[u])
    assert len(view.candidates()[0]) == 2
    fwd = Forwarding(
        view,
        RouterMetrics(view),
        headers={"content-type": "application/json"},
        timeout_s=timeout_s,
        poll_interval_s=0.5,
    )
    fwd.open()
    try:
        yield fwd
    finally:
        await fwd.close()
        await runner.cleanup()


def answering(raw: bytes) -> Handler:
    async def handler(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=raw, content_type="application/json")

    return handler


def route(handler: Handler, timeout_s: float = 10.0) -> Answer:
    async def run() -> Answer:
        async with router_over(handler, timeout_s) as fwd:
            return await asyncio.wait_for(
                fwd.complete({"prompt": "hi"}, Policy(), b'{"prompt":"hi"}'), GUARD_S
            )

    return asyncio.run(run())


def test_a_clean_reply_is_relayed_by_the_splice_with_its_label() -> None:
    answer = route(answering(b'{"text":"hi","weight_version":"v0","weight_version_declared":true}'))
    assert answer.status == 200 and answer.raw is not None
    assert answer.body["text"] == "hi" and answer.headers["x-weightsync-weight-version"] == '"v0"'


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(b'{"text":"hi","weight_version":"v0","logprob":NaN}', id="nan"),
        pytest.param(b'{"text":"hi","weight_version":"v0","logprob":-Infinity}', id="infinity"),
        pytest.param(b'{"text":"hi","weight_version":"v0","logprob":1e400}', id="overflow"),
        pytest.param(b'{"weight_version":"v0","text":"hi","weight_version":"v9"}', id="duplicate-version"),
        pytest.param(b'{"text":"\xed\xa0\x80","weight_version":"v0"}', id="raw-surrogate"),
        pytest.param(b'{"text":' + b"[" * 200_000 + b"]" * 200_000 + b"}", id="deep-nesting"),
        pytest.param(b'{"status":"error","code":"x","message":NaN}', id="nan-in-an-error-reply"),
    ],
)
def test_a_reply_that_is_not_strict_json_is_a_bad_reply(raw: bytes) -> None:
    answer = route(answering(raw))
    assert (answer.status, answer.body["code"]) == (502, "bad_reply")
    assert answer.raw is None and answer.body["worker"].startswith("http://127.0.0.1:")


def test_a_reply_streamed_past_the_cap_is_a_bad_reply(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(forwarding, "MAX_REPLY_BYTES", 1 << 20, raising=False)
    sent: list[int] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"content-type": "application/json"})
        response.enable_chunked_encoding()  # no Content-Length: only counting the bytes catches it
        await response.prepare(request)
        await response.write(b'{"text":"')
        for _ in range(8):
            await response.write(b"a" * (256 << 10))
            sent.append(1)
        await response.write(b'","weight_version":"v0"}')
        return response

    answer = route(handler)
    assert sent  # the worker did stream
    assert (answer.status, answer.body["code"]) == (502, "bad_reply")
    assert "more than" in answer.body["message"]


def test_a_reply_declaring_a_length_past_the_cap_is_refused_before_reading(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(forwarding, "MAX_REPLY_BYTES", 1 << 20, raising=False)
    body = b'{"text":"' + b"a" * (2 << 20) + b'","weight_version":"v0"}'
    answer = route(answering(body))
    assert (answer.status, answer.body["code"]) == (502, "bad_reply")
    assert "declares" in answer.body["message"]


def test_a_worker_trickling_its_reply_hits_the_deadline_and_counts_as_failed() -> None:
    hits: list[str] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        hits.append(request.host)
        response = web.StreamResponse(headers={"content-type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        await response.write(b'{"text":"')
        try:
            while True:  # a byte well within every read timeout, forever
                await response.write(b"a")
                await asyncio.sleep(0.05)
        except ConnectionResetError:  # the router hung up: the point of the test
            return response

    answer = route(handler, timeout_s=1.0)
    assert (answer.status, answer.body["code"]) == (502, "worker_failed")
    assert len(hits) == 2 and len(set(hits)) == 2  # retried once elsewhere, then gave up
    assert answer.body["worker"].startswith("http://127.0.0.1:")


def route_twice(
    handlers: list[Handler], body: dict[str, Any] | None = None, poll: dict[str, Any] | None = None
) -> tuple[Answer, dict[str, str]]:
    """Two workers polled as ``poll``, worker ``i`` answering with ``handlers[i]``; one request
    (whose first pick is worker 0); the answer and every worker's routing state after it."""
    calls = iter(range(10))

    async def handler(request: web.Request) -> web.StreamResponse:
        return await handlers[min(next(calls), len(handlers) - 1)](request)

    async def run() -> tuple[Answer, dict[str, str]]:
        async with router_over(handler, poll=poll) as fwd:
            answer = await asyncio.wait_for(fwd.complete(body or {"prompt": "hi"}, Policy(), None), GUARD_S)
            return answer, {u: w.state for u, w in fwd.view.workers.items()}

    return asyncio.run(run())


ROGUE = b'{"text":"hi","weight_version":"rogue","weight_version_declared":true}'
CLEAN = b'{"text":"hi","weight_version":"v0","weight_version_declared":true}'


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(ROGUE, id="another-version"),
        pytest.param(b'{"text":"hi","weight_version":"v0","weight_version_declared":false}', id="undeclared"),
        pytest.param(
            b'{"text":"hi","weight_version":"v0","weight_version_declared":true,"weight_version_current":false}',
            id="label-kept-over-new-weights",
        ),
        pytest.param(
            b'{"text":"hi","weight_version":"v0","weight_version_declared":true,"weight_version_spans":'
            b'[{"version":"v0","version_declared":true},{"version":"v9","version_declared":true}]}',
            id="a-span-of-other-weights",
        ),
        pytest.param(
            b'{"text":"hi","weight_version":"v0","weight_version_declared":true,"weight_version_spans":'
            b'[{"version":"v0","version_declared":true,"version_current":true},'
            b'{"version":"v0","version_declared":true,"version_current":false}]}',
            id="a-span-under-the-label-of-weights-it-no-longer-describes",
        ),
        pytest.param(
            b'{"text":"hi","weight_version":"v0","weight_version_declared":true,"weight_version_spans":'
            b'[{"version":"v0","version_declared":true,"version_current":true,"digest":"d1"}]}',
            id="a-span-of-another-digest-under-the-label",
        ),
    ],
)
def test_a_reply_naming_uncommitted_weights_fences_the_worker_and_is_retried_elsewhere(raw: bytes) -> None:
    answer, states = route_twice([answering(raw), answering(CLEAN)])
    assert answer.status == 200 and answer.body["weight_version"] == "v0"
    assert sorted(states.values()) == ["fenced", "routable"]


# What a fresh worker that was never declared stamps: no version, and a label that is not
# "current" (a worker says so of every undeclared label), over the weights of digest d0.
UNDECLARED_POLL = polled(None, declared=False)
UNDECLARED = (
    b'{"text":"hi","weight_version":null,"weight_version_declared":false,"weight_version_current":false,'
    b'"weight_version_spans":[{"version":null,"version_declared":false,"version_current":false,"digest":"d0"}]}'
)
UNDECLARED_SPAN_D1 = b'{"version":null,"version_declared":false,"version_current":false,"digest":"d1"}'


def test_an_undeclared_baseline_is_served_from_replies_stamped_as_undeclared_workers_stamp_them() -> None:
    answer, states = route_twice([answering(UNDECLARED)], poll=UNDECLARED_POLL)
    assert (
        answer.status == 200 and answer.body["weight_version"] is None and answer.body["weight_epoch"] is None
    )
    assert answer.headers["x-weightsync-weight-version"] == "null"
    assert set(states.values()) == {"routable"}


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(
            b'{"text":"hi","weight_version":null,"weight_version_declared":true}', id="declared-null"
        ),
        pytest.param(
            b'{"text":"hi","weight_version":"default","weight_version_declared":false}', id="another-value"
        ),
        pytest.param(
            UNDECLARED.replace(b'"digest":"d0"', b'"digest":"d1"'), id="a-span-of-another-digest-undeclared"
        ),
        pytest.param(
            UNDECLARED.replace(b'"digest":"d0"}', b'"digest":"d0"},' + UNDECLARED_SPAN_D1),
            id="weights-loaded-mid-request-without-a-declaration",
        ),
    ],
)
def test_under_an_undeclared_baseline_a_reply_naming_other_weights_is_still_fenced(raw: bytes) -> None:
    answer, states = route_twice([answering(raw), answering(UNDECLARED)], poll=UNDECLARED_POLL)
    assert answer.status == 200 and answer.body["weight_version"] is None
    assert sorted(states.values()) == ["fenced", "routable"]


def test_when_every_reply_names_uncommitted_weights_nothing_is_relayed_and_it_is_a_503() -> None:
    answer, states = route_twice([answering(ROGUE)])
    assert (answer.status, answer.body["code"]) == (503, "reply_mismatch")
    assert answer.headers["retry-after"] == "1" and "rogue" not in json.dumps(answer.body)
    assert set(states.values()) == {"fenced"}


def _span(version: str, digest: str, first: int, last: int) -> dict[str, Any]:
    return {
        "version": version, "version_declared": True, "version_current": True, "digest": digest,
        "first_token": first, "last_token": last,
    }  # fmt: skip


def _reply(*spans: dict[str, Any]) -> bytes:
    body = {
        "text": "hi", "weight_version": spans[0]["version"], "weight_version_declared": True,
        "weight_version_current": True, "weight_version_spans": list(spans),
    }  # fmt: skip
    return json.dumps(body).encode()


def route_across_a_commit(raw: bytes, policy: Policy) -> tuple[Answer, dict[str, str]]:
    """Route one request; each worker, as it answers, has had the fleet commit v1 (digest d1,
    epoch 2) for it since it was picked on v0 — a push that landed mid-request."""
    from weightsync.router._state import Label

    async def run() -> tuple[Answer, dict[str, str]]:
        holder: dict[str, Forwarding] = {}

        async def handler(request: web.Request) -> web.Response:
            await request.read()
            view = holder["fwd"].view
            view.committed[f"http://127.0.0.1:{request.url.port}"] = Label(True, "v1", 2, "d1")
            return web.Response(body=raw, content_type="application/json")

        async with router_over(handler) as fwd:
            holder["fwd"] = fwd
            answer = await asyncio.wait_for(fwd.complete({"prompt": "hi"}, policy, None), GUARD_S)
            return answer, {u: w.state for u, w in fwd.view.workers.items()}

    return asyncio.run(run())


def test_a_reply_whose_tokens_cross_into_the_workers_next_commit_is_relayed() -> None:
    """Failed on the previous code (``503 reply_mismatch``, both workers fenced): async RL's
    samples cross versions when a push lands mid-request, and each span named weights the
    fleet committed for that worker, the one it was picked on and then the next."""
    answer, states = route_across_a_commit(_reply(_span("v0", "d0", 0, 1), _span("v1", "d1", 2, 3)), Policy())
    assert answer.status == 200, answer.body
    assert [s["version"] for s in answer.body["weight_version_spans"]] == ["v0", "v1"]
    assert answer.headers["x-weightsync-weight-version"] == '"v0"'  # stamped as the reply is: its first
    assert set(states.values()) == {"routable"}


@pytest.mark.parametrize(
    ("raw", "policy"),
    [
        pytest.param(
            _reply(_span("v0", "d0", 0, 1), _span("v1", "d9", 2, 3)), Policy(), id="next-of-another-digest"
        ),
        pytest.param(
            _reply(_span("v0", "d0", 0, 1), _span("v2", "d1", 2, 3)), Policy(), id="next-never-committed"
        ),
        pytest.param(
            _reply(_span("v1", "d1", 0, 1), _span("v0", "d0", 2, 3)), Policy(), id="back-to-the-older-commit"
        ),
        pytest.param(
            _reply(_span("v0", "d0", 0, 1), _span("v1", "d1", 2, 3)), Policy(version="v0"), id="pinned-to-v0"
        ),
    ],
)
def test_a_crossing_reply_the_fleet_or_the_request_does_not_allow_is_fenced(
    raw: bytes, policy: Policy
) -> None:
    answer, states = route_across_a_commit(raw, policy)
    assert answer.status == 503 and answer.body["code"] == "reply_mismatch", answer.body
    assert set(states.values()) == {"fenced"}
