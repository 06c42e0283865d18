"""Where transports put tensors: a sink over an engine's named weights.

Every transport (disk, distributed, tensor) validates its metadata against the sink's
specs before the first write, then hands tensors over one by one.  The sink remembers
whether anything was written, which is exactly what decides "failed cleanly" versus "torn".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from weightsync.core.dtypes import DTYPES
from weightsync.core.errors import InvalidRequest
from weightsync.core.values import TensorSpec, WeightInfo


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


class TensorSink:
    """Copies incoming tensors into ``targets`` (name -> tensor), casting when the dtype differs.

    ``wrote`` turns true at the first write; ``written`` counts tensors and bytes.  ``hashes``
    holds the :func:`tensor_hash` of tensors a channel hashed while copying them in.
    """

    def __init__(self, targets: Mapping[str, torch.Tensor]) -> None:
        self.targets = targets
        self.specs: dict[str, TensorSpec] = weight_info(targets.items()).by_name()
        self.hashes: dict[str, str] = {}
        self.written: list[str] = []
        self.wrote = False
        self.tensors = 0
        self.bytes = 0

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

    def written_hashes(self) -> dict[str, str] | None:
        """The hash of every tensor written, as the channel recorded it while copying; ``None``
        when some written tensor was not hashed (then nobody knows what it holds)."""
        if any(name not in self.hashes for name in self.written):
            return None
        return {name: self.hashes[name] for name in self.written}


def check_metadata(
    incoming: Iterable[TensorSpec],
    specs: Mapping[str, TensorSpec],
    *,
    allow_partial: bool = False,
    allow_dtype_cast: bool = False,
) -> list[str]:
    """Compare incoming tensor metadata with the engine's, before a byte is written.

    Returns the names whose dtype will be cast.  Raises ``InvalidRequest`` naming the
    first mismatches, with code ``unknown_tensor``, ``missing_tensor``, ``shape_mismatch``
    or ``dtype_mismatch`` (the first class found, in that order).
    """
    incoming = list(incoming)
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
                + (" (pass allow_dtype_cast=true to cast)" if code == "dtype_mismatch" else ""),
                code=code,
                mismatches=others,
            )
    return cast


def tensor_hash(tensor: torch.Tensor) -> str:
    """xxh3-64 of a tensor's bytes (dtype and shape excluded): equal hashes, equal weights."""
    import xxhash

    flat = tensor.detach().contiguous().cpu().reshape(-1)
    return xxhash.xxh3_64_hexdigest(flat.view(torch.uint8).numpy().data)


def tensor_hashes(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    return {name: tensor_hash(t) for name, t in named}
