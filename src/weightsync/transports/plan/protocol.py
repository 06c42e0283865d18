"""The wire protocol of a sharded transfer plan (:mod:`weightsync.core.plan.build`) on a
weight-update group: the store keys, the manifests and the pieces' hashes.

The trainer ranks and the worker ranks are one group (trainer rank ``s`` is group rank
``s``; see :class:`~weightsync.core.plan.value.Plan` for the workers').  Every transfer is one
point-to-point message (``send``/``recv`` on the group's process group, tagged with the
transfer's index), not a broadcast on a subgroup: each (source, destination) pair carries
different bytes, so a broadcast would need one communicator per pair — hundreds at fleet
scale, each a rendezvous — while point-to-point reuses the one group, sends each byte only
where it is served, and lets the plan's rounds keep every link busy at once.  Ranks work
through their own transfers in the plan's global order, two in flight (double-buffered:
the next message is packed or received while the previous one is on the wire;
:class:`~weightsync.transports.plan.flight.Flight`).

The protocol for one update, keyed by ``stream_id`` in the group's store:

1. each source puts its *manifest* (``index, size`` of each transfer it will send, u64
   pairs) before the workers are asked; a worker compares the manifests of every source it
   hears from with its part of the plan and refuses any difference (400 ``stream_mismatch``)
   before the first collective — a wrong size would otherwise tear or abort the receive.  A
   manifest is the source's word: on gloo a worker rank's receives are posted by a helper
   process (:mod:`weightsync.transports.distributed.receiver`), so a source that then sends
   a longer message aborts the helper (``peer_failed``), never the worker;
2. every worker rank marks itself ready; trainer rank 0 says go once all are, or abort as
   soon as one refused (every source waits for that word too);
3. the messages flow; a worker copies each piece straight into the box of the served (or
   staged) tensor it belongs to and hashes the piece's bytes (xxh3-64);
4. after its last message each source puts the hashes of its pieces (``index, position``
   as u64s, then 8 bytes of hash, per piece, in transfer then piece order); the update
   succeeds only if every piece a worker received hashes the same (else
   ``checksum_mismatch``: torn, never committed).

A worker rank's digest is that of what it serves: it hashes each tensor it
holds (its TP shard, or the whole tensor) as the engine reports it for any other load (a
one-process worker hashes each tensor on a helper thread once its last piece landed).

The source's side is :mod:`.send`; the worker's is :mod:`.receive` and its readers
(:mod:`.reader`, :mod:`.pull`).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from weightsync.core.plan.value import Transfer


def manifest_key(stream_id: str, src: int) -> str:
    return f"weightsync/plan/{stream_id}/manifest/{src}"


def ready_key(stream_id: str, rank: int) -> str:
    return f"weightsync/plan/{stream_id}/ready/{rank}"


def go_key(stream_id: str) -> str:
    return f"weightsync/plan/{stream_id}/go"


def sums_key(stream_id: str, src: int) -> str:
    return f"weightsync/plan/{stream_id}/sums/{src}"


def manifest(transfers: Sequence[Transfer]) -> bytes:
    """What a source says it will send: ``index, size`` per transfer, little-endian u64s."""
    return b"".join(struct.pack("<QQ", t.index, t.size) for t in transfers)


def manifest_sizes(raw: bytes) -> dict[int, int]:
    """A source's manifest read back: transfer index -> size (a trailing partial record is
    ignored)."""
    return dict(struct.iter_unpack("<QQ", raw[: len(raw) // 16 * 16]))


def piece_sum(index: int, position: int, digest: bytes) -> bytes:
    """One piece's record in a source's hashes: the piece at ``position`` of transfer
    ``index`` hashed ``digest`` (8 bytes)."""
    return struct.pack("<QQ", index, position) + digest


def sums_by_piece(raw: bytes) -> dict[tuple[int, int], bytes]:
    """A source's hashes read back: ``(transfer index, piece position) -> hash``."""
    out: dict[tuple[int, int], bytes] = {}
    for off in range(0, len(raw) // 24 * 24, 24):
        index, pos = struct.unpack_from("<QQ", raw, off)
        out[(index, pos)] = raw[off + 16 : off + 24]
    return out
