"""The task the RL demo's policy learns, and its verifiable reward.

Each prompt is a small sum that asks for its answer in digits, and the reward of a completion
is the fraction of its bytes that are ASCII digits: a rule checked by code, with no reward
model.  A freshly initialised byte-level model writes each of the 256 bytes about equally
often, so it starts near 10/256 ≈ 0.04; a policy that answers in digits only scores 1.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Final

import attrs

DIGITS: Final = frozenset(b"0123456789")


@attrs.frozen
class Prompt:
    """A prompt; its answer should be written in digits."""

    text: str


POOL: Final = tuple(
    Prompt(f"Answer in digits. {q} =")
    for q in ("7+5", "30-4", "9*3", "16/2", "4+4+4", "100-1", "2*21", "81/9")
)


def reward(prompt: Prompt, token_ids: Sequence[int]) -> float:
    """The fraction of ``token_ids`` (bytes) that are ASCII digits; 0.0 for none."""
    if not token_ids:
        return 0.0
    return sum(t in DIGITS for t in token_ids) / len(token_ids)


def draw_prompts(rng: random.Random, count: int) -> list[Prompt]:
    """``count`` distinct prompts from :data:`POOL` (at most its size)."""
    return rng.sample(POOL, min(count, len(POOL)))
