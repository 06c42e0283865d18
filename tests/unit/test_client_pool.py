"""ClientPool: one client per worker URL, kept across calls on one event loop, made anew on another."""

from __future__ import annotations

import asyncio

from weightsync.trainer.client import ClientPool

URLS = ["http://127.0.0.1:1", "http://127.0.0.1:2"]


def test_the_same_loop_gets_the_same_clients_in_url_order() -> None:
    pool = ClientPool(URLS, api_key="k", timeout=5.0)

    async def twice() -> tuple[list, list]:
        return await pool.get(), await pool.get()

    loop = asyncio.new_event_loop()
    try:
        first, second = loop.run_until_complete(twice())
        assert [c.base_url for c in first] == URLS
        assert all(a is b for a, b in zip(first, second, strict=True))
        assert all(c.timeout == 5.0 and c.http.headers["authorization"] == "Bearer k" for c in first)
        loop.run_until_complete(pool.aclose())
        assert all(c.http.is_closed for c in first)
    finally:
        loop.close()


def test_another_loop_gets_new_clients_and_the_old_ones_are_closed() -> None:
    pool = ClientPool(URLS)
    first = asyncio.run(pool.get())
    second = asyncio.run(pool.get())  # the first loop is closed by now
    assert not any(a is b for a, b in zip(first, second, strict=True))
    assert all(c.http.is_closed for c in first)
    assert not any(c.http.is_closed for c in second)
    asyncio.run(pool.aclose())
    assert all(c.http.is_closed for c in second)
