"""A receive through a helper process (``receiver: "process"``) keeps its buffer in an
anonymous memory file of a sealed size: no process can shrink it under a mapping, and a worker
SIGKILLed in the middle of a receive leaves no file behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from weightsync.transports.distributed.receiver import Segment

# The worker's side of a receive whose helper joined and then never answers the broadcast
# (it waits for its stdin to close: the worker's death ends it).
WORKER = """
import sys
from weightsync.core import InitGroupRequest
from weightsync.transports.distributed.receiver import Helper, ReceiverGroup

HELPER = (
    "import sys\\n"
    "sys.stdin.buffer.readline()\\n"
    "sys.stdout.buffer.write(b'{\\"joined\\": true}\\\\n')\\n"
    "sys.stdout.buffer.flush()\\n"
    "sys.stdin.buffer.read()\\n"
)
req = InitGroupRequest("127.0.0.1", 1, 1, 2, "g", backend="gloo", timeout_s=120.0, receiver="process")
group = ReceiverGroup(req, 1, Helper([sys.executable, "-c", HELPER]))
group.receive(1 << 20)
"""


def receive_buffers(pid: int) -> set[str]:
    """What the receive buffers mapped into ``pid`` are named (``" (deleted)"`` dropped)."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return set()
    names = {line.split(None, 5)[5] for line in maps.splitlines() if len(line.split(None, 5)) == 6}
    return {n.removesuffix(" (deleted)") for n in names if "weightsync-recv" in n}


@pytest.mark.slow
def test_a_sigkilled_receive_leaves_no_file() -> None:
    worker = subprocess.Popen([sys.executable, "-c", WORKER], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not (buffers := receive_buffers(worker.pid)):
            assert worker.poll() is None, worker.stderr.read().decode() if worker.stderr else ""
            assert time.monotonic() < deadline, "the receive never mapped its buffer"
            time.sleep(0.05)
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait(30)
        if worker.stderr is not None:
            worker.stderr.close()
    left = sorted(b for b in buffers if os.path.exists(b))
    assert not left, f"the killed receive left {left}"


def test_a_receive_buffer_cannot_shrink_or_grow_under_its_mapping() -> None:
    seg = Segment(4096)
    try:
        for size in (0, 8192):
            with pytest.raises(PermissionError):
                os.ftruncate(seg.fd, size)
        seg.tensor[-1] = 7  # still written through the mapping
        assert os.pread(seg.fd, 1, 4095) == b"\x07"
    finally:
        seg.close()
