"""In-process fake workers that speak the fleet's side of the worker contract.

Each :class:`FakeWorker` answers the admin routes the coordinator uses (the digest /
epoch / dry-run contract of docs/fleet.md) through an httpx ``MockTransport``, so the
coordinator runs its real HTTP code path.  Faults are switched on per worker: a refused
dry run, a crash in the middle of a load (torn, then unreachable), a hang, or weights that
land different from the checkpoint (a digest mismatch).
"""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

import attrs
import httpx

from weightsync.core.digest import weights_digest

Checkpoints = dict[str, dict[str, str]]  # path -> tensor name -> hash


def checkpoint(seed: int) -> dict[str, str]:
    return {f"layer{i}.weight": f"{seed:08x}{i:08x}" for i in range(3)}


@attrs.define
class FakeWorker:
    url: str
    store: Checkpoints
    hashes: dict[str, str]
    version: Any = None
    declared: bool = False
    epoch: int | None = None
    paused: bool = False
    torn: bool = False
    dead: bool = False
    # faults
    refuse_prepare: bool = False
    crash_on_apply: bool = False
    hang_on_apply: bool = False
    tamper_on_apply: bool = False
    calls: list[str] = attrs.field(factory=list)

    @property
    def digest(self) -> str:
        return weights_digest(self.hashes)

    def snapshot(self) -> tuple[Any, ...]:
        return (self.version, self.declared, self.epoch, self.paused, self.torn, self.digest)

    def _status(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "version": self.version,
            "version_declared": self.declared,
            "epoch": self.epoch,
            "digest": self.digest,
            "paused": self.paused,
            "torn": self.torn,
            "update_in_flight": False,
        }

    async def handle(self, route: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        self.calls.append(route)
        if route == "get_weight_version":
            return 200, self._status()
        if route == "pause_generation":
            self.paused = True
            return 200, {"status": "ok", "mode": body.get("mode", "keep")}
        if route == "resume_generation":
            if self.torn:
                return 409, {"status": "error", "code": "weights_torn", "message": "torn"}
            self.paused = False
            return 200, {"status": "ok"}
        if route == "set_weight_version":
            expected = body.get("expected_digest")
            if expected is not None and expected != self.digest:
                return 409, {"status": "error", "code": "digest_mismatch", "message": "digest differs"}
            self.version, self.declared = body["weight_version"], True
            if "epoch" in body:
                self.epoch = body["epoch"]
            return 200, {"status": "ok", "version": self.version, "version_declared": True}
        if route == "update_weights_from_disk":
            return await self._update(body)
        return 404, {"status": "error", "code": "not_found", "message": route}

    async def _update(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        path = body["model_path"]
        source = self.store.get(path)
        if source is None or (self.refuse_prepare and body.get("dry_run")):
            return 400, {"status": "error", "code": "corrupt_checkpoint", "message": f"{path} is corrupt"}
        if body.get("dry_run"):
            return 200, {"status": "ok", "dry_run": True, "digest": weights_digest(source)}
        if not self.paused:
            return 409, {"status": "error", "code": "not_paused", "message": "pause first"}
        if self.hang_on_apply:  # once: stopped mid-load, answers again after the deadline
            self.hang_on_apply = False
            await asyncio.sleep(3600)
        if self.crash_on_apply:
            self.hashes = {**self.hashes, next(iter(source)): next(iter(source.values()))}
            self.torn = True
            self.dead = True
            raise httpx.RemoteProtocolError("server disconnected")
        self.hashes = dict(source)
        if self.tamper_on_apply:  # once: someone wrote to the weights behind the control plane
            self.tamper_on_apply = False
            self.hashes[next(iter(self.hashes))] = "deadbeefdeadbeef"
        self.torn = False
        return 200, {"status": "ok", "version": "unknown", "version_declared": False, "digest": self.digest}


class FakeFleet:
    """Workers by URL, and the one httpx transport that reaches all of them."""

    def __init__(self, n: int, store: Checkpoints, initial: str) -> None:
        self.store = store
        self.workers = {
            f"http://w{i}.test": FakeWorker(
                f"http://w{i}.test", store, copy.deepcopy(store[initial]), version="v0", declared=True
            )
            for i in range(n)
        }
        self.transport = httpx.MockTransport(self._handler)

    @property
    def urls(self) -> list[str]:
        return list(self.workers)

    def __getitem__(self, i: int) -> FakeWorker:
        return list(self.workers.values())[i]

    async def _handler(self, request: httpx.Request) -> httpx.Response:
        worker = self.workers[f"{request.url.scheme}://{request.url.host}"]
        if worker.dead:
            raise httpx.ConnectError("connection refused", request=request)
        assert request.headers["content-type"] == "application/json"
        route = request.url.path.removeprefix("/engine/")
        status, reply = await worker.handle(route, json.loads(request.content or b"{}"))
        return httpx.Response(status, json=reply)

    def serving(self) -> list[FakeWorker]:
        """Workers that serve requests: reachable and running."""
        return [w for w in self.workers.values() if not w.dead and not w.paused]
