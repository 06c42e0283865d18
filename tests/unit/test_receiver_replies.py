"""The worker's handle on a receiving helper (`ReceiverGroup`) takes a garbled answer from
the helper as the helper failing (`peer_failed`, nothing written, the group dead), never as
a bug of its own."""

from __future__ import annotations

import sys

import pytest

from weightsync.core import InitGroupRequest
from weightsync.transports.distributed.receiver import Helper, PeerFailed, ReceiverGroup

pytestmark = pytest.mark.unit

REQUEST = InitGroupRequest("127.0.0.1", 1, 1, 2, "g", backend="gloo", timeout_s=5.0, receiver="process")


def helper(*answers: bytes) -> Helper:
    """A process in the helper's place: it reads one line per answer and writes the answer."""
    script = (
        "import sys\n"
        f"for answer in {list(answers)!r}:\n"
        "    if not sys.stdin.buffer.readline():\n"
        "        break\n"
        "    sys.stdout.buffer.write(answer + b'\\n')\n"
        "    sys.stdout.buffer.flush()\n"
        "sys.stdin.buffer.read()\n"
    )
    return Helper([sys.executable, "-c", script])


@pytest.mark.parametrize("answer", [b"not json", b"\xff\xfe", b"[1, 2]"])
def test_a_garbled_answer_to_joining_is_the_helper_failing(answer: bytes) -> None:
    with pytest.raises(PeerFailed) as caught:
        ReceiverGroup(REQUEST, 1, helper(answer))
    assert caught.value.code == "peer_failed" and caught.value.wrote is False


@pytest.mark.parametrize("answer", [b"{garbled", b'"ok"'])
def test_a_garbled_answer_to_a_broadcast_is_the_helper_failing_and_the_group_dead(answer: bytes) -> None:
    group = ReceiverGroup(REQUEST, 1, helper(b'{"joined": true}', answer))
    try:
        with pytest.raises(PeerFailed) as caught:
            group.receive(64)
        assert caught.value.code == "peer_failed" and caught.value.wrote is False and group.dead
    finally:
        group.close()
