"""``weightsync demo --rl``: the training loop, one step after another.

Each step (``k`` counts them from 1):

1. take the rollouts the previous step asked for: the first groups to finish, plus the
   groups that were still running a step earlier (stragglers, as a slow worker leaves them);
2. ask for the next step's rollouts at once, so they generate while this step trains and
   pushes: a push lands in the middle of them, and the samples that were running resume on
   the new weights (their spans cross a version);
3. judge every sample by its stamps (:mod:`.staleness`): within ``max_staleness`` it trains
   the policy, corrected token by token with the rollout's log-probabilities; beyond it, it is
   dropped;
4. one GRPO update (:mod:`.grpo`), then push the new weights to every worker as one fleet
   transaction, version ``step-k``, and wait until the router routes to them.

So a step trains on samples one version behind its policy (and some that crossed into its
own), and a straggler is two behind: dropped unless all of its tokens came after a push.
"""

from __future__ import annotations

import asyncio
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Final, TextIO

import attrs
import torch

from weightsync.engines.reference.model import ModelConfig
from weightsync.rl_demo.fleet import demo_fleet
from weightsync.rl_demo.grpo import Policy
from weightsync.rl_demo.report import HEADER, Ledger, StepRow, Summary, closing_lines
from weightsync.rl_demo.rollouts import Rollouts, Sample
from weightsync.rl_demo.staleness import judge
from weightsync.rl_demo.task import draw_prompts

WORKERS: Final = 2


@attrs.frozen
class Settings:
    """A run's shape: ``steps`` updates; ``prompts`` groups asked for per step, of which
    ``stragglers`` are left for the step after; ``group_size`` samples of ``max_tokens``
    tokens per prompt; the staleness bound; the optimizer's learning rate; the seed of the
    prompts drawn and of every request's sampling."""

    steps: int = 20
    prompts: int = 5
    stragglers: int = 1
    group_size: int = 8
    max_tokens: int = 12
    max_staleness: int = 1
    lr: float = 1e-2
    seed: int = 0


Groups = list["asyncio.Task[list[Sample]]"]


async def _first(tasks: Groups, count: int) -> tuple[Groups, Groups]:
    """The first ``count`` of ``tasks`` to finish (in the order asked), and the rest."""
    done: set[asyncio.Task[list[Sample]]] = set()
    waiting = set(tasks)
    while len(done) < count:
        finished, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        done |= finished
    first = [t for t in tasks if t in done][:count]
    return first, [t for t in tasks if t not in first]


async def train(settings: Settings, say: TextIO) -> Summary:
    """Run the loop, printing one line per step to ``say``; return the run's figures.
    Raises :class:`~weightsync.rl_demo.fleet.CommitFailed` when a push does not commit and
    :class:`~weightsync.rl_demo.rollouts.RolloutFailed` when a rollout fails."""
    started = time.monotonic()
    rng = random.Random(settings.seed)
    policy = Policy(ModelConfig.tiny(), lr=settings.lr)
    ledger = Ledger()
    with tempfile.TemporaryDirectory(prefix="weightsync-rl-demo-") as tmp:
        async with demo_fleet(WORKERS, Path(tmp)) as fleet:
            history = fleet.history
            weights = policy.weights()
            await fleet.adopt_initial(weights)
            rollouts = Rollouts(
                fleet.router_url, group_size=settings.group_size, max_tokens=settings.max_tokens
            )

            def launch() -> Groups:
                prompts = draw_prompts(rng, settings.prompts)
                return [asyncio.create_task(rollouts.group(p, rng.randrange(1 << 31))) for p in prompts]

            print(f"{WORKERS} workers and a router up in {time.monotonic() - started:.1f} s", file=say)
            print(HEADER, file=say, flush=True)
            pending: Groups = launch()
            late: Groups = []
            try:
                for k in range(1, settings.steps + 1):
                    t0 = time.monotonic()
                    done, rest = await _first(pending, settings.prompts - settings.stragglers)
                    groups = [await t for t in [*late, *done]]
                    pending, late = launch(), rest
                    t1 = time.monotonic()
                    samples = [s for g in groups for s in g]
                    ledger.check(samples, history)
                    judged = [judge(g, history, policy.step, settings.max_staleness) for g in groups]
                    figures = await asyncio.to_thread(policy.update, judged)
                    t2, pushed = time.monotonic(), None
                    if figures.tokens:
                        previous, weights = weights, policy.weights()
                        pushed = (await fleet.push(policy.step, weights, restore=previous)).version
                    row = StepRow(
                        k,
                        _mean([s.reward for s in samples]),
                        sum(j.kept for g in judged for j in g),
                        sum(not j.kept for g in judged for j in g),
                        sum(s.crossed for s in samples),
                        _versions(samples),
                        pushed,
                        figures.loss,
                        figures.fresh_gap,
                        figures.stale_gap,
                        (t1 - t0, t2 - t1, time.monotonic() - t2),
                    )
                    ledger.rows.append(row)
                    print(row.line(), file=say, flush=True)
            finally:
                for task in [*pending, *late]:
                    task.cancel()
                await asyncio.gather(*pending, *late, return_exceptions=True)
                await rollouts.aclose()
    return ledger.summary(history, time.monotonic() - started)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _versions(samples: Sequence[Sample]) -> tuple[str, ...]:
    seen = {str(span.version) for s in samples for span in s.spans}
    return tuple(sorted(seen, key=lambda v: (len(v), v)))


def _intro(settings: Settings) -> str:
    s = settings
    return "\n".join(
        [
            "weightsync demo --rl: a policy-gradient loop (GRPO-style) on the reference engine's tiny model, "
            "which starts from random weights.",
            "Prompts are small sums that ask for the answer in digits; the reward is the share of digits in the "
            "answer (a random model scores about 0.04).",
            f"Each step samples {s.prompts} prompts x {s.group_size} completions through a router from two workers, "
            "trains on them while the next step's samples generate, and pushes the new weights to both workers as "
            "one fleet transaction.",
            f"Samples more than {s.max_staleness} version(s) behind the policy are dropped; the rest are corrected "
            "token by token with importance ratios from the workers' logprobs.",
            "Columns: used / dropped samples, samples that crossed a version mid-request, the versions whose weights "
            "sampled the step's tokens, seconds.",
            "",
        ]
    )


def run_rl_demo(settings: Settings | None = None, *, as_json: bool = False) -> int:
    """Run the demo, printing the table (or, ``as_json``, the figures as one JSON object, the
    table going to stderr).  Returns 0 when the reward rose and every stamp named committed
    weights, else 1."""
    import json

    settings = settings or Settings()
    say = sys.stderr if as_json else sys.stdout
    if not as_json:
        print(_intro(settings))
    # The workers generate on the other cores while the trainer trains: one intra-op thread
    # keeps the trainer's threads from spinning against theirs (on two loaded cores a
    # two-thread update took 1-4 s, a one-thread update 0.4 s).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        summary = asyncio.run(train(settings, say))
    finally:
        torch.set_num_threads(threads)
    if as_json:
        print(json.dumps(summary.to_json()))
    else:
        print("\n".join(closing_lines(summary)))
    ok = summary.reward_rose and not summary.problems and summary.stamps > 0
    return 0 if ok else 1
