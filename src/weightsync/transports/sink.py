"""Where a channel's reader puts tensors: a :class:`Target`.

Each weight channel (disk, distributed, shared memory) has one reader with two steps:
``validate(specs)`` checks everything and writes nothing, then ``stream(target)`` hands
tensors to a target.  Two targets exist: :class:`TensorSink` copies into an engine's named
weights (push engines: the reference engine), :class:`PullTarget` queues owned tensors for
an engine that pulls an iterator (vLLM's reload; a checkpoint goes through vLLM's own
``FeedTarget``).  The target alone decides ``wrote``, which is exactly what decides "failed
cleanly" versus "torn".  :func:`weightsync.transports.loading.load` runs both steps for
every engine.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Protocol

import torch

from weightsync.core.dtypes import DTYPES
from weightsync.core.errors import InvalidRequest
from weightsync.core.snapshot import TensorSpec, WeightInfo
from weightsync.transports.hashing import tensor_hash


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a name in :data:`weightsync.core.dtypes.DTYPES`.  Raises
    ``InvalidRequest``: ``invalid_value`` for another name, ``unsupported_dtype`` when this
    torch build lacks it."""
    row = DTYPES.get(name)
    if row is None:
        raise InvalidRequest(f"unknown dtype {name!r}", code="invalid_value")
    dtype = getattr(torch, row.torch, None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidRequest(f"dtype {name!r} is not supported by this torch build", code="unsupported_dtype")
    return dtype


def weight_info(named: Iterable[tuple[str, torch.Tensor]]) -> WeightInfo:
    return WeightInfo([TensorSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in named])


class Target(Protocol):
    """Where a reader's ``stream`` puts tensors (see the module docstring).

    ``wrote`` turns true when a tensor may have reached the engine.  ``hashes`` holds the
    xxh3-64 of every tensor handed over, as the channel computed it from the bytes it read
    (a reader may fill in a hash after :meth:`accept`, before its stream ends); ``tensors``
    and ``bytes`` count what was handed over.
    """

    wrote: bool
    hashes: dict[str, str]
    tensors: int
    bytes: int

    def buffer(self, spec: TensorSpec, device: torch.device) -> torch.Tensor | None:
        """Memory of ``spec``'s dtype and shape, contiguous, on ``device``, that the target
        owns, for the reader to receive into (``None``: the reader uses its own scratch)."""
        ...

    def accept(self, spec: TensorSpec, tensor: torch.Tensor, digest: str | None) -> None:
        """``tensor`` (from :meth:`buffer`, or the reader's scratch, which it may reuse once
        this returns) holds ``spec``'s bytes; ``digest`` is their xxh3-64 when known."""
        ...


class TensorSink:
    """Copies incoming tensors into ``targets`` (name -> tensor), casting when the dtype differs.

    ``wrote`` turns true at the first write; ``written`` counts tensors and bytes.  ``hashes``
    holds the :func:`tensor_hash` of tensors a channel hashed while copying them in.  As a
    :class:`Target`, :meth:`buffer` lends the engine's own tensor when it can receive the
    bytes as they are (receiving into it is writing).
    """

    def __init__(self, targets: Mapping[str, torch.Tensor]) -> None:
        self.targets = targets
        self.specs: dict[str, TensorSpec] = weight_info(targets.items()).by_name()
        self.hashes: dict[str, str] = {}
        self.written: list[str] = []
        self.wrote = False
        self.tensors = 0
        self.bytes = 0
        self._lent: set[str] = set()
        self._direct: set[str] = set()  # received in the target's own memory (lent, handed back)
        self._rehashed: set[str] = set()  # hashed here, from the target, after a cast

    def fill(self, stream: Callable[[Target], Iterator[None]]) -> None:
        """Run a validated reader's ``stream`` to its end, into this sink: the engine's
        tensors are written as it goes (the push side of
        :func:`~weightsync.transports.loading.load`)."""
        for _ in stream(self):
            pass

    def write(self, name: str, tensor: torch.Tensor) -> None:
        target = self.targets[name]
        self.wrote = True
        with torch.no_grad():
            target.copy_(tensor.reshape(target.shape))
        self.written.append(name)
        self.tensors += 1
        self.bytes += tensor.numel() * tensor.element_size()

    def direct_target(self, spec: TensorSpec, device: torch.device) -> torch.Tensor | None:
        """The engine tensor itself, when ``spec`` can be received straight into it (same
        dtype, shape and device, contiguous); ``None`` otherwise.  Receiving into it counts
        as writing: ``wrote`` is set before the tensor is handed out."""
        target = self.targets[spec.name]
        if (
            dtype_name(target.dtype) != spec.dtype
            or tuple(target.shape) != tuple(spec.shape)
            or target.device != device
            or not target.is_contiguous()
        ):
            return None
        self.wrote = True
        return target

    def written_directly(self, spec: TensorSpec, nbytes: int) -> None:
        """Account for a tensor received through :meth:`direct_target`."""
        self.written.append(spec.name)
        self.tensors += 1
        self.bytes += nbytes

    def buffer(self, spec: TensorSpec, device: torch.device) -> torch.Tensor | None:
        target = self.direct_target(spec, device)
        if target is not None:
            self._lent.add(spec.name)
        return target

    def accept(self, spec: TensorSpec, tensor: torch.Tensor, digest: str | None) -> None:
        target = self.targets[spec.name]
        if spec.name in self._lent:
            self._lent.discard(spec.name)
            self.written_directly(spec, tensor.numel() * tensor.element_size())
            if tensor is target:
                self._direct.add(spec.name)
        else:
            self.write(spec.name, tensor)
        if digest is not None:  # a cast tensor's hash is that of what it became
            if target.dtype == tensor.dtype:
                self.hashes[spec.name] = digest
            else:
                self.hashes[spec.name] = tensor_hash(target)
                self._rehashed.add(spec.name)

    def hashed_in_place(self, vouched: Collection[str]) -> bool:
        """Whether the hash of every tensor written was taken from the target's own memory
        after its bytes were written there: received in the memory :meth:`buffer` lent and
        hashed there by the channel (``vouched``: the names the channel says it hashed in
        lent memory, after writing it), or cast and hashed here.  Never when nothing was
        written, a hash is missing, or two targets share memory (writing one would change
        the other after it was hashed)."""
        if not self.written or self.written_hashes() is None or _overlapping(self.targets.values()):
            return False
        return all(n in self._rehashed or (n in self._direct and n in vouched) for n in self.written)

    def written_hashes(self) -> dict[str, str] | None:
        """The hash of every tensor written, as the channel recorded it while copying; ``None``
        when some written tensor was not hashed (then nobody knows what it holds)."""
        if any(name not in self.hashes for name in self.written):
            return None
        return {name: self.hashes[name] for name in self.written}


def _overlapping(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether any two of ``tensors`` share a byte of memory (a non-contiguous one counts as
    its whole storage; tensors without memory, such as ``meta`` ones, always overlap)."""
    spans = []
    for t in tensors:
        if t.device.type == "meta":
            return True
        if t.is_contiguous():
            start = t.data_ptr()
            spans.append((start, start + t.numel() * t.element_size()))
        else:
            storage = t.untyped_storage()
            spans.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    spans = sorted(span for span in spans if span[1] > span[0])  # an empty tensor holds no byte
    return any(b[0] < a[1] for a, b in itertools.pairwise(spans))


class PullTarget:
    """A :class:`Target` for an engine that pulls ``(name, tensor)`` pairs: every tensor it
    queues is owned (a reader's scratch is copied).  :func:`pull` hands them on and sets
    ``wrote`` as the first one leaves."""

    def __init__(self) -> None:
        self.ready: deque[tuple[str, torch.Tensor]] = deque()
        self.hashes: dict[str, str] = {}
        self.wrote = False
        self.tensors = 0
        self.bytes = 0
        self.error: Exception | None = None
        self._lent: dict[str, torch.Tensor] = {}

    def buffer(self, spec: TensorSpec, device: torch.device) -> torch.Tensor:
        t = self._lent[spec.name] = torch.empty(spec.shape, dtype=torch_dtype(spec.dtype), device=device)
        return t

    def accept(self, spec: TensorSpec, tensor: torch.Tensor, digest: str | None) -> None:
        owned = self._lent.pop(spec.name, None) is tensor
        self.ready.append((spec.name, tensor if owned else tensor.clone()))
        self.tensors += 1
        self.bytes += tensor.numel() * tensor.element_size()
        if digest is not None:
            self.hashes[spec.name] = digest


def pull(steps: Iterator[None], target: PullTarget) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors a reader's ``steps`` (``reader.stream(target)``) put into ``target``, in
    order, as soon as each is in; ``target.wrote`` turns true as the first one is handed on,
    and ``target.error`` keeps what the reader raised (a consumer may wrap it)."""
    try:
        for _ in steps:
            while target.ready:
                target.wrote = True
                yield target.ready.popleft()
    except Exception as exc:
        target.error = exc
        raise
    while target.ready:
        target.wrote = True
        yield target.ready.popleft()


def check_metadata(
    incoming: Iterable[TensorSpec],
    specs: Mapping[str, TensorSpec],
    *,
    allow_partial: bool = False,
    allow_dtype_cast: bool | None = None,
) -> list[str]:
    """Compare incoming tensor metadata with the engine's, before a byte is written.

    Returns the names whose dtype will be cast (only with ``allow_dtype_cast``).  ``None``
    (the default) says the caller's route has no ``allow_dtype_cast`` field: a dtype mismatch
    is refused without suggesting one; ``False`` refuses it and names the field.  Raises
    ``InvalidRequest`` naming the first mismatches, with code ``unknown_tensor``, ``missing_tensor``, ``shape_mismatch``
    or ``dtype_mismatch`` (the first class found, in that order).
    """
    incoming = list(incoming)
    cast_hint = allow_dtype_cast is not None
    problems: dict[str, list[str]] = {
        "unknown_tensor": [],
        "missing_tensor": [],
        "shape_mismatch": [],
        "dtype_mismatch": [],
    }
    cast: list[str] = []
    seen = set()
    for t in incoming:
        seen.add(t.name)
        spec = specs.get(t.name)
        if spec is None:
            problems["unknown_tensor"].append(t.name)
        elif tuple(t.shape) != tuple(spec.shape):
            problems["shape_mismatch"].append(f"{t.name}: got {list(t.shape)}, engine has {list(spec.shape)}")
        elif t.dtype != spec.dtype:
            if allow_dtype_cast:
                cast.append(t.name)
            else:
                problems["dtype_mismatch"].append(f"{t.name}: got {t.dtype}, engine has {spec.dtype}")
    if not allow_partial:
        problems["missing_tensor"] = [n for n in specs if n not in seen]
    for code, items in problems.items():
        if items:
            others = {k: v[:10] for k, v in problems.items() if v}
            raise InvalidRequest(
                f"{len(items)} {code.replace('_', ' ')}(s), e.g. {items[:5]}"
                + (" (pass allow_partial=true to load a subset)" if code == "missing_tensor" else "")
                + (" (pass allow_dtype_cast=true to cast)" if code == "dtype_mismatch" and cast_hint else "")
                + (_prefix_hint(problems["unknown_tensor"], specs) if code == "unknown_tensor" else ""),
                code=code,
                mismatches=others,
            )
    return cast


# Prefixes that wrappers put before every parameter name: torch.compile, DataParallel /
# DistributedDataParallel, FSDP's flattened wrapper, and a bare "model." of a parent module.
WRAPPER_PREFIXES = ("_orig_mod.", "module.", "_fsdp_wrapped_module.", "model.")


def _prefix_hint(unknown: list[str], specs: Mapping[str, TensorSpec]) -> str:
    """ " (... strip it ...)" when the unknown names are the engine's names behind a prefix
    that a model wrapper adds; else nothing."""
    for prefix in WRAPPER_PREFIXES:
        stripped = [n[len(prefix) :] for n in unknown if n.startswith(prefix)]
        if stripped and len(stripped) == len(unknown) and all(n in specs for n in stripped[:10]):
            return (
                f" (every unknown name starts with {prefix!r}, which a model wrapper adds — "
                f"{'torch.compile' if prefix == '_orig_mod.' else 'DataParallel/DDP' if prefix == 'module.' else 'a wrapper'}; "
                f"strip it from the names, e.g. {{n.removeprefix({prefix!r}): t for n, t in state_dict.items()}})"
            )
    return ""
