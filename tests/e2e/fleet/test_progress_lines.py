"""What a fleet update says as it goes, against real ``weightsync serve`` processes: every
line in time order, each line counting a step's answers after the worker lines it counts,
and no step silent for more than about a second — not while a worker is slow, not while the
coordinator hashes the checkpoint for the digest every worker must end on.  Each docstring
says how the test failed on the previous code.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

from tests.e2e.fleet.test_real_fleet import RealFleet
from weightsync.fleet import Event, FleetCoordinator, disk_channel

pytestmark = pytest.mark.slow

LINE = re.compile(r"^(\d\d):(\d\d):(\d\d)\.(\d{3}) \[(\w+)\] (\S+): (.*)$")
SILENT_S = 1.5
"""The longest a step may go without a line: a progress line comes after a second (the rest
is slack for two processes on a loaded machine); the gaps these tests provoke are 2.5–3 s."""


@attrs.frozen
class Said:
    at: float
    phase: str
    who: str
    text: str


def said(out: str) -> list[Said]:
    """The progress lines of ``out``, each with its time of day in seconds (a line after
    midnight counts on from the day before)."""
    lines: list[Said] = []
    for text in out.splitlines():
        m = LINE.match(text)
        if m is None:
            continue
        h, mi, s, ms, phase, who, rest = m.groups()
        at = int(h) * 3600 + int(mi) * 60 + int(s) + int(ms) / 1000
        if lines and at < lines[-1].at - 43200:
            at += 86400
        lines.append(Said(at, phase, who, rest))
    return lines


def longest_silence(times: list[float]) -> float:
    return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[RealFleet]:
    f = RealFleet(tmp_path, 2)
    yield f
    for w in f.workers:
        w.stop()


def test_each_count_comes_after_the_worker_lines_it_counts_and_names_its_step(fleet: RealFleet) -> None:
    """Failed on the previous code: ``2/2 answered`` of the load, the verify and the commit
    came before the ``loaded``, ``verified`` and ``declared`` lines it counted (they were said
    once every worker had answered), and the applying phase's two counts (pause, load) read
    the same."""
    env = {k: v for k, v in os.environ.items() if k != "WEIGHTSYNC_FLEET_JOURNAL"}
    update = ("update", "--from-disk", fleet.new, "--version", "v1", "--journal", str(fleet.journal))
    proc = fleet.cli(*update, "--initial-source", fleet.old, env=env)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, (out, err)
    lines = said(out)
    assert [x.at for x in lines] == sorted(x.at for x in lines), out
    counted = {}
    for phase in dict.fromkeys(x.phase for x in lines):
        here = [x for x in lines if x.phase == phase]
        counts = [i for i, x in enumerate(here) if x.who == "fleet" and " answered in " in x.text]
        workers = [i for i, x in enumerate(here) if x.who != "fleet"]
        if workers:
            assert counts and max(workers) < max(counts), (phase, out)
            counted[phase] = here[max(counts)].text
    steps = {
        "preparing": "dry run",
        "applying": "load",
        "verifying": "verify",
        "committing": "declare",
        "resuming": "resume",
    }
    for phase, step in steps.items():
        assert counted[phase].startswith("2/2 answered in ") and counted[phase].endswith(f"({step})"), out
    applying = [x.text for x in lines if x.phase == "applying"]
    assert sum(t.endswith("(pause)") for t in applying) == 1, out


def test_a_refusal_is_said_before_the_count_and_an_abort_waits_for_no_hash(
    fleet: RealFleet, tmp_path: Path
) -> None:
    """Every worker refuses the dry run (no such checkpoint).  Failed on the previous code:
    ``0/2 answered`` came first and each worker's ``failed`` line after it."""
    env = {k: v for k, v in os.environ.items() if k != "WEIGHTSYNC_FLEET_JOURNAL"}
    missing = str(tmp_path / "no-such-checkpoint")
    proc = fleet.cli(
        "update", "--from-disk", missing, "--version", "v1", "--journal", str(fleet.journal), env=env
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, (out, err)
    lines = said(out)
    preparing = [x for x in lines if x.phase == "preparing"]
    failed = [
        i for i, x in enumerate(preparing) if x.who != "fleet" and x.text.startswith("failed (path_not_found")
    ]
    (count,) = [i for i, x in enumerate(preparing) if x.text.startswith("0/2 answered in ")]
    assert len(failed) == 2 and max(failed) < count, out
    assert not any("hashing the checkpoint" in x.text for x in lines), out  # nothing to hold it to


def test_the_coordinators_hash_of_the_checkpoint_is_said_while_it_runs(
    fleet: RealFleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The coordinator's hash of the checkpoint outlasts the dry runs by 2.5 s (a checkpoint
    without per-tensor hashes, or only the first import of the hashing code: 1.2–3.6 s on a
    laptop).  Failed on the previous code: nothing was said between the dry runs' count and
    ``prepared``."""
    real = disk_channel.checkpoint_digest

    def slow_digest(path: str) -> str | None:
        threading.Event().wait(2.5)
        return real(path)

    monkeypatch.setattr(disk_channel, "checkpoint_digest", slow_digest)
    events: list[Event] = []
    coordinator = FleetCoordinator(
        fleet.urls, journal=fleet.journal, initial_source=fleet.old, on_event=events.append
    )
    result = asyncio.run(coordinator.update(fleet.new, "v1"))
    assert result.committed and result.expected_digest == fleet.new_digest, result.to_json()
    lines = [e.line() for e in events]
    whats = [(e.phase, e.worker, e.what) for e in events]
    hashing = whats.index(("preparing", None, "hashing the checkpoint"))
    assert (
        whats.index(("preparing", None, "2/2 answered"))
        < hashing
        < whats.index(("applying", None, "prepared"))
    )
    assert any(e.what == "waiting" and "hashing the checkpoint" in e.detail for e in events[hashing:]), lines
    assert longest_silence([e.at for e in events]) <= SILENT_S, lines


def test_a_step_that_outlasts_a_second_gets_a_progress_line_each_second(fleet: RealFleet) -> None:
    """One worker stops for 3 s once it paused, so its load waits.  Failed on the previous
    code: the first line while a step waited came after the 5 s heartbeat, so a 3 s load was
    silent."""
    victim = fleet.workers[1]
    timers: list[threading.Timer] = []

    def stop_the_victim_once_paused(event: Event) -> None:
        if event.worker == victim.url and event.what == "paused" and not timers:
            victim.proc.send_signal(signal.SIGSTOP)
            timers.append(threading.Timer(3.0, victim.proc.send_signal, (signal.SIGCONT,)))
            timers[0].start()

    events: list[Event] = []

    def on_event(event: Event) -> None:
        events.append(event)
        stop_the_victim_once_paused(event)

    coordinator = FleetCoordinator(
        fleet.urls, journal=fleet.journal, initial_source=fleet.old, on_event=on_event
    )
    try:
        result = asyncio.run(coordinator.update(fleet.new, "v1"))
    finally:
        for t in timers:
            t.join()
    lines = [e.line() for e in events]
    assert timers and result.committed, (result.to_json(), lines)
    waits = [e for e in events if e.phase == "applying" and e.what == "waiting"]
    assert len(waits) >= 2 and all(victim.url in e.detail and "1/2 answered" in e.detail for e in waits), (
        lines
    )
    assert longest_silence([e.at for e in events]) <= SILENT_S, lines
