"""The reference engine: a torch transformer served by an async, batched generation loop.

It implements :class:`weightsync.core.Engine` with vLLM's semantics, so everything weightsync
does can be seen on a laptop.  This module is the adapter from that protocol to three parts:
the :mod:`~.scheduler` (the generation loop), the :mod:`~.prefix_cache` and a
:mod:`~.runner` (the model, in this process or tensor-parallel over several).

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
  update never tears the served weights (for one extra copy of the model; a delta goes in
  place between two steps and undoes itself): it reports ``wrote=False``.
* attestation: the per-tensor hashes of its seeded initial weights are computed once at
  start (later loads report theirs as the bytes pass through), a dry run checks a source
  without writing, and :meth:`ReferenceEngine.attest` hashes the live parameters.
* memory release: weights offloaded or discarded and K/V dropped for real (:mod:`~.memory`).
* LoRA adapters: several served at once beside the base, one chosen per request, applied in
  the forward pass to that request's rows only (:mod:`~.adapters`, :mod:`~.lora_batch`).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from weightsync.core.engine import cache_cleared
from weightsync.core.errors import CacheInUse, InvalidRequest, LoadFailed, NotSupported, WeightSyncError
from weightsync.core.plan.layouts import WorkerLayout
from weightsync.core.requests import InitGroupRequest
from weightsync.core.snapshot import Attestation, LoadStats, PauseMode, PauseOutcome, Snapshot, WeightInfo
from weightsync.core.sources import (
    DeltaSource,
    DeltaStreamSource,
    DistributedSource,
    PlanSource,
    WeightSource,
)
from weightsync.engines.generation import Generating
from weightsync.engines.reference.adapters import ReferenceAdapters
from weightsync.engines.reference.groups import ReferenceGroups
from weightsync.engines.reference.lora_batch import StagedAdapter
from weightsync.engines.reference.memory import ReferenceMemory
from weightsync.engines.reference.model import CausalLM, ModelConfig
from weightsync.engines.reference.prefix_cache import PrefixCache
from weightsync.engines.reference.runner import LocalRunner, Runner
from weightsync.engines.reference.scheduler import Request, Scheduler
from weightsync.engines.reference.tokenizer import ByteTokenizer
from weightsync.engines.reference.tp_layout import Part
from weightsync.engines.reference.tp_layout import worker_layout as tp_worker_layout
from weightsync.engines.sampling import Sampling
from weightsync.engines.stamps import Chunk, Completion, VersionStamps
from weightsync.transports.failures import failed
from weightsync.transports.loading import LoadContext, check_source, load, load_sync
from weightsync.transports.sink import TensorSink


class ReferenceEngine(Generating):
    """See the module docstring.  Create it inside a running event loop, or call
    :meth:`start` from one before generating.  ``runner`` replaces the in-process model
    (tensor parallelism passes a :class:`~.tp_runner.TPRunner` built for ``config``)."""

    name = "reference"
    rpc_methods = ("weight_hashes", "prefix_cache_stats", "tp_layout", "worker_layout")

    def __init__(
        self,
        config: ModelConfig | None = None,
        *,
        slots: int = 8,
        allowed_weight_dirs: Sequence[str | Path] | None = None,
        runner: Runner | None = None,
        eos_token_id: int | None = None,
    ) -> None:
        self.config = config or ModelConfig()
        self.runner: Runner = runner or LocalRunner(self.config, slots=slots)
        self.load_context = LoadContext.create(allowed_weight_dirs)
        self.stamps = VersionStamps()
        self.cache = PrefixCache(self.runner)
        self.scheduler = Scheduler(self.runner, self.cache, self.stamps, eos_token_id)
        self.memory = ReferenceMemory(self.runner, self.scheduler, self.cache)
        assert self.load_context.groups is not None
        self.groups = ReferenceGroups(self.runner, self.load_context.groups)
        # Text is UTF-8 bytes, one token each, when the vocabulary is bytes (the default).
        self.tokenizer = ByteTokenizer() if self.config.vocab_size == 256 else None
        # LoRA needs the model in this process: a tensor-parallel engine serves no adapters (yet).
        modules = self.runner.model.linear_modules() if isinstance(self.runner, LocalRunner) else None
        self.adapters = ReferenceAdapters(modules, getattr(torch, self.config.dtype), allowed_weight_dirs)
        """The LoRA adapters served beside the base (:mod:`.adapters`)."""
        self._ids = itertools.count()

    @property
    def model(self) -> CausalLM:
        """The in-process model (only without tensor parallelism)."""
        if not isinstance(self.runner, LocalRunner):
            raise AttributeError("a tensor-parallel reference engine has no in-process model")
        return self.runner.model

    @property
    def world_size(self) -> int:
        """How many tensor-parallel ranks serve the model (1 without tensor parallelism)."""
        return len(self.runner.layout)

    def tp_layout(self) -> list[dict[str, Part]]:
        """Which part of each weight every tensor-parallel rank serves: per rank (index =
        rank), weight name -> ``"full"`` (the whole tensor, replicated) or ``(dim, start,
        length)`` (that slice along ``dim`` of the full tensor).  One rank, all ``"full"``,
        without tensor parallelism.  Shapes are the full logical ones of :meth:`weight_info`;
        see :mod:`.tp_layout` for the split."""
        return [dict(parts) for parts in self.runner.layout]

    def worker_layout(self, worker: str) -> WorkerLayout:
        """:meth:`tp_layout` as a transfer plan's :class:`~weightsync.core.plan.layouts.WorkerLayout`
        for this worker, named ``worker``."""
        return tp_worker_layout(self.config, self.world_size, worker)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self.scheduler.start()

    async def close(self) -> None:
        await self.scheduler.stop()
        if self.load_context.groups is not None:
            self.load_context.groups.close()
        await asyncio.to_thread(self.runner.close)

    # ------------------------------------------------------------------ generation API

    def _new_request_id(self) -> str:
        return f"cmpl-{next(self._ids)}"

    def _request(
        self,
        prompt: list[int],
        s: Sampling,
        rid: str,
        stream: asyncio.Queue[object] | None = None,
        adapter: StagedAdapter | None = None,
    ) -> Request:
        """The scheduler's request, checked, with ``adapter`` (none: the base alone).  Raises
        ``InvalidRequest`` for a too long prompt, an unknown token id, ``NotSupported`` for
        prompt logprobs with tensor parallelism."""
        c = self.config
        if any(not 0 <= t < c.vocab_size for t in prompt):
            raise InvalidRequest(
                f"token ids must be in [0, {c.vocab_size})", code="invalid_value", field="prompt"
            )
        if len(prompt) + s.max_tokens > c.max_position:
            raise InvalidRequest(
                f"prompt ({len(prompt)}) + max_tokens ({s.max_tokens}) exceeds the context of {c.max_position}",
                code="invalid_value",
                field="max_tokens",
            )
        if s.prompt_logprobs is not None and not isinstance(self.runner, LocalRunner):
            raise NotSupported(
                "prompt_logprobs: a tensor-parallel reference engine computes no full-prompt logits",
                code="not_supported",
                field="prompt_logprobs",
            )
        gen = None
        if not s.greedy:
            gen = torch.Generator()
            gen.manual_seed(s.seed if s.seed is not None else int(time.time_ns()) & 0xFFFFFFFF)
        future: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        return Request(rid, list(prompt), s, gen, future, self.stamps.epoch, stream, adapter)

    async def _generate(
        self, prompt: list[int], sampling: Sampling, rid: str, adapter: StagedAdapter | None = None
    ) -> Completion:
        req = self._request(prompt, sampling, rid, adapter=adapter)
        self.scheduler.submit(req)
        return await asyncio.shield(req.future)

    def _stream(
        self, prompt: list[int], sampling: Sampling, rid: str, adapter: StagedAdapter | None = None
    ) -> AsyncIterator[Chunk | Completion]:
        return self.scheduler.relay(self._request(prompt, sampling, rid, asyncio.Queue(), adapter))

    async def _generate_with(self, prompt: list[int], sampling: Sampling, rid: str, lora: str) -> Completion:
        return await self._generate(prompt, sampling, rid, self.adapters.resolve(lora))

    def _stream_with(
        self, prompt: list[int], sampling: Sampling, rid: str, lora: str
    ) -> AsyncIterator[Chunk | Completion]:
        return self._stream(prompt, sampling, rid, self.adapters.resolve(lora))

    def in_flight(self) -> list[str]:
        return [r.id for r in self.scheduler.requests()]

    # ------------------------------------------------------------------ Engine protocol

    async def pause(self, mode: PauseMode, clear_cache: bool) -> PauseOutcome:
        aborted = await self.scheduler.pause(drain=mode is PauseMode.WAIT, abort=mode is PauseMode.ABORT)
        cleared = await cache_cleared(self.reset_prefix_cache()) if clear_cache else False
        return PauseOutcome(aborted=aborted, cache_cleared=cleared)

    async def resume(self) -> None:
        self.scheduler.resume()

    async def prefix_cached(self, prompt: str | list[int]) -> bool:
        """Whether ``prompt`` (text, encoded as ``/v1/completions`` encodes it, or token ids)
        would be served from the prefix cache now: its first block is cached under the current
        weight epoch (blocks computed with other weights never count) and the prompt is long
        enough to reuse it (:class:`weightsync.core.engine.PrefixCacheProbe`)."""
        tokens = list(prompt.encode("utf-8")) if isinstance(prompt, str) else list(prompt)
        async with self.scheduler.step_lock:
            return self.cache.cached(self.stamps.epoch, tokens)

    async def reset_prefix_cache(self, reset_requests: bool = True) -> None:
        """Drop every cached prefix.  Raises ``CacheInUse`` (and drops nothing) while requests
        are running, or when paused requests hold blocks and ``reset_requests`` is false; with
        ``reset_requests`` kept requests recompute their KV on resume."""
        s = self.scheduler
        async with s.step_lock:
            if s.active and (not s.paused or not reset_requests):
                raise CacheInUse()
            s.forget_kv()
            await asyncio.to_thread(self.cache.clear)
            self.runner.check()  # a failed runner kept no cache to reset: not a success

    async def load_weights(self, source: WeightSource) -> LoadStats:
        """Load ``source`` into the served weights: in place while paused (a delta always, between
        two steps), else through a staging copy swapped in between two steps.

        Raises ``LoadFailed`` and nothing else; its ``wrote`` says whether the *served*
        weights changed, which is exactly when the weight epoch moved (a failed staged load:
        ``wrote=False`` however far it got into the staging copy)."""
        epoch = self.stamps.epoch
        try:
            self._refuse_unsupported(source)
            if self.scheduler.paused or isinstance(source, DeltaSource):
                # A delta (few elements, undoes itself) goes in place between two steps, no copy.
                return await self._load_in_place(source)
            return await self._load_staged(source)
        except LoadFailed:
            raise
        except Exception as exc:
            # Outside the (total) channel load: a defect of ours rather than the source's (a
            # 500 unless a family error says otherwise), torn only if the weights moved.
            raise failed(exc, "weight", self.stamps.epoch != epoch, defect=True) from exc

    async def _load_in_place(self, source: WeightSource) -> LoadStats:
        async with self.scheduler.step_lock:
            if self.memory.freed:  # released weights get memory back before the first write
                await asyncio.to_thread(self.memory.allocate)
            sink = await asyncio.to_thread(self.runner.sink, False)
            try:
                return await asyncio.to_thread(self._load_sync, source, sink)
            finally:
                if sink.wrote:
                    await self._weights_changed()

    async def _load_staged(self, source: WeightSource) -> LoadStats:
        try:
            sink = await asyncio.to_thread(self.runner.sink, True)
            stats = await asyncio.to_thread(self._load_sync, source, sink)
        except LoadFailed as exc:
            await asyncio.to_thread(self.runner.drop_staged)
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
        except BaseException:
            await asyncio.to_thread(self.runner.drop_staged)
            raise
        async with self.scheduler.step_lock:
            await self._weights_changed()
            await asyncio.to_thread(self.runner.swap_staged)
        return attrs.evolve(stats, extra={**stats.extra, "staged": True})

    def _refuse_unsupported(self, source: WeightSource) -> None:
        """A broadcast or delta reaches one-process workers only (a tensor-parallel engine's ranks
        take plans).  Raises ``LoadFailed`` (``not_supported``, nothing written)."""
        groups, streams = self.load_context.groups, (DistributedSource, DeltaStreamSource)
        known = isinstance(source, streams) and groups is not None and source.group_name in groups.names()
        if self.world_size > 1 and (known or isinstance(source, DeltaSource)):  # (an unknown group: 404)
            why = "not deltas (yet)" if isinstance(source, DeltaSource) else "not broadcasts"
            exc = NotSupported(
                f"a tensor-parallel reference worker receives sharded plans (update_weights_from_plan), {why}",
                code="not_supported",
            )
            raise failed(exc, source.kind, False)

    def _plan_reader(self, source: WeightSource) -> Any:
        """The plan channel of a tensor-parallel runner (every rank receives its own pieces),
        or ``None`` when ``source`` takes the common channels."""
        if not isinstance(source, PlanSource) or self.world_size == 1:
            return None
        from weightsync.engines.reference.tp_plan import TPPlanReader

        assert self.load_context.groups is not None
        return TPPlanReader(self.runner, self.load_context.groups, source)

    def _load_sync(self, source: WeightSource, sink: TensorSink) -> LoadStats:
        reader = self._plan_reader(source)
        if reader is None:
            return load_sync(source, sink, self.load_context)
        return load(reader, sink)

    async def _weights_changed(self) -> None:
        """Start a new weight epoch (call it holding the step lock).  Cached blocks are keyed
        by epoch, so those of older epochs can never be hit again: drop the ones nobody
        holds now, and the held ones when their requests finish."""
        self.stamps.bump()
        await asyncio.to_thread(self.cache.epoch_changed, self.stamps.epoch)

    def initial_hashes(self) -> Mapping[str, str]:
        """The hashes of the seeded weights this engine started with (computed once)."""
        return self.runner.initial_hashes

    async def check_source(self, source: WeightSource) -> Mapping[str, str] | None:
        """Validate ``source`` as a load would, writing nothing (see ``loading.check_source``)."""
        specs = self.runner.weight_info().by_name()
        try:
            self._refuse_unsupported(source)
        except LoadFailed as exc:
            raise exc.cause or exc from None
        reader = self._plan_reader(source)
        if reader is not None:
            await asyncio.to_thread(reader.validate, specs)
            return None
        return await asyncio.to_thread(check_source, source, specs, self.load_context)

    async def attest(self) -> Attestation:
        """Hash every live parameter (a full pass over the weights, off the event loop)."""
        return Attestation(await asyncio.to_thread(self.memory.hashes), "live_weights")

    async def init_group(self, request: InitGroupRequest) -> None:
        await self.groups.join(request)

    async def destroy_group(self, group_name: str) -> None:
        await self.groups.leave(group_name)

    async def weight_info(self) -> WeightInfo:
        return self.runner.weight_info()

    @property
    def dtype(self) -> str:
        return self.config.dtype

    @property
    def max_model_len(self) -> int:
        return self.config.max_position

    async def release_memory(self, weights: str | None, kv_cache: bool) -> None:
        await self.memory.release(weights, kv_cache)

    async def restore_memory(self, weights: bool, kv_cache: bool) -> None:
        await self.memory.restore(weights, kv_cache)

    async def is_alive(self) -> bool:
        return self.scheduler.alive() and self.runner.alive()

    async def abort_request(self, request_id: str) -> bool:
        return await self.scheduler.abort(request_id)

    async def rpc(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if method == "weight_hashes":
            return await asyncio.to_thread(self.memory.hashes)
        if method == "tp_layout":  # JSON: a part is "full" or [dim, start, length]
            return [
                {n: p if p == "full" else list(p) for n, p in parts.items()} for parts in self.tp_layout()
            ]
        if method == "worker_layout":  # what each rank serves, as a transfer plan reads it
            return self.worker_layout("self").to_wire()
        if method == "prefix_cache_stats":
            return {**self.cache.stats(), "epoch": self.stamps.epoch}
        raise WeightSyncError(f"unknown rpc {method!r}")

    def observe_commit(self, snapshot: Snapshot) -> None:
        self.stamps.observe_commit(snapshot)
