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
compared byte for byte with a trainer's tensors).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from weightsync.core.errors import EngineFailure, WeightSyncError
from weightsync.core.requests import InitGroupRequest, WeightSource, source_from_wire
from weightsync.core.values import TensorSpec
from weightsync.transports.disk.reader import DiskCheckpoint, DiskReader
from weightsync.transports.distributed.worker import GroupRegistry
from weightsync.transports.loading import LoadContext, Reader, describe_exception, failed, open_reader
from weightsync.transports.sink import PullTarget, pull, tensor_hash

from . import watchdog


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
    if isinstance(exc, WeightSyncError):
        return error_reply(exc)
    return error_reply(EngineFailure(describe_exception(exc)))


class WeightSyncExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker."""

    _ws_groups: GroupRegistry | None = None
    _ws_specs: dict[str, TensorSpec] | None = None
    _ws_hashes: dict[str, str] | None = None

    # ------------------------------------------------------------------ helpers

    def _ws_checkpoint_specs(self) -> dict[str, TensorSpec]:
        """Names, shapes and dtypes of the checkpoint the engine serves (HF format)."""
        if self._ws_specs is None:
            ckpt = DiskCheckpoint.open(str(Path(self.vllm_config.model_config.model).resolve()))  # type: ignore[attr-defined]
            self._ws_specs = {e.spec.name: e.spec for e in ckpt.entries}
        return self._ws_specs

    def _ws_current_hashes(self) -> dict[str, str]:
        if self._ws_hashes is None:
            ckpt = DiskCheckpoint.open(str(Path(self.vllm_config.model_config.model).resolve()))  # type: ignore[attr-defined]
            self._ws_hashes = {name: tensor_hash(t) for name, t in ckpt.stream()}
        return self._ws_hashes

    def _ws_registry(self) -> GroupRegistry:
        if self._ws_groups is None:
            self._ws_groups = GroupRegistry()
        return self._ws_groups

    def _ws_load(self, source: WeightSource, allowed_roots: list[str] | None = None) -> dict[str, Any]:
        """Validate ``source`` with its channel's reader against the served checkpoint (the
        same reader the reference engine pushes from), then :meth:`_ws_reload` it."""
        roots = tuple(Path(r) for r in allowed_roots) if allowed_roots else None
        try:
            self._ws_current_hashes()  # remember the current weights before changing them
            reader = open_reader(source, LoadContext(roots, self._ws_registry()))
            reader.validate(self._ws_checkpoint_specs())
        except Exception as exc:
            return refusal(exc)
        return self._ws_reload(reader)

    def _ws_reload(self, reader: Reader) -> dict[str, Any]:
        """Let vLLM pull ``reader``'s validated stream; ``wrote`` turns true as the first
        tensor is handed to vLLM, and what is torn or refused is decided by ``loading.failed``."""
        target = PullTarget()
        t0 = time.perf_counter()
        try:
            stream = pull(reader.stream(target), target)
            self.model_runner.reload_weights(weights_iterator=stream, is_checkpoint_format=True)  # type: ignore[attr-defined]
        except Exception as exc:
            if target.error is None and not target.wrote:  # vLLM itself failed, nothing handed over
                return error_reply(EngineFailure(f"vLLM failed before loading: {describe_exception(exc)}"))
            if target.wrote:
                self._ws_hashes = None
            return error_reply(failed(target.error or exc, reader.kind, target.wrote))
        finally:
            reader.close()
        self._ws_hashes = {**(self._ws_hashes or {}), **target.hashes}
        result: dict[str, Any] = {
            "tensors": target.tensors,
            "bytes": target.bytes,
            "seconds": time.perf_counter() - t0,
        }
        if isinstance(reader, DiskReader):
            result["files"] = reader.files
        return result

    # ------------------------------------------------------------------ reachable methods

    def weightsync_weight_info(self) -> dict[str, Any]:
        try:
            specs = self._ws_checkpoint_specs()
        except Exception as exc:
            return failure(exc)
        return {"tensors": [(s.name, s.dtype, list(s.shape)) for s in specs.values()]}

    def weightsync_weight_hashes(self) -> dict[str, Any]:
        """xxh3-64 of every tensor the served weights were loaded from."""
        try:
            return {"hashes": dict(self._ws_current_hashes())}
        except Exception as exc:
            return failure(exc)

    def weightsync_load(self, wire: dict[str, Any], allowed_roots: list[str] | None = None) -> dict[str, Any]:
        """Load the source the adapter sent as its ``to_wire`` dict (any channel), rebuilt with
        :func:`~weightsync.core.requests.source_from_wire`; a malformed dict is a refusal."""
        try:
            source = source_from_wire(wire)
        except Exception as exc:
            return refusal(exc)
        return self._ws_load(source, allowed_roots)

    def weightsync_init_group(self, fields: dict[str, Any]) -> dict[str, Any]:
        try:
            self._ws_registry().join(InitGroupRequest(**fields), local_rank=getattr(self, "rank", 0))
        except Exception as exc:
            return failure(exc)
        return {}

    def weightsync_destroy_group(self, group_name: str) -> dict[str, Any]:
        try:
            self._ws_registry().destroy(group_name)
        except Exception as exc:
            return failure(exc)
        return {}


watchdog.start()  # vLLM imports this module in each of its workers: they end with the server
