"""vLLM's in-place reload as the sink of the one load (:func:`weightsync.transports.loading.load`).

vLLM pulls ``(name, tensor)`` pairs (``model_runner.reload_weights`` with checkpoint-format
tensors), so the validated reader's stream reaches it through a target that queues what the
reader hands over: :class:`~.feed.FeedTarget` for a checkpoint (read ahead into reused
memory, see :mod:`.feed`), :class:`~weightsync.transports.sink.PullTarget` for the other
channels.  Validation, the failure mapping and the stats are the shared load's, as for the
reference engine; what only vLLM needs lives here:

- ``wrote`` turns true as the first tensor is handed to vLLM;
- a reload that returns before the stream ended, or swallows the stream's failure, has not
  loaded every tensor, whatever it reported;
- a reload left half done is ended (see :mod:`.layerwise`) before a load and after a failed one;
- vLLM failing before it took a tensor is an engine failure, not the source's refusal;
- ``record`` sees every tensor as vLLM takes it (the worker's checkpoint-form copy of its
  weights, :class:`~.delta.BaseCopy`, keeps them for deltas).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Generator, Iterator, Mapping
from typing import Any

import attrs
import torch

from weightsync.core.errors import EngineFailure
from weightsync.core.snapshot import TensorSpec
from weightsync.engines.vllm.feed import FeedTarget, feed
from weightsync.transports.failures import describe_exception
from weightsync.transports.sink import PullTarget, Target, pull


@attrs.define
class ReloadSink:
    """A :class:`~weightsync.transports.loading.Sink` that hands a stream to vLLM's
    ``runner.reload_weights`` through ``target``; ``specs`` are the served checkpoint's,
    ``end_unfinished`` resets what a failed reload left behind, and ``record`` (if any) is
    called with each ``(name, tensor)`` as vLLM takes it."""

    specs: Mapping[str, TensorSpec]
    target: FeedTarget | PullTarget
    runner: Any
    end_unfinished: Callable[[], None]
    record: Callable[[str, torch.Tensor], None] | None = None

    @property
    def wrote(self) -> bool:
        return self.target.wrote

    @property
    def tensors(self) -> int:
        return self.target.tensors

    @property
    def bytes(self) -> int:
        return self.target.bytes

    def fill(self, stream: Callable[[Target], Iterator[None]]) -> None:
        """Let vLLM pull ``stream``'s tensors.  Raises the reader's failure when it failed
        (whatever vLLM made of it), ``EngineFailure`` when vLLM failed before it took a tensor
        or returned before the stream ended, else what vLLM raised."""
        target = self.target
        pulled: Iterator[tuple[str, torch.Tensor]] | None = None
        handed: Iterator[tuple[str, torch.Tensor]] | None = None
        steps: Iterator[None] | None = None
        try:
            self.end_unfinished()  # a reload left half done must not carry over
            steps = stream(target)
            pulled = feed(steps, target) if isinstance(target, FeedTarget) else pull(steps, target)
            handed = pulled if self.record is None else _recorded(pulled, self.record)
            self.runner.reload_weights(weights_iterator=handed, is_checkpoint_format=True)
            # vLLM may swallow the stream's failure or stop pulling early and still return:
            # then not every tensor arrived, whatever the reload reported.
            if target.error is not None or next(handed, None) is not None:
                raise EngineFailure("vLLM's reload returned before the whole stream was loaded")
        except Exception as exc:
            with contextlib.suppress(Exception):  # the weights are reported torn anyway
                self.end_unfinished()
            if target.error is not None and target.error is not exc:
                raise target.error from exc  # the reader's failure decides, not vLLM's view of it
            if target.error is None and not target.wrote:  # vLLM itself failed, nothing handed over
                raise EngineFailure(f"vLLM failed before loading: {describe_exception(exc)}") from exc
            raise
        finally:
            for it in (handed, pulled, steps):
                if isinstance(it, Generator):
                    it.close()  # a read-ahead thread has ended, a stream stopped early let go of its group

    def written_hashes(self) -> dict[str, str] | None:
        """The channel's hash of every tensor handed to vLLM; ``None`` when one went unhashed."""
        hashes = self.target.hashes
        return dict(hashes) if len(hashes) == self.target.tensors else None

    def hashed_in_place(self, vouched: Collection[str]) -> bool:
        """Never: vLLM's parameters are in kernel layout, so no hash is of the served memory."""
        return False


def _recorded(
    pulled: Iterator[tuple[str, torch.Tensor]], record: Callable[[str, torch.Tensor], None]
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in pulled:
        record(name, tensor)
        yield name, tensor
