"""The digest of a dict of tensors, as a worker holding exactly them reports it.

A worker's ``get_weight_version`` carries a ``digest`` of the weights it holds; a trainer
computes the same value from its own tensors to check that a worker serves what it sent::

    from weightsync.trainer import WorkerClient, weights_digest

    expected = weights_digest(model.state_dict())
    assert WorkerClient(url).get_weight_version()["digest"] == expected
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from weightsync.core.held import weights_digest as _combine
from weightsync.transports.hashing import tensor_hashes


def weights_digest(named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> str:
    """The lowercase hex digest of ``named_tensors`` (a ``state_dict`` or ``(name, tensor)``
    pairs): each tensor's xxh3-64 over its raw bytes, combined by name in any order.

    Equal to the ``digest`` a worker reports when it holds exactly these names and bytes (a
    worker serving more tensors than given reports a different digest).  Tensors on a GPU
    or not contiguous are copied to contiguous CPU memory to be hashed.
    """
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    return _combine(tensor_hashes(items))
