"""The reference engine: a torch transformer served by an async, batched generation loop.

It implements :class:`weightsync.core.Engine` with vLLM's semantics, so everything weightsync
does can be seen on a laptop:

* pause modes: ``keep`` freezes in-flight requests (they continue on resume), ``wait``
  drains them before reporting paused, ``abort`` ends them with ``finish_reason: "abort"``.
  New requests queue while paused.
* a block prefix cache keyed by weight epoch: a request only ever reuses KV computed by
  the weights it runs on, so an ``allow_unpaused`` update is safe without a cache reset.
  Its reset is honest: while requests are running it cannot drop what they hold and says
  so; when paused it also resets kept requests, which recompute their KV with the new
  weights on resume.
* version stamps: every output token is stamped with the weights *epoch* it was computed
  with; a completion reports the version it started with and the spans of versions it saw.
* weight updates: while paused, tensors are written in place, streamed; while running
  (``allow_unpaused``) they are loaded into a staging copy and swapped in between two decode
  steps, so every token is computed by exactly one set of weights and a failed unpaused
  update never tears the served weights (at the cost of one extra copy of the model): it
  is reported with ``wrote=False`` whatever reached the staging copy, which is discarded.
* attestation: the per-tensor hashes of its seeded initial weights are computed once at
  start (later loads report theirs as the bytes pass through), a dry run checks a source
  without writing, and :meth:`ReferenceEngine.attest` hashes the live parameters.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from weightsync.core.errors import InvalidRequest, LoadFailed, WeightSyncError
from weightsync.core.requests import InitGroupRequest
from weightsync.core.sources import WeightSource
from weightsync.core.values import Attestation, LoadStats, PauseMode, PauseOutcome, Snapshot, WeightInfo
from weightsync.transports.failures import failed
from weightsync.transports.hashing import tensor_hashes
from weightsync.transports.loading import LoadContext, check_source, load_sync
from weightsync.transports.sink import TensorSink, weight_info

from ..generation import Generating
from ..stamps import Completion, VersionStamps
from .model import CausalLM, ModelConfig

log = logging.getLogger("weightsync.reference")

BLOCK = 16

# A prefix-cache key: the weight epoch that computed the block, and the tokens it covers.
BlockKey = tuple[int, tuple[int, ...]]


@attrs.define(eq=False)
class Request:
    id: str
    prompt: list[int]
    max_tokens: int
    temperature: float
    generator: torch.Generator | None
    future: asyncio.Future[Completion]
    submitted_epoch: int
    out: list[int] = attrs.field(factory=list)
    epochs: list[int] = attrs.field(factory=list)
    slot: int | None = None
    kv_len: int = 0
    recompute: bool = False
    blocks: list[BlockKey] = attrs.field(factory=list)  # prefix-cache keys it holds
    cached_tokens: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out


@attrs.define
class _CachedBlock:
    kv: torch.Tensor
    refs: int = 0


class ReferenceEngine(Generating):
    """See the module docstring.  Create it inside a running event loop, or call
    :meth:`start` from one before generating."""

    name = "reference"
    rpc_methods = ("weight_hashes", "prefix_cache_stats")

    def __init__(
        self,
        config: ModelConfig | None = None,
        *,
        slots: int = 8,
        allowed_weight_dirs: Sequence[str | Path] | None = None,
    ) -> None:
        self.config = config or ModelConfig()
        self.model = CausalLM(self.config, slots=slots)
        self.load_context = LoadContext.create(allowed_weight_dirs)
        self.stamps = VersionStamps()
        self._ids = itertools.count()
        self._waiting: deque[Request] = deque()
        self._active: dict[int, Request] = {}
        self._free_slots = list(range(slots))
        self._paused = False
        self._draining = False
        self._step_lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._blocks: dict[BlockKey, _CachedBlock] = {}
        self.cache_hits = 0
        self._task: asyncio.Task[None] | None = None
        self._initial_hashes = tensor_hashes(self.model.weights().items())

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for req in [*self._active.values(), *self._waiting]:
            self._finish(req, "abort")
        if self.load_context.groups is not None:
            self.load_context.groups.close()

    # ------------------------------------------------------------------ generation API

    def _new_request_id(self) -> str:
        return f"cmpl-{next(self._ids)}"

    async def _generate(
        self, prompt: list[int], max_tokens: int, temperature: float, seed: int | None, rid: str
    ) -> Completion:
        """Raises ``InvalidRequest`` for a too long prompt or an unknown token id."""
        self.start()
        c = self.config
        if any(not 0 <= t < c.vocab_size for t in prompt):
            raise InvalidRequest(
                f"token ids must be in [0, {c.vocab_size})", code="invalid_value", field="prompt"
            )
        if len(prompt) + max_tokens > c.max_position:
            raise InvalidRequest(
                f"prompt ({len(prompt)}) + max_tokens ({max_tokens}) exceeds the context of {c.max_position}",
                code="invalid_value",
                field="max_tokens",
            )
        gen = None
        if temperature > 1e-5:  # below that, sampling is greedy in all but name
            gen = torch.Generator()
            gen.manual_seed(seed if seed is not None else int(time.time_ns()) & 0xFFFFFFFF)
        future: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        req = Request(rid, list(prompt), max_tokens, temperature, gen, future, self.stamps.epoch)
        self._waiting.append(req)
        self._wake.set()
        return await asyncio.shield(future)

    def in_flight(self) -> list[str]:
        return [r.id for r in self._all_requests()]

    def _all_requests(self) -> list[Request]:
        return [*self._active.values(), *self._waiting]

    # ------------------------------------------------------------------ Engine protocol

    async def pause(self, mode: PauseMode, clear_cache: bool) -> PauseOutcome:
        aborted = 0
        if mode is PauseMode.WAIT:
            self._draining = True
            try:
                while self._active:
                    self._idle.clear()
                    await self._idle.wait()
            finally:
                self._draining = False
        async with self._step_lock:  # no step is running past this point
            self._paused = True
            if mode is PauseMode.ABORT:
                for req in self._all_requests():
                    self._finish(req, "abort")
                    aborted += 1
                self._waiting.clear()
        cleared = await self.reset_prefix_cache() if clear_cache else False
        return PauseOutcome(aborted=aborted, cache_cleared=cleared)

    async def resume(self) -> None:
        self._paused = False
        self._wake.set()

    async def prefix_cached(self, prompt: str | list[int]) -> bool:
        """Whether ``prompt`` (text, encoded as ``/v1/completions`` encodes it, or token ids)
        would be served from the prefix cache now: its first block is cached under the current
        weight epoch (blocks computed with other weights never count) and the prompt is long
        enough to reuse it (:class:`weightsync.core.engine.PrefixCacheProbe`)."""
        tokens = list(prompt.encode("utf-8")) if isinstance(prompt, str) else list(prompt)
        async with self._step_lock:
            return len(tokens) > BLOCK and (self.stamps.epoch, tuple(tokens[:BLOCK])) in self._blocks

    async def reset_prefix_cache(self, reset_requests: bool = True) -> bool:
        """Drop every cached prefix.  Returns ``False`` (and drops nothing) while requests are
        running, or when paused requests hold blocks and ``reset_requests`` is false; with
        ``reset_requests`` kept requests recompute their KV on resume."""
        async with self._step_lock:
            if self._active and not self._paused:
                return False
            if self._active and not reset_requests:
                return False
            for req in self._active.values():
                req.recompute = True
                req.blocks.clear()
            self._blocks.clear()
            return True

    async def load_weights(self, source: WeightSource) -> LoadStats:
        """Load ``source`` into the served weights: in place while paused, else through a
        staging copy swapped in between two steps.

        Raises ``LoadFailed`` and nothing else; its ``wrote`` says whether the *served*
        weights changed, which is exactly when the weight epoch moved.  A staged load that
        fails reports ``wrote=False`` however far it got into the staging copy.
        """
        epoch = self.stamps.epoch
        try:
            if self._paused:
                return await self._load_in_place(source)
            return await self._load_staged(source)
        except LoadFailed:
            raise
        except Exception as exc:
            # Outside the (total) channel load: a defect of ours rather than the source's (a
            # 500 unless a family error says otherwise), torn only if the weights moved.
            raise failed(exc, "weight", self.stamps.epoch != epoch, defect=True) from exc

    async def _load_in_place(self, source: WeightSource) -> LoadStats:
        sink = TensorSink(self.model.weights())
        async with self._step_lock:
            try:
                return await asyncio.to_thread(load_sync, source, sink, self.load_context)
            finally:
                if sink.wrote:
                    self._weights_changed()

    async def _load_staged(self, source: WeightSource) -> LoadStats:
        weights = self.model.weights()
        staging = {n: t.clone() for n, t in weights.items()}
        try:
            stats = await asyncio.to_thread(load_sync, source, TensorSink(staging), self.load_context)
        except LoadFailed as exc:
            if not exc.wrote:
                raise
            # What was written went into the staging copy, dropped here: nothing served changed.
            raise LoadFailed(
                f"{exc.message} (the staging copy was discarded; the served weights are unchanged)",
                wrote=False,
                cause=exc.cause,
                code=exc.code,
                **exc.details,
            ) from exc
        async with self._step_lock:
            self._weights_changed()
            with torch.no_grad():
                for name, param in weights.items():
                    param.data = staging[name]
        return attrs.evolve(stats, extra={**stats.extra, "staged": True})

    def _weights_changed(self) -> None:
        """Start a new weight epoch (call it holding the step lock).  Cached blocks are keyed
        by epoch, so those of older epochs can never be hit again: drop the ones nobody
        holds now, and the held ones when their requests finish."""
        self.stamps.bump()
        self._blocks = {k: b for k, b in self._blocks.items() if b.refs or k[0] == self.stamps.epoch}

    def initial_hashes(self) -> Mapping[str, str]:
        """The hashes of the seeded weights this engine started with (computed once)."""
        return self._initial_hashes

    async def check_source(self, source: WeightSource) -> Mapping[str, str] | None:
        """Validate ``source`` as a load would, writing nothing (see ``loading.check_source``)."""
        specs = weight_info(self.model.weights().items()).by_name()
        return await asyncio.to_thread(check_source, source, specs, self.load_context)

    async def attest(self) -> Attestation:
        """Hash every live parameter (a full pass over the weights, off the event loop)."""
        weights = self.model.weights()
        return Attestation(await asyncio.to_thread(tensor_hashes, weights.items()), "live_weights")

    async def init_group(self, request: InitGroupRequest) -> None:
        assert self.load_context.groups is not None
        await asyncio.to_thread(self.load_context.groups.join, request)

    async def destroy_group(self, group_name: str) -> None:
        assert self.load_context.groups is not None
        await asyncio.to_thread(self.load_context.groups.destroy, group_name)

    async def weight_info(self) -> WeightInfo:
        return weight_info(self.model.weights().items())

    async def is_alive(self) -> bool:
        return self._task is None or not self._task.done()

    async def abort_request(self, request_id: str) -> bool:
        async with self._step_lock:
            for req in self._all_requests():
                if req.id == request_id:
                    self._finish(req, "abort")
                    if req in self._waiting:
                        self._waiting.remove(req)
                    return True
        return False

    async def rpc(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if method == "weight_hashes":
            return await asyncio.to_thread(tensor_hashes, self.model.weights().items())
        if method == "prefix_cache_stats":
            held = sum(1 for b in self._blocks.values() if b.refs)
            return {
                "blocks": len(self._blocks),
                "held": held,
                "hits": self.cache_hits,
                "epoch": self.stamps.epoch,
            }
        raise WeightSyncError(f"unknown rpc {method!r}")

    def observe_commit(self, snapshot: Snapshot) -> None:
        self.stamps.observe_commit(snapshot)

    # ------------------------------------------------------------------ the loop

    async def _loop(self) -> None:
        while True:
            if self._paused or not (self._waiting or self._active):
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            async with self._step_lock:
                if self._paused:
                    continue
                try:
                    await asyncio.to_thread(self._step)
                except Exception as exc:
                    log.exception("generation step failed")
                    for req in self._all_requests():
                        if not req.future.done():
                            req.future.set_exception(exc)
                    self._active.clear()
                    self._waiting.clear()
                    self._free_slots = list(range(self.model.slots))
            if not self._active:
                self._idle.set()
            await asyncio.sleep(0)

    def _step(self) -> None:
        # 1. kept requests whose KV was reset recompute it with the current weights
        for req in self._active.values():
            if req.recompute:
                self._prefill(req, req.tokens[:-1], 0)
                req.recompute = False
        # 2. admit waiting requests into free slots (unless draining for a `wait` pause)
        while self._waiting and self._free_slots and not self._draining:
            req = self._waiting.popleft()
            req.slot = self._free_slots.pop()
            self._active[req.slot] = req
            start = self._attach_prefix(req)
            logits = self._prefill(req, req.prompt[start:], start)
            self._store_prefix(req)
            self._sample(req, logits)
        # 3. one decode step for every request that has a token to feed
        batch = [r for r in self._active.values() if r.future.done() is False and len(r.out) < r.max_tokens]
        if batch:
            tokens = torch.tensor([[r.tokens[-1]] for r in batch])
            slots = torch.tensor([r.slot for r in batch])
            start = torch.tensor([r.kv_len for r in batch])
            logits = self.model.forward_slots(tokens, slots, start)
            for i, r in enumerate(batch):
                r.kv_len += 1
                self._sample(r, logits[i : i + 1])

    def _prefill(self, req: Request, tokens: list[int], start: int) -> torch.Tensor:
        assert req.slot is not None
        logits = self.model.forward_slots(
            torch.tensor([tokens]), torch.tensor([req.slot]), torch.tensor([start])
        )
        req.kv_len = start + len(tokens)
        return logits

    def _attach_prefix(self, req: Request) -> int:
        """Copy the longest prefix of the prompt cached under the current weights into the
        request's slot."""
        assert req.slot is not None
        found = []
        n = 0
        while (n + 1) * BLOCK < len(req.prompt):  # keep at least one prompt token to compute
            key = (self.stamps.epoch, tuple(req.prompt[: (n + 1) * BLOCK]))
            block = self._blocks.get(key)
            if block is None:
                break
            block.refs += 1
            req.blocks.append(key)
            found.append(block.kv)
            n += 1
        if found:
            self.model.copy_slot_prefix(req.slot, found, BLOCK)
            self.cache_hits += 1
        req.cached_tokens = n * BLOCK
        return n * BLOCK

    def _store_prefix(self, req: Request) -> None:
        assert req.slot is not None
        for n in range(len(req.blocks), len(req.prompt) // BLOCK):
            key = (self.stamps.epoch, tuple(req.prompt[: (n + 1) * BLOCK]))
            if key not in self._blocks:
                self._blocks[key] = _CachedBlock(self.model.read_block(req.slot, n, BLOCK))
            self._blocks[key].refs += 1
            req.blocks.append(key)

    def _sample(self, req: Request, logits: torch.Tensor) -> None:
        if req.temperature > 1e-5:
            row = logits[0].double()
            probs = torch.softmax((row - row.max()) / req.temperature, dim=-1)
            tok = int(torch.multinomial(probs, 1, generator=req.generator))
        else:
            tok = int(logits[0].argmax())
        req.out.append(tok)
        req.epochs.append(self.stamps.epoch)
        if len(req.out) >= req.max_tokens:
            self._finish(req, "length")

    def _finish(self, req: Request, reason: str) -> None:
        if req.slot is not None and self._active.get(req.slot) is req:
            del self._active[req.slot]
            self._free_slots.append(req.slot)
        for key in req.blocks:
            block = self._blocks.get(key)
            if block is not None:
                block.refs -= 1
                if not block.refs and key[0] != self.stamps.epoch:
                    del self._blocks[key]  # computed by weights no longer served
        req.blocks.clear()
        if req.future.done():
            return
        completion = self.stamps.completion(
            req.id, len(req.prompt), req.out, req.epochs, reason, req.submitted_epoch, req.cached_tokens
        )
        loop = req.future.get_loop()
        if loop.is_closed():
            return
        loop.call_soon_threadsafe(_resolve, req.future, completion)


def _resolve(future: asyncio.Future[Completion], completion: Completion) -> None:
    if not future.done():
        future.set_result(completion)
