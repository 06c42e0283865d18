"""The trainer's policy and its GRPO-style update.

The policy is the reference engine's own model (:class:`CausalLM`, the config the workers
serve, so its first weights are the ones they start from), trained with autograd.  One update
per step, over the samples the stamps let through (:mod:`.staleness`):

* advantages are normalised within each prompt's group of samples (reward minus the group's
  mean, over its standard deviation; a group whose samples all scored the same teaches
  nothing);
* each token's importance ratio is ``exp(logp_policy - logp_rollout)``, the rollout's
  log-probability being the one the worker reported for the weights that sampled that token;
* the objective is the policy gradient weighted by that ratio, clipped above at
  ``max_ratio`` (truncated importance sampling), averaged over every token trained on.

Why not PPO's two-sided clip of the same ratio: with one update per batch, PPO's clip only
ever compares the policy with the weights that sampled, and a sample one version behind is
already outside ``1 ± 0.2`` for many tokens, whose gradient the clip then drops.  Measured on
this task (outside the demo, every sample one version behind, seeds 1-3), PPO's clip reached a
mean reward of 0.26-0.46 after 10 steps and 0.75-0.87 after 20; the truncated ratio reached
0.82-0.90 after 10 and 1.0 after 20.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import attrs
import torch

from weightsync.engines.reference.model import CausalLM, ModelConfig
from weightsync.rl_demo.staleness import Judged


def group_advantages(rewards: Sequence[float]) -> list[float]:
    """``rewards`` of one group, normalised: zero mean, unit spread (all zeros when every
    reward is the same)."""
    spread = statistics.pstdev(rewards) if len(rewards) > 1 else 0.0
    if spread < 1e-6:
        return [0.0] * len(rewards)
    mean = statistics.fmean(rewards)
    return [(r - mean) / spread for r in rewards]


@attrs.frozen
class UpdateFigures:
    """What one update saw: the loss, the tokens trained on, how far the policy's
    log-probabilities were from the rollout's for tokens sampled by the policy's own weights
    (``fresh_gap``: the largest difference; only numerical noise) and by older weights
    (``stale_gap``: the mean absolute difference, what the ratio corrects), and the share of
    tokens whose ratio was clipped at ``max_ratio``."""

    loss: float
    tokens: int
    fresh_gap: float | None
    stale_gap: float | None
    clipped: float


class Policy:
    """The trainer's copy of the model, ``step`` optimizer steps in."""

    def __init__(self, config: ModelConfig, *, lr: float = 1e-2, max_ratio: float = 2.0) -> None:
        self.model = CausalLM(config, slots=1)
        self.model.requires_grad_(True)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.max_ratio = max_ratio
        self.step = 0

    def weights(self) -> dict[str, torch.Tensor]:
        """The weights by name, detached copies (what a push sends)."""
        return {n: p.detach().clone() for n, p in self.model.weights().items()}

    def update(self, groups: Sequence[Sequence[Judged]]) -> UpdateFigures:
        """One optimizer step on the kept samples of ``groups`` (one sequence per prompt, all
        of one prompt).  Returns its figures; with nothing to learn from (no kept sample with
        a non-zero advantage) it takes no step and says so with ``tokens == 0``."""
        terms: list[torch.Tensor] = []
        fresh: list[torch.Tensor] = []
        stale: list[torch.Tensor] = []
        clipped = tokens = 0
        for group in groups:
            kept = [j for j in group if j.kept]
            batch = [
                (j, a)
                for j, a in zip(kept, group_advantages([j.sample.reward for j in kept]), strict=True)
                if a
            ]
            if not batch:
                continue
            ids, old, ages, mask, advantage = _batch(batch, self.step)
            start = len(batch[0][0].sample.prompt_ids)
            logits = self.model.forward_full(ids[:, :-1])[:, start - 1 :].float()
            new = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, start:, None])[..., 0]
            # The ratio weighs the gradient of log pi; it is not differentiated itself.
            ratio = torch.exp(new.detach() - old)
            surrogate = ratio.clamp(max=self.max_ratio) * advantage[:, None] * new
            terms.append(surrogate[mask].sum())
            gap = (new.detach() - old).abs()
            fresh.append(gap[mask & ~ages])
            stale.append(gap[mask & ages])
            clipped += int((ratio > self.max_ratio)[mask].sum())
            tokens += int(mask.sum())
        if not terms:
            return UpdateFigures(0.0, 0, None, None, 0.0)
        loss = -torch.stack(terms).sum() / tokens
        self.optimizer.zero_grad()
        torch.autograd.backward(loss)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.step += 1
        return UpdateFigures(float(loss.detach()), tokens, _max(fresh), _mean(stale), clipped / tokens)


def _batch(
    batch: Sequence[tuple[Judged, float]], step: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One group's samples as tensors, padded on the right: token ids (prompt and
    completion), rollout log-probabilities, which tokens older weights sampled, which tokens
    are real, and the advantages."""
    prompt = batch[0][0].sample.prompt_ids
    width = max(len(j.sample.token_ids) for j, _ in batch)
    ids = torch.zeros(len(batch), len(prompt) + width, dtype=torch.long)
    old = torch.zeros(len(batch), width)
    ages = torch.zeros(len(batch), width, dtype=torch.bool)
    mask = torch.zeros(len(batch), width, dtype=torch.bool)
    for row, (judged, _) in enumerate(batch):
        s, n = judged.sample, len(judged.sample.token_ids)
        ids[row, : len(prompt) + n] = torch.tensor(s.prompt_ids + s.token_ids)
        old[row, :n] = torch.tensor(s.logprobs)
        ages[row, :n] = torch.tensor(judged.token_steps) < step
        mask[row, :n] = True
    return ids, old, ages, mask, torch.tensor([a for _, a in batch])


def _max(gaps: list[torch.Tensor]) -> float | None:
    joined = torch.cat(gaps) if gaps else torch.empty(0)
    return float(joined.max()) if joined.numel() else None


def _mean(gaps: list[torch.Tensor]) -> float | None:
    joined = torch.cat(gaps) if gaps else torch.empty(0)
    return float(joined.mean()) if joined.numel() else None
