"""The reference engine's scheduler: an async loop of batched generation steps.

Requests wait in a queue, are admitted into a free KV slot (reusing cached prefix blocks),
prefilled, then decoded together, one token per request per step.  Each step runs in a
thread holding :attr:`Scheduler.step_lock`, so whoever else takes the lock (a pause, an
in-place load, a weight swap, a cache reset) acts between two steps: every token is
computed by exactly one set of weights, stamped with its epoch.

Pausing sets :attr:`Scheduler.paused` under the lock; requests then stay where they are
(kept), queue (new ones), or are finished with ``"abort"`` (see :meth:`Scheduler.pause`).

A request may run with a LoRA adapter (:attr:`Request.adapter`): it holds that adapter version
from its submission to its end, every forward pass applies it to the request's rows only
(:class:`~.lora_batch.LoraBatch`), and its cached prefix blocks are salted with the adapter's
digest, so K/V computed with one adapter is never reused by a sequence without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import attrs
import torch

from weightsync.engines.reference.lora_batch import LoraBatch, StagedAdapter
from weightsync.engines.reference.prefix_cache import BlockKey, PrefixCache
from weightsync.engines.reference.runner import Runner
from weightsync.engines.reference.sampler import prompt_logprobs, sample
from weightsync.engines.reference.stops import StopStrings
from weightsync.engines.sampling import Sampling, TokenLogprob
from weightsync.engines.stamps import Chunk, Completion, VersionStamps

log = logging.getLogger("weightsync.reference")


@attrs.define(eq=False)
class Request:
    id: str
    prompt: list[int]
    sampling: Sampling
    generator: torch.Generator | None
    future: asyncio.Future[Completion]
    submitted_epoch: int
    stream: asyncio.Queue[Any] | None = None
    """Where a streaming request's tokens go as they are sampled (``(token, epoch,
    logprob)``), then its completion, or the exception that ended the loop."""
    adapter: StagedAdapter | None = None
    """The LoRA adapter the request runs with (held from :meth:`Scheduler.submit` to its end)."""
    out: list[int] = attrs.field(factory=list)
    epochs: list[int] = attrs.field(factory=list)
    logprobs: list[TokenLogprob] = attrs.field(factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    stop_reason: int | str | None = None
    slot: int | None = None
    kv_len: int = 0
    recompute: bool = False
    blocks: list[BlockKey] = attrs.field(factory=list)  # prefix-cache keys it holds
    cached_tokens: int = 0
    stops: StopStrings = attrs.field(init=False)
    """``sampling.stop`` as a trie: matched per token in the longest one's length."""
    stop_ids: frozenset[int] = attrs.field(init=False)
    holds: bool = attrs.field(default=False, init=False)
    """Whether it holds :attr:`adapter` (between submission and its end)."""

    def __attrs_post_init__(self) -> None:
        self.stops = StopStrings(self.sampling.stop)
        self.stop_ids = frozenset(self.sampling.stop_token_ids)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out

    @property
    def salt(self) -> str:
        """The prefix-cache salt of its blocks: its own ``cache_salt``, and its adapter's digest
        (a NUL never appears in a valid ``cache_salt``)."""
        salt = self.sampling.cache_salt or ""
        return salt if self.adapter is None else f"{salt}\0lora:{self.adapter.digest}"

    @property
    def lora(self) -> LoraBatch | None:
        return LoraBatch.of([self.adapter])

    def post(self, item: Any) -> None:
        """Hand ``item`` to a streaming request's reader (from any thread)."""
        if self.stream is not None:
            loop = self.future.get_loop()
            if not loop.is_closed():
                loop.call_soon_threadsafe(self.stream.put_nowait, item)


class Scheduler:
    """Admits, batches and finishes requests over ``runner`` (see the module docstring).
    Create it inside a running event loop, or call :meth:`start` from one."""

    def __init__(
        self, runner: Runner, cache: PrefixCache, stamps: VersionStamps, eos_token_id: int | None = None
    ) -> None:
        self.runner = runner
        self.eos_token_id = eos_token_id
        self.cache = cache
        self.stamps = stamps
        self.waiting: deque[Request] = deque()
        self.active: dict[int, Request] = {}
        self.paused = False
        self.step_lock = asyncio.Lock()
        self._free_slots = list(range(runner.slots))
        self._draining = False
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._aborts: set[asyncio.Task[bool]] = set()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        """Stop the loop and finish every request with ``"abort"``."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for req in self.requests():
            self.finish(req, "abort")

    def alive(self) -> bool:
        return self._task is None or not self._task.done()

    # ------------------------------------------------------------------ requests

    def submit(self, req: Request) -> None:
        self.start()
        if req.adapter is not None and not req.holds:
            req.adapter.acquire()
            req.holds = True
        self.waiting.append(req)
        self._wake.set()

    async def relay(self, req: Request) -> AsyncIterator[Chunk | Completion]:
        """Submit the streaming ``req``, then yield its chunks as its tokens arrive (all that
        arrived since the last one), then its completion; aborts it when closed before the end
        (closed before it started, it never runs)."""
        assert req.stream is not None
        first: int | None = None
        adapter = None if req.adapter is None else req.adapter.stamp
        self.submit(req)
        try:
            while True:
                items = [await req.stream.get()]
                while not req.stream.empty():
                    items.append(req.stream.get_nowait())
                tokens = [i for i in items if isinstance(i, tuple)]
                if tokens:
                    first = tokens[0][1] if first is None else first
                    logprobs = None if req.sampling.logprobs is None else [t[2] for t in tokens]
                    yield self.stamps.chunk(first, [t[0] for t in tokens], logprobs, adapter=adapter)
                last = items[-1]
                if isinstance(last, BaseException):
                    raise last
                if isinstance(last, Completion):
                    yield last
                    return
        finally:
            if not req.future.done():  # the reader left: free the request
                task = asyncio.get_running_loop().create_task(self.abort(req.id))
                self._aborts.add(task)
                task.add_done_callback(self._aborts.discard)

    def requests(self) -> list[Request]:
        """Every request not finished: active (running or kept) first, then queued."""
        return [*self.active.values(), *self.waiting]

    async def pause(self, *, drain: bool, abort: bool) -> int:
        """Stop stepping: after the active requests finish (``drain``, new ones stay queued),
        or at once; ``abort`` finishes every request with ``"abort"``.  Returns how many were
        aborted."""
        if drain:
            self._draining = True
            try:
                while self.active:
                    self._idle.clear()
                    await self._idle.wait()
            finally:
                self._draining = False
        aborted = 0
        async with self.step_lock:  # no step is running past this point
            self.paused = True
            if abort:
                for req in self.requests():
                    self.finish(req, "abort")
                    aborted += 1
                self.waiting.clear()
        return aborted

    def resume(self) -> None:
        self.paused = False
        self._wake.set()

    async def abort(self, request_id: str) -> bool:
        async with self.step_lock:
            for req in self.requests():
                if req.id == request_id:
                    self.finish(req, "abort")
                    if req in self.waiting:
                        self.waiting.remove(req)
                    return True
        return False

    def forget_kv(self) -> None:
        """The cache dropped every block (call it holding the step lock, paused): kept
        requests recompute their K/V with the current weights when they resume."""
        for req in self.active.values():
            req.recompute = True
            req.blocks.clear()

    # ------------------------------------------------------------------ the loop

    async def _loop(self) -> None:
        while True:
            if self.paused or not (self.waiting or self.active):
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            async with self.step_lock:
                if self.paused:
                    continue
                try:
                    await asyncio.to_thread(self._step)
                except Exception as exc:
                    log.exception("generation step failed")
                    for req in self.requests():
                        if not req.future.done():
                            req.future.set_exception(exc)
                            req.post(exc)
                    self.active.clear()
                    self.waiting.clear()
                    self._free_slots = list(range(self.runner.slots))
            if not self.active:
                self._idle.set()
            await asyncio.sleep(0)

    def _step(self) -> None:
        epoch = self.stamps.epoch
        # 1. kept requests whose KV was reset recompute it with the current weights
        for req in self.active.values():
            if req.recompute:
                self._prefill(req, req.tokens[:-1], 0)
                req.recompute = False
        # 2. admit waiting requests into free slots (unless draining for a `wait` pause)
        while self.waiting and self._free_slots and not self._draining:
            req = self.waiting.popleft()
            req.slot = self._free_slots.pop()
            self.active[req.slot] = req
            salt = req.salt
            start = req.cached_tokens = self.cache.attach(epoch, req.prompt, req.slot, req.blocks, salt)
            logits = self._prefill(req, req.prompt[start:], start)
            if req.sampling.prompt_logprobs is not None:
                full = self.runner.full_logits(req.prompt, req.lora)  # type: ignore[attr-defined]
                req.prompt_logprobs = prompt_logprobs(full, req.prompt, req.sampling.prompt_logprobs)
            self.cache.store_prompt(epoch, req.prompt, req.slot, req.blocks, salt)
            self._sample(req, logits)
        # 3. one decode step for every request that has a token to feed
        batch = [
            r for r in self.active.values() if not r.future.done() and len(r.out) < r.sampling.max_tokens
        ]
        if batch:
            tokens = torch.tensor([[r.tokens[-1]] for r in batch])
            slots = torch.tensor([r.slot for r in batch])
            starts = torch.tensor([r.kv_len for r in batch])
            logits = self._forward(tokens, slots, starts, LoraBatch.of([r.adapter for r in batch]))
            for i, r in enumerate(batch):
                r.kv_len += 1
                self._sample(r, logits[i : i + 1])

    def _forward(
        self, tokens: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor, lora: LoraBatch | None
    ) -> torch.Tensor:
        if lora is None:  # the base alone: the call every runner takes
            return self.runner.forward(tokens, slots, starts)
        return self.runner.forward(tokens, slots, starts, lora)  # type: ignore[call-arg]

    def _prefill(self, req: Request, tokens: list[int], start: int) -> torch.Tensor:
        assert req.slot is not None
        logits = self._forward(
            torch.tensor([tokens]), torch.tensor([req.slot]), torch.tensor([start]), req.lora
        )
        req.kv_len = start + len(tokens)
        return logits

    def _sample(self, req: Request, logits: torch.Tensor) -> None:
        s = req.sampling
        history = req.tokens if s.repetition_penalty != 1.0 else ()
        tok, logprob = sample(logits[0], s, history, req.generator)
        req.out.append(tok)
        req.epochs.append(self.stamps.epoch)
        if logprob is not None:
            req.logprobs.append(logprob)
        req.post((tok, self.stamps.epoch, logprob))
        if tok in req.stop_ids:
            req.stop_reason = tok
            self.finish(req, "stop")
        elif tok == self.eos_token_id and not s.ignore_eos:
            self.finish(req, "stop")
        elif req.stops and (matched := req.stops.match(req.out)) is not None:
            req.stop_reason = matched
            self.finish(req, "stop")
        elif len(req.out) >= s.max_tokens:
            self.finish(req, "length")

    def finish(self, req: Request, reason: str) -> None:
        """End ``req`` with ``reason``: free its slot and blocks, resolve its completion."""
        if req.slot is not None and self.active.get(req.slot) is req:
            del self.active[req.slot]
            self._free_slots.append(req.slot)
        self.cache.release(req.blocks, self.stamps.epoch)
        if req.holds and req.adapter is not None:  # its adapter version may go once nobody holds it
            req.adapter.release()
            req.holds = False
        if req.future.done():
            return
        completion = self.stamps.completion(
            req.id,
            len(req.prompt),
            req.out,
            req.epochs,
            reason,
            req.submitted_epoch,
            req.cached_tokens,
            adapter=None if req.adapter is None else req.adapter.stamp,
            logprobs=None if req.sampling.logprobs is None else list(req.logprobs),
            prompt_logprobs=req.prompt_logprobs,
            stop_reason=req.stop_reason,
        )
        loop = req.future.get_loop()
        if loop.is_closed():
            return
        loop.call_soon_threadsafe(_resolve, req.future, completion)
        req.post(completion)


def _resolve(future: asyncio.Future[Completion], completion: Completion) -> None:
    if not future.done():
        future.set_result(completion)
