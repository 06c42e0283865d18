"""``weightsync demo --rl --json`` end to end: a policy-gradient loop through the router, one
fleet transaction per step, learns, and every stamp of every rollout names committed weights."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(660)]

# a bare environment, but the same weightsync as this test run imports
_PYTHONPATH = {k: v for k, v in os.environ.items() if k == "PYTHONPATH"}


def test_the_rl_demo_raises_its_reward_on_committed_weights_only() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "weightsync.cli", "demo", "--rl", "--json"],
        capture_output=True, text=True, timeout=600, env={**_PYTHONPATH, "PATH": ""},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(done.stdout)
    steps = figures["steps"]

    # it learned: the last steps score well above the first ones (measured over seeds 0-4:
    # from 0.04-0.06 to above 0.99)
    first, last = figures["rewards"][:3], figures["rewards"][-3:]
    assert sum(last) / 3 >= sum(first) / 3 + 0.2, figures["rewards"]
    assert figures["reward_rose"] is True

    # every step committed new weights as one fleet transaction: a version per step, a new
    # epoch and a new digest each
    committed = figures["committed"]
    assert [c["version"] for c in committed] == [f"step-{k}" for k in range(len(committed))]
    assert len(committed) == 1 + sum(s["pushed"] is not None for s in steps)
    assert all(a["epoch"] < b["epoch"] for a, b in itertools.pairwise(committed))
    assert len({c["digest"] for c in committed}) == len(committed)

    # every stamp named committed (version, epoch, digest): the demo's own check, and each
    # distinct stamp it saw checked here against what the fleet committed: the label the
    # router gave each reply (its first span's version and digest, at the epoch it routed it)
    # and every span's version and digest (and epoch, where the worker names it)
    assert figures["every_stamp_committed"] is True and figures["stamp_problems"] == []
    assert figures["stamps_checked"] >= figures["samples"] > 0
    known = {(c["version"], c["epoch"], c["digest"]) for c in committed}
    assert figures["labels"] and all(
        (s["version"], s["epoch"], s["digest"]) in known for s in figures["labels"]
    )
    pairs = {(version, digest) for version, _, digest in known}
    assert figures["spans"] and all((s["version"], s["digest"]) in pairs for s in figures["spans"])
    assert all(
        (s["version"], s["epoch"], s["digest"]) in known for s in figures["spans"] if s["epoch"] is not None
    )

    # rollouts came through the router from both workers, and the stamps decided something: a
    # straggler that started before a push is beyond the staleness bound and dropped, one that
    # started after it is kept, and a push that lands mid-request leaves samples that cross a
    # version (a fast update makes more of those and fewer stale stragglers, a slow one the
    # reverse: over seeds 0-4, 8 to 120 dropped and 24 to 264 crossed)
    assert len(figures["workers"]) == 2
    assert figures["used"] > 0 and figures["dropped"] + figures["crossed"] > 0
    # the trainer's log-probabilities agree with the worker's for the weights that sampled
    fresh = [s["fresh_gap"] for s in steps if s["fresh_gap"] is not None]
    assert fresh and max(fresh) < 1e-3
