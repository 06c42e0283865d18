"""The shared memory a helper process receives into (:mod:`.receiver`): an anonymous memory
file (``memfd_create``) of a sealed size, handed to the helper as a descriptor, so nothing is
left behind when either process is killed and neither can shrink it under the other."""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import mmap
import os

import torch

from weightsync.core.errors import EngineUnavailable

_SEGMENT_IDS = itertools.count(1)


class Segment:
    """An anonymous shared-memory file of a fixed, sealed size, mapped into this process, its
    blocks reserved up front (no memory is an error here, never a later SIGBUS); nameless, it
    is gone once its last descriptor and mapping are."""

    def __init__(self, size: int) -> None:
        self.size = max(size, 1)
        self.id = next(_SEGMENT_IDS)
        self.fd = os.memfd_create("weightsync-recv", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.posix_fallocate(self.fd, 0, self.size)
            fcntl.fcntl(
                self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
            )
            self.map = mmap.mmap(self.fd, self.size)
        except OSError as exc:
            os.close(self.fd)
            raise EngineUnavailable(
                f"no room for a {self.size}-byte receive buffer: {exc}", code="no_memory"
            ) from None
        self.tensor = torch.frombuffer(self.map, dtype=torch.uint8)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)
        # The mapping goes with its last view (closing it under a live view raises).
