"""The thread that prepares a worker's generation requests (chat rendering and prompt
encoding, off the event loop) is stopped when the worker's app shuts down, so a worker
built and stopped in a process (a test, a Ray actor restarting its server) leaves no thread
behind.  A real reference engine, whose byte tokenizer sends requests through that thread,
behind a real loopback server."""

from __future__ import annotations

import threading

import pytest
import requests

from tests.helpers import TINY
from weightsync.core import Controller
from weightsync.engines.reference import ReferenceEngine
from weightsync.serve import ServerThread, create_app

pytestmark = pytest.mark.integration


def _preparers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("weightsync-prepare")]


def test_the_preparing_thread_ends_with_the_app() -> None:
    before = set(_preparers())
    engine = ReferenceEngine(TINY)
    assert engine.tokenizer is not None  # text goes through the preparing thread
    with ServerThread(create_app(Controller(engine))) as server:
        r = requests.post(
            f"{server.url}/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2}, timeout=60
        )
        assert r.status_code == 200, r.text
        started = [t for t in _preparers() if t not in before]
        assert len(started) == 1, started  # one thread prepared the request, and it is alive
    started[0].join(timeout=10)
    assert not started[0].is_alive()
