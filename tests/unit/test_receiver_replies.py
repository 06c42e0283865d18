"""The worker's handle on a receiving helper (`ReceiverGroup`) takes a garbled answer from
the helper as the helper failing (`peer_failed`, nothing written, the group dead), never as
a bug of its own."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from weightsync.core import InitGroupRequest
from weightsync.core.errors import EngineUnavailable
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


def recording_helper(path: str, *answers: bytes) -> Helper:
    """As :func:`helper`, also appending every line it reads to ``path``."""
    script = (
        "import sys\n"
        f"for answer in {list(answers)!r}:\n"
        "    line = sys.stdin.buffer.readline()\n"
        "    if not line:\n"
        "        break\n"
        f"    open({path!r}, 'ab').write(line)\n"
        "    sys.stdout.buffer.write(answer + b'\\n')\n"
        "    sys.stdout.buffer.flush()\n"
        "sys.stdin.buffer.read()\n"
    )
    return Helper([sys.executable, "-c", script])


def asked(path: Path, n: int) -> list[dict[str, Any]]:
    """The first ``n`` collectives the stand-in was asked for (after the join), once it has
    read them."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        lines = path.read_bytes().splitlines()[1:] if path.exists() else []
        if len(lines) >= n:
            return [json.loads(line) for line in lines]
        time.sleep(0.01)
    raise AssertionError(f"the stand-in read fewer than {n} requests")


def test_the_next_broadcast_is_asked_for_before_one_is_handed_over_in_the_other_region(
    tmp_path: Path,
) -> None:
    log = tmp_path / "asked"
    ok = b'{"ok": true}'
    group = ReceiverGroup(REQUEST, 1, recording_helper(str(log), b'{"joined": true}', ok, ok, ok))
    try:
        each = group.receive_each([5, 3, 4])  # under the sentinel's size: the stand-in writes nothing
        first = next(each)
        assert first.numel() == 5
        assert group._asked == 2  # the second was written to the helper before the first came back
        lines = asked(log, 2)
        assert [(m["op"], m["nbytes"]) for m in lines] == [("broadcast", 5), ("broadcast", 3)]
        assert lines[0]["offset"] == 0 and lines[1]["offset"] == 64  # regions apart, 64-aligned
        assert next(each).numel() == 3 and next(each).numel() == 4
        assert [m["offset"] for m in asked(log, 3)] == [0, 64, 0]
        assert list(each) == [] and not group.dead
    finally:
        group.close()


def test_stopping_with_a_broadcast_still_asked_for_lets_it_land_and_keeps_the_group_in_step(
    tmp_path: Path,
) -> None:
    ok = b'{"ok": true}'
    log = tmp_path / "asked"
    group = ReceiverGroup(REQUEST, 1, recording_helper(str(log), b'{"joined": true}', ok, ok, ok))
    try:
        each = group.receive_each([4, 4, 4])
        next(each)
        each.close()  # the second broadcast was asked for: it is waited for, the third never asked
        assert not group.dead and group.asked == 2
        assert group.receive(4).numel() == 4  # the group is in step: the next receive is the third
        assert [m["nbytes"] for m in asked(log, 3)] == [4, 4, 4]
    finally:
        group.close()


def test_stopping_with_a_broadcast_asked_for_that_fails_leaves_the_group_dead(tmp_path: Path) -> None:
    ok, failed = b'{"ok": true}', b'{"error": "RuntimeError: Connection closed by peer"}'
    group = ReceiverGroup(
        REQUEST, 1, recording_helper(str(tmp_path / "asked"), b'{"joined": true}', ok, failed)
    )
    try:
        each = group.receive_each([4, 4, 4])
        next(each)
        each.close()  # the second one fails while it is waited for: the group is out of step
        assert group.dead
        with pytest.raises(PeerFailed):
            group.receive(4)
    finally:
        group.close()


def test_without_room_for_two_regions_the_broadcasts_take_one_in_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from weightsync.transports.distributed import receiver

    made = receiver.Segment

    def tight(size: int) -> receiver.Segment:
        if size > 64:  # room for one 64-byte region only
            raise EngineUnavailable(f"no room for a {size}-byte receive buffer", code="no_memory")
        return made(size)

    monkeypatch.setattr(receiver, "Segment", tight)
    log = tmp_path / "asked"
    ok = b'{"ok": true}'
    group = ReceiverGroup(REQUEST, 1, recording_helper(str(log), b'{"joined": true}', ok, ok, ok))
    try:
        each = group.receive_each([5, 3, 4])
        assert next(each).numel() == 5
        assert group._asked == 1  # the one region is still the caller's: nothing else asked for
        assert next(each).numel() == 3 and next(each).numel() == 4
        assert [m["offset"] for m in asked(log, 3)] == [0, 0, 0]
        assert list(each) == [] and not group.dead
    finally:
        group.close()


def test_a_bare_stream_closed_with_a_broadcast_asked_for_drains_the_rest_and_keeps_its_group(
    tmp_path: Path,
) -> None:
    from weightsync.core.sources import DistributedSource
    from weightsync.transports.distributed.reader import StreamReader
    from weightsync.transports.distributed.worker import GroupRegistry
    from weightsync.transports.sink import TensorSink

    ok = b'{"ok": true}'
    log = tmp_path / "asked"
    group = ReceiverGroup(REQUEST, 1, recording_helper(str(log), b'{"joined": true}', ok, ok, ok))
    registry = GroupRegistry()
    registry._groups["g"] = group
    names = ["a", "b", "c"]  # 4 bytes each: under the sentinel's size, the stand-in writes nothing
    sink = TensorSink({n: torch.zeros(4, dtype=torch.uint8) for n in names})
    source = DistributedSource("g", tuple(sink.specs[n] for n in names))
    try:
        reader = StreamReader(registry, source)
        reader.validate(sink.specs)
        steps = reader.stream(sink)
        next(steps)  # "a" is in; "b" is asked for
        assert "g" in registry.names() and not group.dead
        steps.close()  # the engine stopped pulling: "b" lands, "c" is drained, nothing is handed over
        assert [m["nbytes"] for m in asked(log, 3)] == [4, 4, 4]
        assert not group.dead and "g" in registry.names()
        assert sink.tensors == 1
    finally:
        registry.close()
