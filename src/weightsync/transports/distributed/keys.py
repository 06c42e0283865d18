"""The store keys of one packed stream, where the trainer (:mod:`weightsync.trainer.broadcast`)
and the workers (:mod:`.worker`) meet: the manifest, each worker's ready mark, rank 0's go
and the hashes of what was sent."""

from __future__ import annotations


def ready_key(stream_id: str, rank: int) -> str:
    return f"weightsync/stream/{stream_id}/ready/{rank}"


def go_key(stream_id: str) -> str:
    return f"weightsync/stream/{stream_id}/go"


def manifest_key(stream_id: str) -> str:
    return f"weightsync/stream/{stream_id}/manifest"


def sums_key(stream_id: str) -> str:
    return f"weightsync/stream/{stream_id}/sums"
