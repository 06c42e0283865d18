"""``WeightSyncExtension``: weightsync's methods inside vLLM's workers.

Pass ``worker_extension_cls="weightsync.engines.vllm.worker.WeightSyncExtension"`` to vLLM;
the adapter (:mod:`weightsync.engines.vllm.engine`) reaches these methods — and only these,
by fixed names — through ``collective_rpc``.  Every method returns a plain dict: results
cross a process boundary, and an error comes back as ``{"error": {...}}`` with the code,
HTTP status and whether weights were written, instead of a stringified exception.

Weights are loaded through vLLM's own in-place reload (``model_runner.reload_weights`` with
checkpoint-format tensors), which re-runs the kernel repacking the CPU backend needs.  What
weightsync adds: the whole source is validated against the served checkpoint's names,
shapes and dtypes before the first tensor is handed over, and the per-tensor hashes of what
was loaded are recorded (the live parameters are in kernel layout, so they cannot be
compared byte for byte with a trainer's tensors).  A delta is patched and verified on the
worker's checkpoint-form copy of its weights, then reloaded the same way (see :mod:`.delta`).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import attrs

from weightsync.core.errors import IllegalState, LoadFailed, NotFound, WeightSyncError
from weightsync.core.held import HeldWeights
from weightsync.core.requests import InitGroupRequest
from weightsync.core.snapshot import TensorSpec
from weightsync.core.sources import PlanSource, WeightSource, source_from_wire
from weightsync.engines.vllm import watchdog
from weightsync.engines.vllm.checkpoint import served_hashes, served_specs
from weightsync.engines.vllm.delta import (
    DELTA_KINDS,
    BaseCopy,
    DeltaSink,
    delta_base_kept,
    refuse_sharded,
    refuse_without_copy,
)
from weightsync.engines.vllm.feed import FeedTarget, ScratchPool, _any_core
from weightsync.engines.vllm.layerwise import end_unfinished_reload
from weightsync.engines.vllm.reload import ReloadSink
from weightsync.transports import failures
from weightsync.transports.disk.facts import FactsStore
from weightsync.transports.disk.reader import DiskReader
from weightsync.transports.distributed.worker import GroupRegistry
from weightsync.transports.failures import failed
from weightsync.transports.loading import LoadContext, Reader, check_source, load, open_reader
from weightsync.transports.plan.pull import pull_reader
from weightsync.transports.sink import PullTarget


def error_reply(exc: WeightSyncError) -> dict[str, Any]:
    """``{"error": wire}``: the error's :meth:`~WeightSyncError.to_wire` form (a load's
    ``wrote`` included); the adapter rebuilds it with ``WeightSyncError.from_wire``."""
    return {"error": exc.to_wire()}


def refusal(exc: BaseException) -> dict[str, Any]:
    """The reply for a failure before anything was written: a family error as it is, any other
    exception (a validator that let an ``OverflowError`` or ``KeyError`` escape) as a 400
    ``invalid_source`` naming its type, like the reference engine's loads."""
    return error_reply(failed(exc, "weight", wrote=False))


def failure(exc: BaseException) -> dict[str, Any]:
    """The reply for a method that is not a load: a family error as it is, any other exception
    as an engine failure (500) that names its type."""
    return error_reply(failures.failure(exc))


@runtime_checkable
class ServesModel(Protocol):
    """A vLLM model runner that holds a model (the one a reload writes into)."""

    def get_model(self) -> Any: ...


class WeightSyncExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker."""

    _ws_groups: GroupRegistry | None = None
    _ws_facts: FactsStore | None = None
    _ws_specs: dict[str, TensorSpec] | None = None
    # The weights held: the served checkpoint's hashes until a load wrote, then what each
    # load handed to vLLM (the same bookkeeping as the controller's).
    _ws_weights: HeldWeights | None = None
    # Memory for checkpoint tensors on their way into vLLM, kept between loads (see .feed).
    _ws_scratch: ScratchPool | None = None
    # Dry runs in progress in a thread of their own (weightsync_check_start), by ticket.
    _ws_checker: ThreadPoolExecutor | None = None
    _ws_checks: dict[int, Future[dict[str, Any]]] | None = None
    # The served weights in checkpoint form, for deltas (one rank only; see .delta).
    _ws_copy: BaseCopy | None = None

    # ------------------------------------------------------------------ helpers

    def _ws_model(self) -> str:
        return str(self.vllm_config.model_config.model)  # type: ignore[attr-defined]

    def _ws_checkpoint_specs(self) -> dict[str, TensorSpec]:
        """Names, shapes and dtypes of the checkpoint the engine serves (HF format)."""
        if self._ws_specs is None:
            self._ws_specs = served_specs(self._ws_model())
        return self._ws_specs

    def _ws_held(self) -> HeldWeights:
        """What the served weights were loaded from (read from the served checkpoint once)."""
        if self._ws_weights is None:
            self._ws_weights = HeldWeights.starting_with(served_hashes(self._ws_model()))
        return self._ws_weights

    def _ws_end_unfinished_reload(self) -> None:
        """Reset vLLM's per-layer reload records that a failed reload left behind (see
        :mod:`.layerwise`); nothing to do for a runner without a model (or none loaded)."""
        runner = self.model_runner  # type: ignore[attr-defined]
        if isinstance(runner, ServesModel):
            end_unfinished_reload(runner.get_model(), self.vllm_config.model_config)  # type: ignore[attr-defined]

    def _ws_world_size(self) -> int:
        return int(self.vllm_config.parallel_config.world_size)  # type: ignore[attr-defined]

    def _ws_refuse_delta(self, source: WeightSource) -> None:
        """Refuse a delta this worker cannot take (sharded, or keeping no copy), before reading."""
        if source.kind in DELTA_KINDS:
            refuse_sharded(source, self._ws_world_size())
            refuse_without_copy(source)

    def _ws_base_copy(self) -> BaseCopy | None:
        """The checkpoint-form copy deltas patch; ``None`` on a sharded model or where the worker
        was not asked to keep one (no deltas, see :data:`~.delta.DELTA_BASE_ENV`)."""
        if self._ws_copy is None and delta_base_kept() and self._ws_world_size() == 1:
            self._ws_copy = BaseCopy(self._ws_model())
        return self._ws_copy

    def _ws_registry(self) -> GroupRegistry:
        if self._ws_groups is None:
            self._ws_groups = GroupRegistry()
        return self._ws_groups

    def _ws_context(self, allowed_roots: list[str] | None) -> LoadContext:
        """The channels' context: this worker's groups, and what its dry runs verified (so
        an update prepared by ``weightsync_check`` copies once)."""
        roots = tuple(Path(r) for r in allowed_roots) if allowed_roots else None
        if self._ws_facts is None:
            self._ws_facts = FactsStore()
        return LoadContext(roots, self._ws_registry(), self._ws_facts)

    def _ws_reader(self, source: WeightSource, ctx: LoadContext) -> Reader:
        """``source``'s channel reader; a plan's is :func:`pull_reader`'s (every piece of a
        tensor received into scratch, the tensor handed to vLLM once complete), since vLLM
        only pulls whole tensors: the reference engine's reader receives in place."""
        self._ws_refuse_delta(source)
        if isinstance(source, PlanSource) and ctx.groups is not None:
            return pull_reader(ctx.groups, source)
        return open_reader(source, ctx)

    def _ws_load(self, source: WeightSource, allowed_roots: list[str] | None = None) -> dict[str, Any]:
        """Open ``source``'s channel reader (the same reader the reference engine pushes from)
        and :meth:`_ws_reload` it; a failure to open it is a refusal."""
        try:
            self._ws_held()  # remember the current weights before changing them
            self._ws_checkpoint_specs()  # read here, where failing to read it is a refusal
            reader = self._ws_reader(source, self._ws_context(allowed_roots))
        except Exception as exc:
            return refusal(exc)
        return self._ws_reload(reader)

    def _ws_reload(self, reader: Reader) -> dict[str, Any]:
        """The shared load (:func:`~weightsync.transports.loading.load`) of ``reader`` into
        vLLM's in-place reload (:class:`~.reload.ReloadSink`): validated against the served
        checkpoint, then pulled by vLLM; what is torn or refused is decided by
        ``failures.failed``, and the reply is the load's ``LoadStats``.

        A checkpoint is read ahead in a thread of its own into reused memory (see
        :mod:`.feed`); the other channels' tensors are handed on as their reader yields them.
        Every tensor handed over is kept in the checkpoint-form copy; a delta goes through
        :class:`~.delta.DeltaSink` (patched and verified on that copy, then reloaded)."""
        target: FeedTarget | PullTarget
        if isinstance(reader, DiskReader):
            self._ws_scratch = self._ws_scratch or ScratchPool()
            target = FeedTarget(self._ws_scratch)
        else:
            target = PullTarget()
        runner = self.model_runner  # type: ignore[attr-defined]
        specs, copy = self._ws_checkpoint_specs(), self._ws_base_copy()
        sink: ReloadSink | DeltaSink
        if reader.kind in DELTA_KINDS and copy is not None:
            sink = DeltaSink(specs, runner, self._ws_end_unfinished_reload, copy, self._ws_held())
        else:
            record = None if copy is None else copy.record
            sink = ReloadSink(specs, target, runner, self._ws_end_unfinished_reload, record)
        try:
            stats = load(reader, sink)
        except LoadFailed as exc:
            if exc.wrote:  # which tensors vLLM took, and so what it holds, is unknown
                self._ws_weights = self._ws_held().torn()
            return error_reply(exc)
        finally:
            if self._ws_scratch is not None:
                self._ws_scratch.trim()
        self._ws_weights = self._ws_held().loaded(stats.hashes, stats.tensors)
        if isinstance(sink, DeltaSink) and copy is not None:
            copy.adopt(sink.patched, sink.hashes)
        elif copy is not None:
            copy.commit(stats.hashes)
        return attrs.asdict(stats)

    # ------------------------------------------------------------------ reachable methods

    def weightsync_weight_info(self) -> dict[str, Any]:
        try:
            specs = self._ws_checkpoint_specs()
        except Exception as exc:
            return failure(exc)
        return {"tensors": [(s.name, s.dtype, list(s.shape)) for s in specs.values()]}

    def weightsync_weight_hashes(self) -> dict[str, Any]:
        """xxh3-64 of every tensor the served weights were loaded from; ``409
        weights_unknown`` after a load that left some tensor's content unknown (a torn one)."""
        try:
            held = self._ws_held()
            if held.unknown:
                raise IllegalState(
                    f"the content of {len(held.unknown)} tensors is unknown (a load failed after "
                    "writing began); a complete update records it again",
                    code="weights_unknown",
                )
            return {"hashes": dict(held.hashes)}
        except Exception as exc:
            return failure(exc)

    def weightsync_check(
        self, wire: dict[str, Any], allowed_roots: list[str] | None = None
    ) -> dict[str, Any]:
        """A dry run: validate the source exactly as :meth:`weightsync_load` does before its
        first tensor (the channel reader's ``validate`` against the served checkpoint) and
        write nothing.  Returns ``{"hashes": ...}``, the hashes the load would write where the
        source declares them (a checkpoint manifest), else ``None``; a refusal as a load's.

        What it verified stays with this worker, so the load that follows copies once; it
        also records the served weights' hashes now, while serving, if no load did yet.
        This answers when the check is done: vLLM's engine steps no request meanwhile (the
        adapter uses :meth:`weightsync_check_start` instead)."""
        try:
            specs, ctx = self._ws_check_context(allowed_roots)
        except Exception as exc:
            return failure(exc)
        return self._ws_check(wire, specs, ctx)

    def weightsync_check_start(
        self, ticket: int, wire: dict[str, Any], allowed_roots: list[str] | None = None
    ) -> dict[str, Any]:
        """Start :meth:`weightsync_check` of ``wire`` in a thread of this worker, under the
        adapter's ``ticket``, and answer at once (``{}``): vLLM's engine keeps stepping
        requests while the checkpoint is read and hashed, which a check in the RPC itself
        holds up for as long as it reads.  :meth:`weightsync_check_result` answers it.  The
        check is the same; what it verified stays with this worker as well."""
        try:
            specs, ctx = self._ws_check_context(allowed_roots)
            if self._ws_checker is None or self._ws_checks is None:
                self._ws_checker = ThreadPoolExecutor(1, "weightsync-check", initializer=_any_core)
                self._ws_checks = {}
            self._ws_checks[ticket] = self._ws_checker.submit(self._ws_check, wire, specs, ctx)
        except Exception as exc:
            return failure(exc)
        return {}

    def weightsync_check_result(self, ticket: int) -> dict[str, Any]:
        """``{"pending": true}`` while the check started under ``ticket`` runs, then its
        answer, once (as :meth:`weightsync_check` gives it); ``404 unknown_check`` for a
        ticket this worker did not start or already answered."""
        done = (self._ws_checks or {}).get(ticket)
        if done is None or self._ws_checks is None:
            return failure(NotFound(f"no dry run {ticket!r} in progress", code="unknown_check"))
        if not done.done():
            return {"pending": True}
        del self._ws_checks[ticket]
        return done.result()  # _ws_check answers errors as data

    def _ws_check_context(self, allowed_roots: list[str] | None) -> tuple[dict[str, TensorSpec], LoadContext]:
        """What a check needs, made in the RPC's own thread (the served weights' record
        included, so a check thread never races a load to make it)."""
        specs = self._ws_checkpoint_specs()
        self._ws_held()
        return specs, self._ws_context(allowed_roots)

    def _ws_check(
        self, wire: dict[str, Any], specs: dict[str, TensorSpec], ctx: LoadContext
    ) -> dict[str, Any]:
        try:
            source = source_from_wire(wire)
            self._ws_refuse_delta(source)
            hashes = check_source(source, specs, ctx)
        except Exception as exc:
            return error_reply(failures.refusal(exc, "weight"))
        return {"hashes": hashes}

    def weightsync_load(self, wire: dict[str, Any], allowed_roots: list[str] | None = None) -> dict[str, Any]:
        """Load the source the adapter sent as its ``to_wire`` dict (any channel), rebuilt with
        :func:`~weightsync.core.sources.source_from_wire`; a malformed dict is a refusal."""
        try:
            source = source_from_wire(wire)
        except Exception as exc:
            return refusal(exc)
        return self._ws_load(source, allowed_roots)

    def weightsync_init_group(self, wire: dict[str, Any]) -> dict[str, Any]:
        """Join the group the adapter sent as :meth:`InitGroupRequest.to_wire`'s dict, rebuilt
        (and so checked) with ``from_wire``; a malformed dict is a refusal."""
        try:
            request = InitGroupRequest.from_wire(wire)
            self._ws_registry().join(request, local_rank=getattr(self, "rank", 0))
        except Exception as exc:
            return failure(exc)
        return {}

    def weightsync_destroy_group(self, group_name: str) -> dict[str, Any]:
        try:
            self._ws_registry().destroy(group_name)
        except Exception as exc:
            return failure(exc)
        return {}

    def weightsync_transfer_engine(self) -> dict[str, object]:
        """The class name of the weight-transfer engine vLLM built in this worker and the
        xxh3-64 of every tensor its last update received (what ``collective_rpc`` returns);
        ``NoneType`` and nothing received without a transfer config."""
        # Imported here: the transfer backend is vLLM's factory's business, loaded only by
        # a worker that names transfer_extension.
        from weightsync.engines.vllm.transfer import WeightSyncWeightTransferEngine

        engine = getattr(self, "weight_transfer_engine", None)
        received = engine.received if isinstance(engine, WeightSyncWeightTransferEngine) else {}
        return {"engine": type(engine).__name__, "received": dict(received)}


watchdog.start()  # vLLM imports this module in each of its workers: they end with the server
