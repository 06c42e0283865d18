"""The fleet coordinator: one weight update across N workers as a transaction.

>>> coordinator = FleetCoordinator(["http://w1:8000", "http://w2:8000"], journal="fleet.db")
>>> result = coordinator.update_sync("/ckpts/step-3", version="step-3")
>>> result.ok, result.epoch, [w.outcome for w in result.workers]

Phases (``_state.py`` holds the table and its theory of operation): prepare (dry run
everywhere, nothing written) → apply (pause, load, reset the prefix cache, concurrently)
→ verify (every digest equals the expected one) → commit (declare the version with the
next fleet epoch, guarded by ``expected_digest``, and resume).  On failure the caller's
policy runs: ``rollback`` restores every worker that loaded to its last committed source,
``fence`` commits on the workers that verified when at least ``min_workers`` did.

Every phase is journalled before the coordinator acts on it; :meth:`recover` finishes or
rolls back a transaction whose coordinator died.  Every call to a worker is bounded by the
transaction's deadline (a hung worker counts as failed); calls that could not connect are
retried with a bounded exponential backoff.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, TypeVar
from urllib.parse import urlsplit

import attrs
import httpx

from weightsync.core.errors import EngineUnavailable, IllegalState, InvalidRequest, WeightSyncError
from weightsync.core.values import json_problem

from ._state import TERMINAL, TransactionMachine
from .journal import Journal
from .result import PAUSE_MODES, POLICIES, TransactionResult, WorkerOutcome

T = TypeVar("T")
Reply = dict[str, Any]
Source = str | Mapping[str, str]


@attrs.frozen
class Event:
    """One step as it happens: a phase change (``worker`` is None) or a worker's step."""

    phase: str
    worker: str | None
    what: str
    detail: str = ""

    def line(self) -> str:
        who = self.worker or "fleet"
        return f"[{self.phase}] {who}: {self.what}" + (f" ({self.detail})" if self.detail else "")


@attrs.frozen
class WorkerStatus:
    """A worker's answer to ``get_weight_version``, or the error that replaced it."""

    url: str
    reply: Reply | None
    error: WeightSyncError | None = None

    def get(self, key: str) -> Any:
        return None if self.reply is None else self.reply.get(key)

    @property
    def last_error(self) -> str | None:
        """The error code that replaced the reply (``unreachable``, ``timeout``, a worker's
        refusal code), else ``"torn"`` for a torn worker, else ``None``.  Workers report no
        error history of their own, so nothing older than this one call is known."""
        if self.error is not None:
            return self.error.code
        return "torn" if self.get("torn") else None

    def to_json(self) -> dict[str, Any]:
        """``url``, the worker's ``version``, ``epoch``, ``digest``, ``paused``, ``torn``,
        ``update_in_flight`` (each ``None`` when it did not answer) and ``last_error``."""
        out: dict[str, Any] = {"url": self.url}
        out.update({k: self.get(k) for k in _STATUS_KEYS})
        out["last_error"] = self.last_error
        return out


_STATUS_KEYS: Final = ("version", "epoch", "digest", "paused", "torn", "update_in_flight")

# The longest deadline a transaction may have: a day.  A longer one (``1e300``) would act as
# no deadline at all, which a transaction must never have.
MAX_DEADLINE_S: Final = 86400.0


def worker_url(url: Any) -> str:
    """``url`` as a worker base URL (trailing slashes dropped).

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
        parts.port  # noqa: B018 - raises ValueError for a port out of range
    except ValueError as exc:
        raise bad(f"does not parse ({exc})") from None
    if parts.scheme not in ("http", "https"):
        raise bad("is not an http:// or https:// URL")
    if not parts.hostname:
        raise bad("names no host")
    if "@" in parts.netloc:
        raise bad("carries credentials (use --api-key)")
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        raise bad("has a query or fragment")
    return url.rstrip("/")


def checkpoint_digest(path: str) -> str | None:
    """The digest a worker holds after loading the checkpoint at ``path``, computed here.

    The hashes are :func:`weightsync.trainer.checkpoint.checkpoint_hashes`: the checkpoint is
    opened and checked by the disk channel's own reader (no FIFO can block it, no JSON can
    be too deep or too large), then the digest is taken from the writer's per-tensor hashes
    (manifest ``tensors``, as the workers do) or else hashed from the shards with bounded
    reads.  ``None`` ("unknown") on any failure: the path is not
    readable from this machine, the checkpoint is refused, or the disk transport (torch,
    xxhash) is not installed; the workers' dry runs then say which digest to expect, or what
    is wrong with the checkpoint.
    """
    try:
        return _checkpoint_digest(path)
    except Exception:  # unknown is always safe: the dry runs still decide, before any write
        return None


def _checkpoint_digest(path: str) -> str | None:
    from weightsync.core.digest import weights_digest
    from weightsync.trainer.checkpoint import checkpoint_hashes

    return weights_digest(checkpoint_hashes(path))


class _Deadline:
    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        return self.at - time.monotonic()


class _Txn:
    """One transaction's working state (the durable part is the journal's spec)."""

    def __init__(self, machine: TransactionMachine, txn: int, spec: dict[str, Any]) -> None:
        self.machine = machine
        self.id = txn
        self.spec = spec
        self.errors: dict[str, WeightSyncError] = {}
        self.digests: dict[str, str | None] = {}
        self.outcomes: dict[str, str] = {}
        self.sent: set[str] = set()  # workers an update was sent to (it may have written)

    @property
    def urls(self) -> list[str]:
        return list(self.spec["workers"])

    def fail(self, url: str, exc: WeightSyncError) -> None:
        self.errors.setdefault(url, exc)


class FleetCoordinator:
    """Runs fleet transactions over ``workers`` (base URLs like ``http://10.0.0.5:8000``).

    ``journal``: a :class:`Journal` or a file path (``None``: in memory, no recovery).
    ``transport``: an httpx async transport (tests pass in-process fakes).
    ``initial_source``: where to roll back to before the journal has a committed source
    (one path, or one per worker).  ``on_event`` sees every step as it happens.
    """

    def __init__(
        self,
        workers: Sequence[str],
        *,
        journal: Journal | str | Path | None = None,
        api_key: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        retries: int = 2,
        backoff_s: float = 0.05,
        max_backoff_s: float = 1.0,
        cleanup_s: float = 60.0,
        initial_source: Source | None = None,
        on_event: Callable[[Event], None] | None = None,
    ) -> None:
        if isinstance(workers, str):
            raise InvalidRequest("workers is a list of base URLs, not one string", code="invalid_value")
        urls = [worker_url(u) for u in workers]
        if not urls:
            raise InvalidRequest("a fleet needs at least one worker", code="no_workers")
        if len(set(urls)) != len(urls):
            raise InvalidRequest("a worker URL is named twice", code="duplicate_worker")
        self.workers = urls
        self.journal = journal if isinstance(journal, Journal) else Journal(journal or ":memory:")
        self.api_key = api_key
        self.transport = transport
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.cleanup_s = cleanup_s
        self.initial_source = initial_source
        self.on_event = on_event
        self._http: httpx.AsyncClient | None = None

    # ------------------------------------------------------------------ plumbing

    def _emit(self, phase: str, worker: str | None, what: str, detail: str = "") -> None:
        if self.on_event is not None:
            self.on_event(Event(phase, worker, what, detail))

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            from weightsync.trainer.client import async_transport

            headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._http = httpx.AsyncClient(headers=headers, transport=self.transport or async_transport())
        return self._http

    async def _session(self, work: Callable[[], Awaitable[T]]) -> T:
        try:
            return await work()
        finally:
            if self._http is not None:
                await self._http.aclose()
                self._http = None

    async def _call(self, url: str, route: str, body: Reply, deadline: _Deadline) -> Reply:
        """POST one admin route, bounded by ``deadline``; connection failures are retried.

        Raises the error family: the worker's refusal, or ``EngineUnavailable`` with code
        ``unreachable`` (no connection after the retries) or ``timeout`` (no answer in time).
        """
        from weightsync.trainer.client import raise_for_reply

        attempt = 0
        while True:
            left = deadline.left()
            if left <= 0:
                raise EngineUnavailable(f"{url}: no time left for {route}", code="timeout", url=url)
            try:
                response = await asyncio.wait_for(
                    self._client().post(f"{url}/engine/{route}", json=body, timeout=left), left
                )
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                backoff = min(self.max_backoff_s, self.backoff_s * 2**attempt)
                if attempt >= self.retries or backoff >= deadline.left():
                    raise EngineUnavailable(f"{url}: {exc}", code="unreachable", url=url) from None
                attempt += 1
                await asyncio.sleep(backoff)
                continue
            except (httpx.TimeoutException, asyncio.TimeoutError):
                raise EngineUnavailable(
                    f"{url}: {route} did not answer in time", code="timeout", url=url
                ) from None
            except httpx.HTTPError as exc:
                raise EngineUnavailable(f"{url}: {exc!r}", code="unreachable", url=url) from None
            try:
                reply = response.json()
            except ValueError:
                reply = None
            return raise_for_reply(response.status_code, reply, url)

    async def _each(
        self, urls: Sequence[str], step: Callable[[str], Awaitable[T]]
    ) -> tuple[dict[str, T], dict[str, WeightSyncError]]:
        results = await asyncio.gather(*(step(u) for u in urls), return_exceptions=True)
        done: dict[str, T] = {}
        failed: dict[str, WeightSyncError] = {}
        for url, result in zip(urls, results, strict=True):
            if isinstance(result, WeightSyncError):
                failed[url] = result
            elif isinstance(result, BaseException):
                if not isinstance(result, Exception):
                    raise result
                # Not the worker's fault, nor the network's: never report it as unreachable.
                failed[url] = WeightSyncError(
                    f"{url}: the coordinator failed locally: {type(result).__name__}: {result}",
                    code="coordinator_error",
                    url=url,
                )
            else:
                done[url] = result
        return done, failed

    def _phase(self, txn: _Txn, trigger: str) -> str:
        """Fire ``trigger`` and journal the new phase *before* anything acts on it."""
        phase = txn.machine.fire(trigger)
        self.journal.record(txn.id, phase, txn.spec)
        self._emit(phase, None, trigger)
        return phase

    def _note(self, txn: _Txn, url: str, what: str, detail: str = "") -> None:
        self.journal.note(txn.id, txn.machine.phase, url, what, detail or None)
        self._emit(txn.machine.phase, url, what, detail)

    def _failed(self, txn: _Txn, url: str, exc: WeightSyncError) -> None:
        txn.fail(url, exc)
        self._note(txn, url, "failed", f"{exc.code}: {exc.message}")

    # ------------------------------------------------------------------ status

    async def astatus(self, deadline_s: float = 10.0) -> list[WorkerStatus]:
        """Every worker's ``get_weight_version`` reply (or its error), in worker order."""

        async def work() -> list[WorkerStatus]:
            deadline = _Deadline(deadline_s)
            done, failed = await self._each(
                self.workers, lambda u: self._call(u, "get_weight_version", {}, deadline)
            )
            return [WorkerStatus(u, done.get(u), failed.get(u)) for u in self.workers]

        return await self._session(work)

    def status(self, deadline_s: float = 10.0) -> list[WorkerStatus]:
        return asyncio.run(self.astatus(deadline_s))

    # ------------------------------------------------------------------ update

    def _paths(self, source: Source) -> dict[str, str]:
        if isinstance(source, str):
            return dict.fromkeys(self.workers, source)
        paths = {u.rstrip("/"): p for u, p in source.items()}
        if set(paths) != set(self.workers):
            raise InvalidRequest(
                "a per-worker source must name exactly the fleet's workers", code="bad_source"
            )
        return {u: paths[u] for u in self.workers}

    def _rollback_source(self, url: str) -> str | None:
        committed = self.journal.committed(url)
        if committed is not None and committed.get("path"):
            return str(committed["path"])
        if self.initial_source is None:
            return None
        return self._paths(self.initial_source)[url]

    async def update(
        self,
        source: Source,
        version: Any,
        *,
        policy: str = "rollback",
        min_workers: int | None = None,
        pause_mode: str = "keep",
        deadline_s: float = 600.0,
        expected_digest: str | None = None,
    ) -> TransactionResult:
        """Run one transaction from a disk checkpoint (one path, or one per worker URL).

        Returns the :class:`TransactionResult` (``committed``/``ok`` when it committed
        everywhere, or fenced with at least ``min_workers`` committed).  ``deadline_s`` is at
        most :data:`MAX_DEADLINE_S` (a day).
        Raises ``InvalidRequest`` for bad arguments, before anything is journalled or sent.
        """
        if policy not in POLICIES:
            raise InvalidRequest(f"policy must be one of {POLICIES}, got {policy!r}", code="invalid_value")
        if pause_mode not in PAUSE_MODES:
            raise InvalidRequest(f"pause mode must be one of {PAUSE_MODES}", code="invalid_value")
        if min_workers is None:
            min_workers = len(self.workers) // 2 + 1
        if not 1 <= min_workers <= len(self.workers):
            raise InvalidRequest(
                f"min_workers must be between 1 and {len(self.workers)}, got {min_workers}",
                code="invalid_value",
            )
        if not (0 < deadline_s <= MAX_DEADLINE_S and math.isfinite(deadline_s)):
            raise InvalidRequest(
                f"deadline_s must be a number of seconds in (0, {MAX_DEADLINE_S:g}], got {deadline_s}",
                code="invalid_value",
            )
        paths = self._paths(source)
        # The workers' own rules: a version one of them would refuse (or one this process
        # cannot even encode) must be refused here, before any worker loads anything.
        problem = json_problem(version)
        if problem is not None:
            raise InvalidRequest(f"version is not a storable JSON value: {problem}", code="invalid_value")
        spec: dict[str, Any] = {
            "version": version,
            "policy": policy,
            "min_workers": min_workers,
            "pause_mode": pause_mode,
            "expected_digest": expected_digest,
            "epoch": None,
            "workers": {u: {"path": paths[u]} for u in self.workers},
        }
        machine = TransactionMachine()
        phase = machine.fire("begin")
        txn = _Txn(machine, self.journal.begin(phase, spec), spec)
        self._emit(phase, None, "begin", f"txn {txn.id}, version {json.dumps(version)}")
        return await self._session(lambda: self._run(txn, _Deadline(deadline_s)))

    def update_sync(self, source: Source, version: Any, **options: Any) -> TransactionResult:
        """:meth:`update` from blocking code."""
        return asyncio.run(self.update(source, version, **options))

    async def _run(self, txn: _Txn, deadline: _Deadline) -> TransactionResult:
        if not await self._prepare(txn, deadline):
            self._phase(txn, "refuse")
            return self._result(txn, "prepare_refused")
        self._phase(txn, "prepared")
        loaded = await self._apply(txn, deadline)
        policy, quorum = txn.spec["policy"], txn.spec["min_workers"]
        if len(loaded) < len(txn.urls) and (policy == "rollback" or len(loaded) < quorum):
            self._phase(txn, "fail")
            return await self._rollback(txn, _Deadline(self.cleanup_s))
        self._phase(txn, "applied")
        verified = await self._verify(txn, loaded, deadline)
        if len(verified) < len(txn.urls):
            return await self._fail_or_fence(txn, verified, policy, quorum)
        self._phase(txn, "verified")
        committed = await self._commit(txn, txn.urls, deadline)
        if len(committed) < len(txn.urls):
            return await self._fail_or_fence(txn, committed, policy, quorum)
        self._phase(txn, "commit_done")
        return self._result(txn)

    async def _fail_or_fence(
        self, txn: _Txn, kept: Sequence[str], policy: str, quorum: int
    ) -> TransactionResult:
        """Some workers fell out: roll everyone back, or fence the rest when the policy allows."""
        if policy == "rollback" or len(kept) < quorum:
            self._phase(txn, "fail")
            return await self._rollback(txn, _Deadline(self.cleanup_s))
        self._phase(txn, "fence")
        return await self._fence(txn, kept, _Deadline(self.cleanup_s))

    async def _prepare(self, txn: _Txn, deadline: _Deadline) -> bool:
        """Dry-run everywhere; fill in the spec (expected digest, epoch, rollback sources)."""
        spec = txn.spec

        async def one(url: str) -> tuple[Reply, Reply]:
            before = await self._call(url, "get_weight_version", {}, deadline)
            body = {"model_path": spec["workers"][url]["path"], "dry_run": True}
            dry = await self._call(url, "update_weights_from_disk", body, deadline)
            self._note(txn, url, "dry run ok", f"digest {_short(dry.get('digest'))}")
            return before, dry

        done, failed = await self._each(txn.urls, one)
        for url, exc in failed.items():
            self._failed(txn, url, exc)
            txn.outcomes[url] = "refused"
        expected = spec["expected_digest"]
        if expected is None:
            local = {checkpoint_digest(p) for p in {w["path"] for w in spec["workers"].values()}}
            if len(local) == 1 and None not in local:
                expected = local.pop()
        for url, (_, dry) in done.items():
            digest = dry.get("digest")
            if digest is None:
                continue
            if expected is None:
                expected = digest
            elif digest != expected:
                self._failed(
                    txn,
                    url,
                    IllegalState(
                        f"{url}: the dry run would hold digest {digest}, expected {expected}",
                        code="digest_mismatch",
                        url=url,
                    ),
                )
                txn.outcomes[url] = "refused"
        if txn.errors:
            return False
        epochs = [d[0].get("epoch") for d in done.values()]
        spec["expected_digest"] = expected
        spec["epoch"] = max([self.journal.last_epoch(), *(e for e in epochs if isinstance(e, int))]) + 1
        for url, (before, _) in done.items():
            spec["workers"][url]["previous"] = {
                "path": self._rollback_source(url),
                **{
                    k: before.get(k)
                    for k in ("version", "version_declared", "epoch", "digest", "paused", "torn")
                },
            }
        return True

    async def _apply(self, txn: _Txn, deadline: _Deadline) -> list[str]:
        spec = txn.spec

        async def one(url: str) -> str:
            await self._call(url, "pause_generation", {"mode": spec["pause_mode"]}, deadline)
            self._note(txn, url, "paused", spec["pause_mode"])
            body = {"model_path": spec["workers"][url]["path"], "reset_prefix_cache": True}
            txn.sent.add(url)
            reply = await self._call(url, "update_weights_from_disk", body, deadline)
            txn.digests[url] = reply.get("digest")
            self._note(txn, url, "loaded", f"digest {_short(reply.get('digest'))}")
            return url

        done, failed = await self._each(txn.urls, one)
        for url, exc in failed.items():
            self._failed(txn, url, exc)
        return [u for u in txn.urls if u in done]

    async def _attest(self, url: str, deadline: _Deadline) -> Reply:
        """The worker's digest, recomputed from the weights it serves (``verify_weights``)
        where it can, else the one it recorded while loading (``get_weight_version``).

        Raises ``IllegalState`` (``digest_mismatch``) when the recomputed digest differs
        from the recorded one: the weights were changed outside the control plane."""
        try:
            reply = await self._call(url, "verify_weights", {}, deadline)
        except WeightSyncError as exc:
            if exc.code not in ("unknown_route", "not_found", "not_supported"):
                raise
            return await self._call(url, "get_weight_version", {}, deadline)
        if reply.get("match") is not True:
            raise IllegalState(
                f"{url}: the weights served have digest {reply.get('digest')}, but the worker recorded "
                f"{reply.get('recorded_digest')}: they were changed outside the control plane",
                code="digest_mismatch",
                url=url,
            )
        return reply

    async def _verify(self, txn: _Txn, urls: Sequence[str], deadline: _Deadline) -> list[str]:
        expected = txn.spec["expected_digest"]
        done, failed = await self._each(urls, lambda u: self._attest(u, deadline))
        for url, exc in failed.items():
            self._failed(txn, url, exc)
        if expected is None:  # nothing said what to expect: the workers must at least agree
            seen = {r.get("digest") for r in done.values()}
            expected = seen.pop() if len(seen) == 1 else None
            txn.spec["expected_digest"] = expected
        verified = []
        for url in urls:
            reply = done.get(url)
            if reply is None:
                continue
            digest = reply.get("digest")
            txn.digests[url] = digest
            if digest is not None and digest == expected:
                verified.append(url)
                self._note(txn, url, "verified", f"digest {_short(digest)}")
            else:
                self._failed(
                    txn,
                    url,
                    IllegalState(
                        f"{url}: holds digest {digest}, expected {expected}", code="digest_mismatch", url=url
                    ),
                )
        return verified

    async def _commit(self, txn: _Txn, urls: Sequence[str], deadline: _Deadline) -> list[str]:
        spec = txn.spec

        async def one(url: str) -> str:
            body: Reply = {"weight_version": spec["version"], "epoch": spec["epoch"]}
            if spec["expected_digest"] is not None:
                body["expected_digest"] = spec["expected_digest"]
            await self._call(url, "set_weight_version", body, deadline)
            await self._call(url, "resume_generation", {}, deadline)
            self.journal.set_committed(
                txn.id,
                url,
                spec["workers"][url]["path"],
                spec["version"],
                spec["epoch"],
                spec["expected_digest"],
            )
            txn.outcomes[url] = "committed"
            self._note(txn, url, "committed", f"epoch {spec['epoch']}")
            return url

        done, failed = await self._each(urls, one)
        for url, exc in failed.items():
            self._failed(txn, url, exc)
        return [u for u in urls if u in done]

    async def _fence(self, txn: _Txn, verified: Sequence[str], deadline: _Deadline) -> TransactionResult:
        todo = [u for u in verified if txn.outcomes.get(u) != "committed"]
        committed = set(await self._commit(txn, todo, deadline)) | {
            u for u in verified if txn.outcomes.get(u) == "committed"
        }
        for url in txn.urls:
            if url not in committed:
                txn.outcomes[url] = "fenced"
                self._note(txn, url, "fenced")
        self._phase(txn, "fence_done")
        return self._result(txn, "fenced")

    async def _rollback(self, txn: _Txn, deadline: _Deadline) -> TransactionResult:
        """Bring every worker back to its previous source, version and epoch, and resume it."""
        spec = txn.spec

        async def one(url: str) -> str:
            prev = spec["workers"][url]["previous"]
            now = await self._call(url, "get_weight_version", {}, deadline)
            outcome = "unchanged"
            changed = now.get("digest") != prev.get("digest") or (
                prev.get("digest") is None and url in txn.sent
            )
            if now.get("torn") or changed:
                if not prev.get("path"):
                    raise IllegalState(
                        f"{url}: loaded new weights, and no committed source is known to restore",
                        code="no_rollback_source",
                        url=url,
                    )
                body = {"model_path": prev["path"], "reset_prefix_cache": True}
                reply = await self._call(url, "update_weights_from_disk", body, deadline)
                if prev.get("digest") is not None and reply.get("digest") not in (None, prev["digest"]):
                    raise IllegalState(
                        f"{url}: restored digest {reply.get('digest')}, expected {prev['digest']}",
                        code="digest_mismatch",
                        url=url,
                    )
                outcome = "rolled_back"
            if prev.get("version_declared"):
                body = {"weight_version": prev.get("version")}
                if prev.get("epoch") is not None:
                    body["epoch"] = prev["epoch"]
                if prev.get("digest") is not None:
                    body["expected_digest"] = prev["digest"]
                await self._call(url, "set_weight_version", body, deadline)
            if not prev.get("paused") and not prev.get("torn"):
                await self._call(url, "resume_generation", {}, deadline)
            self._note(txn, url, outcome)
            return outcome

        done, failed = await self._each(txn.urls, one)
        for url, outcome in done.items():
            txn.outcomes[url] = outcome
        for url, exc in failed.items():
            self._failed(txn, url, exc)
            txn.outcomes[url] = "failed"
        self._phase(txn, "rollback_done")
        return self._result(txn, "rolled_back")

    def _result(self, txn: _Txn, code: str | None = None) -> TransactionResult:
        spec = txn.spec
        errors = txn.errors
        workers = tuple(
            WorkerOutcome(
                url,
                txn.outcomes.get(url, "unchanged"),
                errors[url].code if url in errors else None,
                errors[url].message if url in errors else None,
                txn.digests.get(url),
            )
            for url in txn.urls
        )
        message = "; ".join(f"{u}: {e.code}" for u, e in errors.items()) or None
        return TransactionResult(
            txn.id,
            txn.machine.phase,
            spec["version"],
            spec["epoch"] if txn.machine.phase in ("committed", "fenced") else None,
            spec["expected_digest"],
            spec["policy"],
            workers,
            None if txn.machine.phase == "committed" else code or "failed",
            message,
            spec.get("min_workers"),
        )

    # ------------------------------------------------------------------ recovery

    async def recover(self, cleanup_s: float | None = None) -> TransactionResult | None:
        """Finish the journal's unfinished transaction, if any; return its result.

        Every worker is asked for its digest: when all hold the expected weights the commit
        is completed, otherwise every worker is rolled back (a decided rollback stays one).
        Raises ``InvalidRequest`` (``workers_mismatch``) when this coordinator's workers are
        not the transaction's.
        """
        found = self.journal.unfinished(TERMINAL)
        if found is None:
            return None
        txn_id, phase, spec = found
        if set(spec["workers"]) != set(self.workers):
            raise InvalidRequest(
                f"transaction {txn_id} ran on {sorted(spec['workers'])}, not {sorted(self.workers)}",
                code="workers_mismatch",
            )
        txn = _Txn(TransactionMachine(phase), txn_id, spec)
        txn.sent = set(txn.urls)  # whoever got an update before the crash is unknown
        self._emit(phase, None, "recover", f"txn {txn_id}")
        deadline = _Deadline(cleanup_s or self.cleanup_s)
        return await self._session(lambda: self._recover(txn, deadline))

    def recover_sync(self, cleanup_s: float | None = None) -> TransactionResult | None:
        return asyncio.run(self.recover(cleanup_s))

    async def _recover(self, txn: _Txn, deadline: _Deadline) -> TransactionResult:
        if txn.machine.phase == "preparing":
            self._phase(txn, "recover_abort")
            return self._result(txn, "recovered_abort")
        if txn.machine.phase != "rolling_back":
            verified = await self._verify(txn, txn.urls, deadline)
            if len(verified) == len(txn.urls):
                self._phase(txn, "recover_commit")
                committed = await self._commit(txn, txn.urls, deadline)
                if len(committed) == len(txn.urls):
                    self._phase(txn, "commit_done")
                    return self._result(txn)
                self._phase(txn, "fail")
                return await self._rollback(txn, deadline)
            txn.errors.clear()
        self._phase(txn, "recover_rollback")
        return await self._rollback(txn, deadline)


def _short(digest: Any) -> str:
    return str(digest)[:12] if digest else "unknown"


def recover(
    journal: Journal | str | Path, workers: Sequence[str], **options: Any
) -> TransactionResult | None:
    """Blocking :meth:`FleetCoordinator.recover` for a journal file and its workers.

    Raises ``InvalidRequest`` (``bad_journal``) when ``journal`` is a path that is not an
    existing file: nothing is created.
    """
    if not isinstance(journal, Journal):
        journal = Journal(journal, must_exist=True)
    return FleetCoordinator(workers, journal=journal, **options).recover_sync()
