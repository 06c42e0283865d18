"""The plan channel of a worker whose one process serves every tensor whole
(:class:`PlanReader`): its part of the plan checked before anything moves
(:class:`WholePart`), then the pieces landed by one of two ways — straight into the target's
tensors (:func:`receive_in_place`), or into scratch, each tensor handed over once complete
(:func:`~.pull.receive_and_hand_over`, for an engine that pulls whole tensors)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import attrs
import torch

from weightsync.core.errors import NotSupported
from weightsync.core.plan.boxes import Box
from weightsync.core.plan.check import check_part
from weightsync.core.plan.value import Piece, Transfer
from weightsync.core.snapshot import TensorSpec
from weightsync.transports.hashing import tensor_hash
from weightsync.transports.plan.receive import PlanGroup, begin, placed_group, receive, settle
from weightsync.transports.plan.streams import Streams, completed_hash
from weightsync.transports.sink import TensorSink


@attrs.frozen
class WholePart:
    """A one-process worker's part of a plan, checked against the engine's weights: the
    registry holding its group, the group (this worker where the plan puts it), the stream,
    the served specs, the names of the part's tensors and its transfers."""

    registry: Any
    group: PlanGroup
    stream_id: str
    specs: dict[str, TensorSpec]
    names: list[str]
    transfers: tuple[Transfer, ...]

    @classmethod
    def check(cls, registry: Any, source: Any, specs: Mapping[str, TensorSpec]) -> WholePart:
        """``source``'s part (:func:`~weightsync.core.plan.check.check_part`, every tensor
        served whole) in its group.  Raises ``InvalidRequest`` (``layout_mismatch``) or
        ``NotFound`` (``unknown_group``) before anything moves."""
        part = source.part
        group = placed_group(registry, source.group_name, part)
        served = [{name: Box.full(spec.shape) for name, spec in specs.items()}]
        check_part(part, served, list(specs.values()))
        names = [s.name for s in part.tensors]
        return cls(registry, group, source.stream_id, dict(specs), names, part.for_rank(0))


class _WholeHashes:
    """The hash of every tensor a one-process worker serves, as it now holds it
    (:func:`~.streams.completed_hash` once its last piece landed)."""

    def __init__(
        self, targets: Mapping[str, torch.Tensor], transfers: Sequence[Transfer], hasher: ThreadPoolExecutor
    ) -> None:
        self.targets, self.hasher = targets, hasher
        self.streams = Streams()
        self.left: dict[str, int] = {}
        for t in transfers:
            for p in t.pieces:
                self.left[p.name] = self.left.get(p.name, 0) + 1
        self.pieces = dict(self.left)
        self.hashes: dict[str, str | Future[str]] = {}

    def landed(self, piece: Piece, digest: bytes) -> None:
        self.left[piece.name] -= 1
        if not self.left[piece.name]:
            t = self.targets[piece.name]
            pieces = self.pieces[piece.name]
            self.hashes[piece.name] = completed_hash(t, pieces, piece, digest, self.streams, self.hasher)

    def result(self, names: Sequence[str]) -> dict[str, str]:
        """Every one of ``names``'s hash (one the plan sent nothing of, being empty, hashed now)."""
        out = {}
        for n in names:
            h = self.hashes.get(n)
            out[n] = tensor_hash(self.targets[n]) if h is None else h if isinstance(h, str) else h.result()
        return out


def receive_in_place(part: WholePart, target: Any) -> Iterator[None]:
    """Receive ``part`` straight into ``target``'s tensors (a plain
    :class:`~weightsync.transports.sink.TensorSink` over the served or staged tensors) and
    hash each as it now holds it.  Raises ``NotSupported`` for any other target (a sink that
    forwards to other ranks, a tensor-parallel engine's, would not see the pieces land), and
    what :class:`PlanReader` says."""
    group, sid, names = part.group, part.stream_id, part.names
    if type(target) is not TensorSink or any(t.device.type == "meta" for t in target.targets.values()):
        raise NotSupported(
            "this engine cannot receive a sharded plan into its weights (one-process workers only)",
            code="not_supported",
        )
    begin(group, sid, part.transfers)
    locals_ = {n: (target.targets[n], Box.full(part.specs[n].shape)) for n in names}

    def wrote() -> None:
        target.wrote = True

    with ThreadPoolExecutor(1, thread_name_prefix="weightsync-hash") as hasher:
        whole = _WholeHashes(target.targets, part.transfers, hasher)
        try:
            yield from receive(
                group, sid, part.transfers, part.specs, locals_, wrote, whole.landed, whole.streams
            )
        except Exception as exc:
            failure = settle(part.registry, group, sid, exc)
            if failure is exc:
                raise
            raise failure from exc
        hashes = whole.result(names)
    for n in names:  # the digest is that of what this worker now serves
        t = target.targets[n]
        target.hashes[n] = hashes[n]
        target.written.append(n)
        target.tensors += 1
        target.bytes += t.numel() * t.element_size()


class PlanReader:
    """The plan channel for a worker whose one process serves every tensor whole: checks its
    part of the plan against the engine's weights (:meth:`WholePart.check`) and the sources'
    manifests, then lands the pieces ``into`` the target (:func:`receive_in_place` unless
    given another way, such as :func:`~.pull.receive_and_hand_over`).

    Raises (``validate``) ``InvalidRequest`` (``layout_mismatch``, ``unsafe_stream``) before
    anything moves;
    (``stream``) ``InvalidRequest`` (``stream_mismatch``) or ``LoadFailed`` (``stream_aborted``)
    before the first collective, ``LoadFailed`` (``stream_failed`` or, a source having
    sent more than it declared, ``peer_failed``: the group dropped; ``checksum_mismatch``:
    the group kept) after it."""

    kind = "plan"

    def __init__(
        self, registry: Any, source: Any, into: Callable[[WholePart, Any], Iterator[None]] = receive_in_place
    ) -> None:
        self.registry, self.source, self.into = registry, source, into
        self._part: WholePart | None = None

    def validate(self, specs: Mapping[str, TensorSpec]) -> None:
        self._part = WholePart.check(self.registry, self.source, specs)

    def stream(self, target: Any) -> Iterator[None]:
        assert self._part is not None, "validate first"
        return self.into(self._part, target)

    def close(self) -> None:
        """Nothing is held between validation and the stream."""
