"""Deltas on a vLLM worker: a delta checkpoint (``DeltaSource``) or a sparse delta stream
(``DeltaStreamSource``), applied all or nothing, verified before vLLM sees a byte.

Why not in place.  vLLM's own ``load_checkpoint_weight_patches`` writes sparse patches through
the model's loaders with a NaN-masked ``Tensor.copy_``, into the live parameters.  On vLLM's
CPU platform there is nothing there to write: after loading, every linear layer's weight is
packed into a oneDNN handle and its parameter left empty (``dispatch_cpu_unquantized_gemm(
remove_weight=True)``; ``qkv_proj.weight`` has shape ``(0,)``), and ``lm_head`` keeps its
parameter but computes from a packed copy, so a write there would change nothing the model
computes.  Kernel-layout memory cannot be read back either, so neither the old values an undo
needs nor the new ones a check needs are in reach.

So a vLLM worker (world size 1) keeps its weights in checkpoint form as well, in host memory
(:class:`BaseCopy`: what each load handed to vLLM, with the hash its channel computed; the
served checkpoint's tensors are read from its files the first time they are needed), and
:class:`DeltaSink` applies a delta in three steps:

1. **the patch, on copies**: the channel reader's ``validate`` has checked the base (``409
   base_mismatch``) and the payload; the reader's stream then patches clones of the base
   copy's tensors with the reference engine's :func:`weightsync.transports.delta.apply.apply`,
   which verifies each one against the target the trainer claims (the linear move, or one
   xxh3 pass; read back against the values received when nothing is claimed).  Still nothing
   is written to vLLM: a delta that does not verify is refused (``400 delta_unverified``);
2. **the write**: vLLM's in-place reload (:class:`~.reload.ReloadSink`, the path of every full
   load, which re-runs vLLM's kernel processing) of every tensor, the patched ones and the base
   copy's others;
3. **the undo**, on a failure during the write: the same reload of the base copy's tensors.
   When vLLM took every one of them the worker is on its base again
   (:class:`~weightsync.transports.failures.Undone`: ``details.undone: true``); when that fails
   too, the worker is torn.  vLLM's memory cannot be read back, so "proven" means what it
   means for every vLLM load: vLLM took every tensor and its reload completed.

The worker's hashes become the target's (the claimed ``target_hash`` of each patched tensor,
the held hash of the others), so its digest is the one a worker that loaded the target in full
reports.  With tensor or pipeline parallelism (world size above one) a delta is refused with
``501 not_supported`` before anything is read (:func:`refuse_sharded`), and so does a worker
not asked to keep the copy (:data:`DELTA_BASE_ENV`, off by default).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final

import attrs
import torch

from weightsync.core.errors import NotSupported
from weightsync.core.held import HeldWeights
from weightsync.core.snapshot import TensorSpec
from weightsync.core.sources import DeltaSource, DeltaStreamSource, WeightSource
from weightsync.engines.vllm.reload import ReloadSink
from weightsync.transports.delta.reader import base_mismatch
from weightsync.transports.disk.checks import DiskCheckpoint
from weightsync.transports.failures import Undone
from weightsync.transports.sink import PullTarget, Target, dtype_name, pull

FAULT_ENV: Final = "WEIGHTSYNC_VLLM_DELTA_FAULT"
"""For tests only: the path of a file.  While it holds ``write N``, a delta's write fails once
vLLM took ``N`` tensors; ``write N undo`` fails its undo as well.  Unset, nothing is read."""

UNDONE_HOW: Final = "vLLM reloaded every tensor from the worker's copy of its base"
DELTA_KINDS: Final = (DeltaSource.kind, DeltaStreamSource.kind)


DELTA_BASE_ENV: Final = "WEIGHTSYNC_VLLM_DELTA_BASE"
"""``copy`` makes a vLLM worker keep the checkpoint-form copy deltas patch (``weightsync serve
--engine vllm --vllm-delta-base copy`` sets it; inside vLLM's own server set it in the
environment).  Off by default: the copy costs one host-memory copy of the model and a host
copy of every tensor each full load (a device-to-host copy on a GPU)."""


def delta_base_kept() -> bool:
    return os.environ.get(DELTA_BASE_ENV, "") == "copy"


def refuse_without_copy(source: WeightSource) -> None:
    """Raise ``NotSupported`` (501, nothing read or written) for a delta on a worker that
    keeps no checkpoint-form copy of its weights (:data:`DELTA_BASE_ENV`)."""
    if source.kind in DELTA_KINDS and not delta_base_kept():
        raise NotSupported(
            "this vLLM worker keeps no checkpoint-form copy of its weights, which a delta is patched "
            f"on: start it with --vllm-delta-base copy ({DELTA_BASE_ENV}=copy; one host copy of the "
            "model), or send it full weights",
            code="not_supported",
        )


def refuse_sharded(source: WeightSource, world_size: int) -> None:
    """Raise ``NotSupported`` (501, nothing read or written) for a delta on a worker whose
    model is split over ``world_size`` > 1 ranks: each rank would need its own copy of the
    whole checkpoint, and no such worker was tested."""
    if world_size > 1 and source.kind in DELTA_KINDS:
        raise NotSupported(
            f"a vLLM worker takes deltas without tensor or pipeline parallelism only (its world size is "
            f"{world_size}); send it full weights",
            code="not_supported",
        )


class BaseCopy:
    """The weights a vLLM worker serves, in checkpoint form, in host memory (see the module).

    An entry counts only with its hash, and only when that hash is the one the worker holds
    for the name: a load records each tensor as vLLM takes it (:meth:`record`) and gives the
    hashes once it succeeded (:meth:`commit`); a failed load leaves its tensors without a hash.
    The served checkpoint's tensors, never handed over by a load, are read from ``model`` the
    first time they are needed."""

    def __init__(self, model: str) -> None:
        self.model = model
        self._tensors: dict[str, torch.Tensor] = {}
        self._hashes: dict[str, str] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def record(self, name: str, tensor: torch.Tensor) -> None:
        """Keep the bytes of ``tensor``, handed to vLLM as ``name`` (into this copy's own
        memory when it has a tensor of that shape and dtype: a load allocates once)."""
        self._hashes.pop(name, None)
        mine, t = self._tensors.get(name), tensor.detach()
        with torch.no_grad():
            if mine is not None and mine.shape == t.shape and mine.dtype == t.dtype:
                mine.copy_(t)
            else:
                self._tensors[name] = t.to("cpu", copy=True).contiguous()

    def commit(self, hashes: Mapping[str, str] | None) -> None:
        """The load that recorded succeeded: ``hashes`` are its channel's, by name."""
        for name, digest in (hashes or {}).items():
            if name in self._tensors:
                self._hashes[name] = digest

    def adopt(self, tensors: Mapping[str, torch.Tensor], hashes: Mapping[str, str]) -> None:
        """A delta succeeded: its patched ``tensors`` (this copy's own clones) are held now."""
        for name, tensor in tensors.items():
            self._tensors[name] = tensor
            self._hashes[name] = hashes[name]

    def base(self, held: HeldWeights, specs: Mapping[str, TensorSpec]) -> dict[str, torch.Tensor]:
        """Every tensor of ``specs`` as the worker holds it (``held``), from this copy.  Raises
        ``IllegalState`` (``base_mismatch``, nothing written) when the worker's digest is
        unknown or the copy lacks a tensor as ``held`` names it."""
        if held.digest is None:
            raise base_mismatch(
                "the digest of the weights it holds is unknown, so is the base it would patch"
            )
        hashes = held.hashes
        lacking = [n for n in specs if n not in hashes or self._hashes.get(n) != hashes[n]]
        if lacking:
            self._read_served(lacking, hashes)
            lacking = [n for n in specs if n not in hashes or self._hashes.get(n) != hashes[n]]
        wrong = [n for n in specs if n not in lacking and not _fits(self._tensors[n], specs[n])]
        if lacking or wrong:
            name = (lacking or wrong)[0]
            raise base_mismatch(
                f"it keeps no checkpoint-form copy of {len(lacking) + len(wrong)} of the tensors it holds "
                f"(e.g. {name!r}) to patch; load full weights once",
                tensor=name,
            )
        return {n: self._tensors[n] for n in specs}

    def _read_served(self, names: list[str], held: Mapping[str, str]) -> None:
        """Read ``names`` from the served checkpoint, each kept when its hash is the held one."""
        wanted = {n for n in names if n in held}
        target = PullTarget()
        try:
            ckpt = DiskCheckpoint.open(str(Path(self.model).resolve()))
            for name, tensor in pull(ckpt.copy_into(target), target):
                if name in wanted and target.hashes.get(name) == held[name]:
                    self._tensors[name] = tensor
                    self._hashes[name] = held[name]
        except Exception:  # unreadable or changed: those tensors stay lacking (a refusal follows)
            return


def _fits(tensor: torch.Tensor, spec: TensorSpec) -> bool:
    return tuple(tensor.shape) == tuple(spec.shape) and dtype_name(tensor.dtype) == spec.dtype


class PatchTarget:
    """The :class:`~weightsync.transports.sink.Target` a delta reader patches on a vLLM
    worker: it lends a clone of the base copy's tensor (the reader writes and verifies the
    delta there) and keeps what the reader hands back.  Nothing reaches vLLM."""

    wrote = False

    def __init__(self, base: Mapping[str, torch.Tensor]) -> None:
        self.base = base
        self.patched: dict[str, torch.Tensor] = {}
        self.hashes: dict[str, str] = {}
        self.tensors = 0
        self.bytes = 0

    def buffer(self, spec: TensorSpec, device: torch.device) -> torch.Tensor:
        t = self.base[spec.name]
        if device.type != "cpu" or not _fits(t, spec):
            raise NotSupported(
                f"{spec.name}: the delta's tensor is not the checkpoint's", code="not_supported"
            )
        return t.clone()

    def accept(self, spec: TensorSpec, tensor: torch.Tensor, digest: str | None) -> None:
        self.patched[spec.name] = tensor
        if digest is not None:
            self.hashes[spec.name] = digest
        self.tensors += 1
        self.bytes += tensor.numel() * tensor.element_size()


class InjectedFault(RuntimeError):
    """The failure :data:`FAULT_ENV` asks for."""


@attrs.frozen
class Faults:
    """Where a test asked a delta to fail (:data:`FAULT_ENV`); nothing outside tests."""

    write: int | None = None
    undo: bool = False

    @classmethod
    def read(cls) -> Faults:
        path = os.environ.get(FAULT_ENV)
        try:
            words = Path(path).read_text().split() if path else []
        except OSError:
            words = []
        if len(words) >= 2 and words[0] == "write" and words[1].isdigit():
            return cls(int(words[1]), "undo" in words[2:])
        return cls()


Item = tuple[str, torch.Tensor, str]


def _hand(items: list[Item], fail_after: int | None) -> Callable[[Target], Iterator[None]]:
    """A stream handing ``items`` (name, tensor, hash) to a target, one per step; with
    ``fail_after``, it fails once that many were handed (an injected fault)."""

    def stream(target: Target) -> Iterator[None]:
        for i, (name, tensor, digest) in enumerate(items):
            if i == fail_after:
                raise InjectedFault(f"a fault injected after vLLM took {i} tensors ({FAULT_ENV})")
            target.accept(TensorSpec(name, dtype_name(tensor.dtype), tuple(tensor.shape)), tensor, digest)
            yield None

    return stream


@attrs.define
class DeltaSink:
    """The :class:`~weightsync.transports.loading.Sink` of a delta on a vLLM worker (see the
    module).  ``specs``: the served checkpoint's; ``held``: what the worker holds; ``copy``:
    its weights in checkpoint form.  After a successful load, :attr:`patched` and
    :attr:`hashes` are what :meth:`BaseCopy.adopt` takes."""

    specs: Mapping[str, TensorSpec]
    runner: Any
    end_unfinished: Callable[[], None]
    copy: BaseCopy
    held: HeldWeights
    patched: dict[str, torch.Tensor] = attrs.field(factory=dict, init=False)
    hashes: dict[str, str] = attrs.field(factory=dict, init=False)
    _write: ReloadSink | None = attrs.field(default=None, init=False)

    @property
    def wrote(self) -> bool:
        return self._write is not None and self._write.wrote

    @property
    def tensors(self) -> int:
        return 0 if self._write is None else self._write.tensors

    @property
    def bytes(self) -> int:
        return 0 if self._write is None else self._write.bytes

    def fill(self, stream: Callable[[Target], Iterator[None]]) -> None:
        """Patch and verify on copies, then write every tensor through vLLM's reload; undo
        by reloading the base when the write fails.  Raises the refusal of a delta that does
        not verify (nothing written), :class:`Undone` after a write undone, else the write's
        failure (torn)."""
        base = self.copy.base(self.held, self.specs)
        target = PatchTarget(base)
        try:
            for _ in stream(target):
                pass
        except Undone as exc:  # only the clones were written (and put back): vLLM saw nothing
            raise exc.cause from exc
        if not target.patched:
            return  # a delta that changes nothing
        held = self.held.hashes
        hashes = {n: target.hashes.get(n) or held[n] for n in self.specs}
        if any(n not in target.hashes for n in target.patched):
            raise AssertionError("a delta reader handed back a tensor without its hash")
        faults = Faults.read()
        items = [(n, target.patched.get(n, base[n]), hashes[n]) for n in self.specs]
        self._write = ReloadSink(self.specs, PullTarget(), self.runner, self.end_unfinished)
        try:
            self._write.fill(_hand(items, faults.write))
        except Exception as exc:
            if not self._write.wrote:
                raise
            if self._undo([(n, base[n], held[n]) for n in self.specs], 1 if faults.undo else None):
                raise Undone(exc, self._write.tensors, UNDONE_HOW) from exc
            raise
        self.patched, self.hashes = target.patched, hashes

    def _undo(self, items: list[Item], fail_after: int | None) -> bool:
        """Reload the base; whether vLLM took every tensor and its reload completed."""
        try:
            ReloadSink(self.specs, PullTarget(), self.runner, self.end_unfinished).fill(
                _hand(items, fail_after)
            )
        except Exception:
            return False
        return True

    def written_hashes(self) -> dict[str, str] | None:
        """The hash of every tensor handed to vLLM: the target's where the delta changed it,
        the held one elsewhere."""
        return dict(self.hashes) if self._write is not None else {}

    def hashed_in_place(self, vouched: object) -> bool:
        """Never: vLLM's parameters are in kernel layout, so no hash is of the served memory."""
        return False
