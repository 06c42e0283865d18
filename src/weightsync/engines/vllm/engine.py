"""The vLLM engine: weightsync's :class:`~weightsync.core.Engine` over ``AsyncLLM``.

Generation, pause modes and cache resets are vLLM's own; weight loading runs in vLLM's
workers through :class:`~weightsync.engines.vllm.worker.WeightSyncExtension`, reached by
``collective_rpc`` with fixed method names only.  Cache resets are honest: while paused the
reset also preempts kept requests (vLLM's ``reset_running_requests``; they recompute with
the new weights on resume), and whatever vLLM answers is what the controller hears.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import os
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from weightsync.core import errors
from weightsync.core.engine import cache_cleared
from weightsync.core.errors import CacheInUse, InvalidRequest, LoadFailed, NotSupported, WeightSyncError
from weightsync.core.requests import InitGroupRequest
from weightsync.core.snapshot import (
    Attestation,
    LoadStats,
    PauseMode,
    PauseOutcome,
    Snapshot,
    TensorSpec,
    WeightInfo,
)
from weightsync.core.sources import WeightSource
from weightsync.engines.generation import Generating
from weightsync.engines.sampling import SALT_MAX, Sampling
from weightsync.engines.stamps import Chunk, Completion, VersionStamps
from weightsync.engines.vllm.checkpoint import served_hashes
from weightsync.engines.vllm.generation import InFlight, sampling_params
from weightsync.engines.vllm.sleep import VllmSleep
from weightsync.engines.vllm.tokenizer import VllmTokenizer

EXTENSION = "weightsync.engines.vllm.worker.WeightSyncExtension"
# verify_weights' scope on vLLM: the recorded hashes of what was loaded, not the live tensors.
LOADED_HASHES = "loaded_hashes"

log = logging.getLogger("weightsync.vllm")

CHECK_POLL_S = 0.02
"""How often the adapter asks vLLM's workers whether a dry run is done (each ask is one
short ``collective_rpc`` between the engine's steps)."""


def epoch_label(epoch: int) -> str:
    """How weight ``epoch`` is named to vLLM: in cache salts, and as the engine core's weight
    version, which vLLM records for every step's tokens (``CompletionOutput.weight_versions``)."""
    return f"weightsync-e{epoch}"


def label_epoch(label: object) -> int | None:
    """The epoch an engine-core weight version names: ``"default"`` (vLLM's own, before
    weightsync named any) is epoch 0; ``None`` for a label weightsync did not set."""
    if label == "default":
        return 0
    prefix = epoch_label(0)[:-1]
    if isinstance(label, str) and label.startswith(prefix) and label[len(prefix) :].isdigit():
        return int(label[len(prefix) :])
    return None


def cache_salt(epoch: int, user: str | None = None) -> str:
    """The prefix-cache salt for a request that starts under weight ``epoch``.

    vLLM keys cached KV blocks by their tokens and the request's ``cache_salt``; salting every
    request with the epoch of the weights it starts under means a request never reuses KV that
    other weights computed, so an update needs no cache reset for correctness.  A caller's own
    (valid) salt is kept inside ours, hashed when the two would be too long.
    """
    ours = epoch_label(epoch)
    if user is None:
        return ours
    combined = f"{ours}.{user}"
    if len(combined) > SALT_MAX:
        combined = f"{ours}.{hashlib.sha256(user.encode()).hexdigest()}"
    return combined


def _raise_for(result: dict[str, Any], *, loading: bool = False) -> dict[str, Any]:
    """Return an extension's result, or raise the error its ``{"error": wire}`` carries
    (rebuilt with :meth:`WeightSyncError.from_wire`; always a ``LoadFailed`` when ``loading``)."""
    if "error" not in result:
        return result
    exc = WeightSyncError.from_wire(result["error"])
    if loading and not isinstance(exc, LoadFailed):
        raise LoadFailed(exc.message, wrote=False, cause=exc)
    if not loading and isinstance(exc, LoadFailed):
        raise exc.cause or errors.EngineFailure(exc.message, code=exc.code, **exc.details)
    raise exc


class VllmEngine(Generating):
    """Drives one ``AsyncLLM``.  Build it with :meth:`from_engine_args` (or pass an
    ``EngineClient``, as the vLLM server middleware does).

    ``tokenizer``: vLLM's text side when vLLM runs with the model's tokenizer (text prompts,
    chat, vLLM's detokenized text and stop strings), else ``None`` (prompts as token ids);
    ``chat_template`` replaces the model's chat template."""

    name = "vllm"
    rpc_methods = ("weight_hashes",)

    def __init__(
        self,
        llm: Any,
        *,
        allowed_weight_dirs: Sequence[str | Path] | None = None,
        owns: bool = True,
        chat_template: str | None = None,
    ) -> None:
        self.llm = llm
        self.tokenizer = VllmTokenizer.of(llm, chat_template)
        self.allowed_roots = (
            [str(Path(d).resolve()) for d in allowed_weight_dirs] if allowed_weight_dirs else None
        )
        self.stamps = VersionStamps()
        self._owns = owns
        self._ids = itertools.count()
        self._checks = itertools.count()  # dry-run tickets
        self._requests = InFlight(llm, self.stamps, cache_salt)
        self._paused = False
        self.sleep = VllmSleep(llm)
        config = getattr(llm, "vllm_config", None)
        # Ranks this engine contributes to a weight-update group (one per tensor/pipeline shard).
        self.world_size = int(config.parallel_config.world_size) if config is not None else 1

    @classmethod
    def from_engine_args(
        cls,
        model: str,
        *,
        allowed_weight_dirs: Sequence[str | Path] | None = None,
        chat_template: str | None = None,
        **engine_args: Any,
    ) -> VllmEngine:
        """Start ``AsyncLLM`` on ``model`` with the weightsync worker extension.  vLLM's
        processes end when this process does, however it ends (see
        :mod:`~weightsync.engines.vllm.watchdog`)."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from weightsync.engines.vllm.watchdog import ENV

        os.environ[ENV] = str(os.getpid())  # inherited by the processes vLLM starts
        args = AsyncEngineArgs(model=model, worker_extension_cls=EXTENSION, **engine_args)
        llm = AsyncLLM.from_engine_args(args)
        return cls(llm, allowed_weight_dirs=allowed_weight_dirs, chat_template=chat_template)

    async def _rpc(self, method: str, *args: Any) -> dict[str, Any]:
        results = await self.llm.collective_rpc(method, args=args)
        return results[0]  # type: ignore[no-any-return]  # every rank answers alike; rank 0 speaks

    async def _rpc_all(self, method: str, *args: Any, loading: bool = False) -> dict[str, Any]:
        results = await self.llm.collective_rpc(method, args=args)
        for r in results:
            _raise_for(r, loading=loading)
        return results[0]  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ Engine protocol

    async def pause(self, mode: PauseMode, clear_cache: bool) -> PauseOutcome:
        in_flight = len(self._requests.ids())
        await self.llm.pause_generation(mode=mode.value, clear_cache=False)
        self._paused = True
        cleared = await cache_cleared(self.reset_prefix_cache()) if clear_cache else False
        return PauseOutcome(aborted=in_flight if mode is PauseMode.ABORT else 0, cache_cleared=cleared)

    async def resume(self) -> None:
        await self.llm.resume_generation()
        self._paused = False

    async def reset_prefix_cache(self) -> None:
        # While paused, kept requests are preempted too and recompute on resume; while
        # running, vLLM refuses (returns False) when requests hold blocks.
        try:
            done = await self.llm.reset_prefix_cache(reset_running_requests=self._paused)
        except RuntimeError as exc:
            raise CacheInUse() from exc
        if not done:
            raise CacheInUse()

    async def release_memory(self, weights: str | None, kv_cache: bool) -> None:
        await self.sleep.release(weights, kv_cache)

    async def restore_memory(self, weights: bool, kv_cache: bool) -> None:
        await self.sleep.wake(weights, kv_cache, paused=self._paused)

    async def load_weights(self, source: WeightSource) -> LoadStats:
        if "weights" in self.sleep.asleep:  # discarded weights get their memory back first
            await self.sleep.wake(True, False, paused=self._paused)
        self.stamps.bump()  # tokens produced while weights change belong to no version
        try:
            await self._label_steps(before_load=True)
            out = await self._rpc_all("weightsync_load", source.to_wire(), self.allowed_roots, loading=True)
        finally:
            self.stamps.bump()
            await self._label_steps(before_load=False)
        hashes = out.get("hashes")
        return LoadStats(
            tensors=int(out["tensors"]),
            bytes=int(out["bytes"]),
            seconds=float(out["seconds"]),
            files=int(out.get("files", 0)),
            hashes=dict(hashes) if hashes is not None else None,
            extra=dict(out.get("extra", {})),
        )

    async def _label_steps(self, *, before_load: bool) -> None:
        """Name the current epoch as the engine core's weight version, so vLLM labels every
        later step's tokens with it (what the server middleware stamps vLLM's completions by).
        Before a load a failure refuses the load (nothing written); after it, the steps keep
        the label of the epoch being written, which names no version: never a wrong one."""
        label = getattr(self.llm, "update_weight_version", None)
        if label is None:  # a vLLM without engine-core weight versions
            return
        try:
            await label(epoch_label(self.stamps.epoch))
        except Exception as exc:
            if before_load:
                raise LoadFailed(f"vLLM did not take the weight epoch's label: {exc}", wrote=False) from None
            log.warning("vLLM did not take the weight epoch's label (%s): its tokens name no version", exc)

    # ------------------------------------------------------------------ attestation

    def initial_hashes(self) -> Mapping[str, str] | None:
        """The hashes of the checkpoint vLLM started on (read once, when the controller is
        made, so a fresh worker reports a digest): the same file and the same hash the
        worker extension records before its first load.  ``None`` when the model is not a
        local safetensors checkpoint (a hub name, say)."""
        model = self._model_path()
        if model is None:
            return None
        try:
            return served_hashes(model)
        except Exception as exc:
            log.warning("no initial digest: the served checkpoint %r could not be hashed (%s)", model, exc)
            return None

    async def check_source(self, source: WeightSource) -> Mapping[str, str] | None:
        """A dry run in vLLM's workers: the channel reader's ``validate`` against the served
        checkpoint, nothing written.  Returns the hashes the load would write where the
        source declares them (a checkpoint manifest).

        Each worker runs the check in a thread of its own (``weightsync_check_start``) and
        this polls for the answers (``weightsync_check_result``, every :data:`CHECK_POLL_S`):
        a check answered inside one ``collective_rpc`` would hold up vLLM's engine core, and
        so every request, for as long as it reads and hashes the checkpoint."""
        ticket = next(self._checks)
        await self._rpc_all("weightsync_check_start", ticket, source.to_wire(), self.allowed_roots)
        while True:
            results = await self.llm.collective_rpc("weightsync_check_result", args=(ticket,))
            if all(not r.get("pending") for r in results):
                break
            await asyncio.sleep(CHECK_POLL_S)
        for r in results:
            _raise_for(r)
        hashes = results[0]["hashes"]
        return dict(hashes) if hashes is not None else None

    async def attest(self) -> Attestation:
        """What every vLLM worker recorded of the weights it loaded (scope ``loaded_hashes``).

        vLLM's live parameters are in kernel layout (repacked, fused, sharded), so they cannot
        be hashed against a trainer's tensors; what can be attested is the hash of every
        tensor handed to vLLM, recorded as it passed.  Every rank must agree.  It does not
        see a parameter changed in vLLM's memory behind weightsync's back."""
        results = await self.llm.collective_rpc("weightsync_weight_hashes")
        found = [_raise_for(r)["hashes"] for r in results]
        if any(h != found[0] for h in found[1:]):
            raise errors.EngineFailure("vLLM's workers recorded different weights", code="ranks_disagree")
        return Attestation(dict(found[0]), LOADED_HASHES)

    @property
    def dtype(self) -> str:
        dtype = getattr(getattr(getattr(self.llm, "vllm_config", None), "model_config", None), "dtype", None)
        return str(dtype).removeprefix("torch.") if dtype is not None else "auto"

    @property
    def max_model_len(self) -> int:
        config = getattr(getattr(self.llm, "vllm_config", None), "model_config", None)
        return int(getattr(config, "max_model_len", 0) or 0)

    def _model_path(self) -> str | None:
        config = getattr(self.llm, "vllm_config", None)
        model = getattr(getattr(config, "model_config", None), "model", None)
        return str(model) if isinstance(model, str) and Path(model).exists() else None

    async def weight_info(self) -> WeightInfo:
        out = _raise_for(await self._rpc("weightsync_weight_info"))
        return WeightInfo([TensorSpec(n, d, tuple(s)) for n, d, s in out["tensors"]])

    async def is_alive(self) -> bool:
        try:
            await self.llm.check_health()
        except Exception:
            return False
        return not getattr(self.llm, "errored", False)

    async def abort_request(self, request_id: str) -> bool:
        return await self._requests.abort(request_id)

    def metric_families(self) -> Iterator[Any]:
        """vLLM's own Prometheus series (``vllm:*``: requests, tokens, ``n`` per request…), as
        vLLM's server shows them on its ``/metrics``."""
        from prometheus_client import REGISTRY

        for family in REGISTRY.collect():
            if family.name.startswith("vllm:"):
                yield family

    async def init_group(self, request: InitGroupRequest) -> None:
        await self._rpc_all("weightsync_init_group", request.to_wire())

    async def destroy_group(self, group_name: str) -> None:
        await self._rpc_all("weightsync_destroy_group", group_name)

    async def rpc(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if method == "weight_hashes":
            return (await self.attest()).hashes
        raise NotSupported(f"no rpc {method!r}")

    def observe_commit(self, snapshot: Snapshot) -> None:
        self.stamps.observe_commit(snapshot)

    async def close(self) -> None:
        if self._owns:
            self.llm.shutdown()

    # ------------------------------------------------------------------ generation

    def _new_request_id(self) -> str:
        return f"ws-{next(self._ids)}"

    async def _generate(self, prompt: list[int], sampling: Sampling, rid: str) -> Completion:
        async for item in self._stream(prompt, sampling, rid):
            if isinstance(item, Completion):
                return item
        raise AssertionError("a generation ends with its completion")

    def _stream(self, prompt: list[int], sampling: Sampling, rid: str) -> AsyncIterator[Chunk | Completion]:
        sampling_params(sampling, detokenize=self.tokenizer is not None)  # refusals come before generating
        return self._items(self._run(prompt, sampling, [rid]))

    @staticmethod
    async def _items(run: AsyncIterator[tuple[int, Chunk | Completion]]) -> AsyncIterator[Chunk | Completion]:
        try:
            async for _, item in run:
                yield item
        finally:
            await run.aclose()  # type: ignore[attr-defined]

    def stream_samples(
        self,
        prompt: list[int],
        n: int,
        *,
        request_ids: Sequence[str | None] | None = None,
        sampling: Sampling | None = None,
        **fields: Any,
    ) -> AsyncIterator[tuple[int, Chunk | Completion]]:
        """``n`` samples of ``prompt`` as one vLLM request (``SamplingParams(n=n)``; the
        ``j``-th seeded ``seed + j`` by vLLM): ``(j, chunk or completion)`` as they come, each
        sample's completion as it finishes.  ``request_ids`` name the samples (``None``: a
        fresh id), each abortable alone; closing the iterator aborts them all.  Every refusal
        of :meth:`stream` is raised by this call."""
        s = sampling or Sampling(**fields)
        names = list(request_ids) if request_ids is not None else [None] * n
        if len(names) != n or n < 1:
            raise InvalidRequest(f"{n} samples need {n} request ids", code="invalid_value", field="n")
        rids = [self._admit(prompt, r) for r in names]
        if len(set(rids)) != n:
            raise InvalidRequest("the samples' request ids repeat", code="invalid_value", field="request_id")
        sampling_params(s, n, detokenize=self.tokenizer is not None)
        return self._run(list(prompt), s, rids)

    def _run(
        self, prompt: list[int], sampling: Sampling, rids: list[str]
    ) -> AsyncIterator[tuple[int, Chunk | Completion]]:
        return self._requests.run(self.llm.generate, prompt, sampling, rids, self.tokenizer is not None)

    def in_flight(self) -> list[str]:
        return self._requests.ids()
