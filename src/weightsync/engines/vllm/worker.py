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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from weightsync.core.errors import EngineFailure, InvalidRequest, LoadFailed, WeightSyncError
from weightsync.core.requests import DistributedSource, InitGroupRequest, TensorSource, UpdateRequest
from weightsync.core.values import TensorSpec
from weightsync.transports.disk import DiskCheckpoint
from weightsync.transports.distributed.worker import GroupRegistry
from weightsync.transports.loading import describe_exception
from weightsync.transports.sink import check_metadata, tensor_hash
from weightsync.transports.tensor.shm import iter_shared

from . import watchdog


def error_reply(exc: WeightSyncError, wrote: bool = False) -> dict[str, Any]:
    return {
        "error": {
            "type": type(exc).__name__,
            "code": exc.code,
            "message": exc.message,
            "http_status": exc.http_status,
            "details": exc.details,
            "wrote": wrote,
        }
    }


def refusal(exc: BaseException) -> dict[str, Any]:
    """The reply for a failure before anything was written: a family error as it is, any other
    exception (a validator that let an ``OverflowError`` or ``KeyError`` escape) as a 400
    ``invalid_source`` naming its type, like the reference engine's loads."""
    if isinstance(exc, WeightSyncError):
        return error_reply(exc)
    return error_reply(
        InvalidRequest(
            f"the source was refused: {describe_exception(exc)}",
            code="invalid_source",
            exception=type(exc).__name__,
        )
    )


def failure(exc: BaseException) -> dict[str, Any]:
    """The reply for a method that is not a load: a family error as it is, any other exception
    as an engine failure (500) that names its type."""
    if isinstance(exc, WeightSyncError):
        return error_reply(exc)
    return error_reply(EngineFailure(describe_exception(exc)))


class _Recorder:
    """Wraps a tensor stream: notes the first tensor handed to vLLM and hashes every one."""

    def __init__(self, stream: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.stream = stream
        self.wrote = False
        self.source_error: BaseException | None = None  # what the source raised, if it failed
        self.hashes: dict[str, str] = {}
        self.bytes = 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        while True:
            try:
                name, tensor = next(self.stream)
            except StopIteration:
                return
            except BaseException as exc:
                self.source_error = exc
                raise
            self.hashes[name] = tensor_hash(tensor)
            self.bytes += tensor.numel() * tensor.element_size()
            self.wrote = True
            yield name, tensor


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

    def _ws_reload(self, stream: Iterator[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        recorder = _Recorder(stream)
        t0 = time.perf_counter()
        try:
            self.model_runner.reload_weights(weights_iterator=iter(recorder), is_checkpoint_format=True)  # type: ignore[attr-defined]
        except Exception as exc:
            if not recorder.wrote:  # no tensor reached vLLM: the served weights are untouched
                if recorder.source_error is not None:  # vLLM may wrap what the source raised
                    return refusal(recorder.source_error)
                failed = EngineFailure(f"vLLM failed before loading: {describe_exception(exc)}")
                return error_reply(failed)
            self._ws_hashes = None
            if isinstance(exc, WeightSyncError):
                return error_reply(exc, wrote=True)
            failed = LoadFailed(
                f"loading failed after writing began: {describe_exception(exc)}",
                wrote=True,
                code="read_failed",
            )
            return error_reply(failed, wrote=True)
        previous = self._ws_hashes or {}
        self._ws_hashes = {**previous, **recorder.hashes}
        return {
            "tensors": len(recorder.hashes),
            "bytes": recorder.bytes,
            "seconds": time.perf_counter() - t0,
        }

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

    def weightsync_load_disk(
        self, model_path: str, allow_partial: bool, allow_dtype_cast: bool, allowed_roots: list[str] | None
    ) -> dict[str, Any]:
        try:
            self._ws_current_hashes()  # remember the current weights before changing them
            ckpt = DiskCheckpoint.open(
                model_path, [Path(r) for r in allowed_roots] if allowed_roots else None
            )
            check_metadata(
                (e.spec for e in ckpt.entries),
                self._ws_checkpoint_specs(),
                allow_partial=allow_partial,
                allow_dtype_cast=allow_dtype_cast,
            )
            ckpt.verify_checksums()
        except Exception as exc:
            return refusal(exc)
        result = self._ws_reload(ckpt.stream())
        if "error" not in result:
            result["files"] = len(ckpt.shards)
        return result

    def weightsync_load_tensor(self, tensors: list[dict[str, Any]]) -> dict[str, Any]:
        """Load tensors a colocated trainer put in shared memory (see the tensor transport)."""
        try:
            source = UpdateRequest.from_tensor_body({"tensors": tensors}).source
            if not isinstance(source, TensorSource):
                raise InvalidRequest("not a tensor source", code="invalid_source")
            self._ws_current_hashes()
            check_metadata((h.spec for h in source.tensors), self._ws_checkpoint_specs(), allow_partial=True)
            stream = iter_shared(source)
        except Exception as exc:
            return refusal(exc)
        return self._ws_reload(stream)

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

    def weightsync_receive(self, fields: dict[str, Any]) -> dict[str, Any]:
        try:
            source = DistributedSource(
                fields["group_name"],
                [TensorSpec(n, d, s) for n, d, s in fields["tensors"]],
                fields.get("bucket_bytes"),
                fields.get("stream_id"),
            )
            self._ws_current_hashes()
            check_metadata(source.tensors, self._ws_checkpoint_specs(), allow_partial=True)
            stream = self._ws_registry().iter_stream(source)
        except Exception as exc:
            return refusal(exc)
        return self._ws_reload(stream)


watchdog.start()  # vLLM imports this module in each of its workers: they end with the server
