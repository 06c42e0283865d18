"""``weightsync demo --rl``: an RL loop that learns, end to end, on the reference engine.

A trainer process holds the policy (the tiny reference model) and trains it GRPO-style on a
verifiable reward; rollouts with log-probabilities come through a version-aware router from
two worker processes; every step's weights are pushed to both as one fleet transaction; the
trainer reads each sample's version stamps, drops samples older than its staleness bound and
corrects the rest with importance ratios, and checks that every stamp named weights the fleet
committed.

Modules, by what they hold: ``task`` (prompts and reward), ``rollouts`` (sampling through the
router), ``staleness`` (what the stamps decide), ``grpo`` (the policy and its update),
``fleet`` (workers, router and commits), ``report`` (figures, table, JSON) and ``loop`` (the
steps, and :func:`run_rl_demo`).
"""

from __future__ import annotations

from weightsync.rl_demo.loop import Settings, run_rl_demo

__all__ = ["Settings", "run_rl_demo"]
