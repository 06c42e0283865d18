"""The RL demo's pure parts: what the stamps decide about a sample, the stamp check, reading a
streamed rollout, the reward and the GRPO update's direction."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from weightsync.engines.reference.model import ModelConfig
from weightsync.rl_demo.grpo import Policy, group_advantages
from weightsync.rl_demo.rollouts import RolloutFailed, Sample, Span, samples_from_events
from weightsync.rl_demo.staleness import Committed, History, Judged, judge, stamp_problems
from weightsync.rl_demo.task import POOL, Prompt, draw_prompts, reward

DIGITS = Prompt("Answer in digits. 1+1 =")


def history(steps: int = 3) -> History:
    h = History()
    for k in range(steps):
        h.add(Committed(f"step-{k}", k, 10 + k, f"d{k}"))
    return h


def span(step: int, first: int, last: int, **changes: Any) -> Span:
    fields: dict[str, Any] = {
        "version": f"step-{step}",
        "digest": f"d{step}",
        "first": first,
        "last": last,
        "declared": True,
        "current": True,
        **changes,
    }
    return Span(**fields)


def sample(*spans: Span, epoch: int | None = None, tokens: tuple[int, ...] | None = None) -> Sample:
    n = spans[-1].last + 1
    ids = tokens or tuple(range(48, 48 + n))
    first = history().get(spans[0].version)
    routed = epoch if epoch is not None else (first.epoch if first else None)
    return Sample(
        DIGITS, tuple(DIGITS.text.encode()), ids, (-1.0,) * n, spans, "w", routed, reward(DIGITS, ids)
    )


def test_a_sample_that_crossed_a_version_is_kept_and_each_token_keeps_the_version_that_sampled_it() -> None:
    (j,) = judge([sample(span(1, 0, 3), span(2, 4, 7))], history(), step=2, max_staleness=1)
    assert j.kept and j.staleness == 1
    assert j.token_steps == (1, 1, 1, 1, 2, 2, 2, 2)


def test_a_sample_whose_oldest_span_is_beyond_the_bound_is_dropped_whole() -> None:
    (crossed, old) = judge([sample(span(0, 0, 3), span(2, 4, 7)), sample(span(0, 0, 7))], history(), 2, 1)
    assert not crossed.kept and crossed.staleness == 2
    assert not old.kept and old.staleness == 2
    (same,) = judge([sample(span(0, 0, 7))], history(), 2, max_staleness=2)
    assert same.kept


def test_a_span_of_weights_never_committed_drops_its_sample() -> None:
    other_digest = sample(span(1, 0, 3, digest="forged"))
    unknown = sample(span(9, 0, 3))
    for j in judge([other_digest, unknown], history(), 1, 5):
        assert not j.kept and j.staleness is None and j.token_steps == ()


def test_stamps_of_committed_weights_have_no_problem() -> None:
    good = [sample(span(0, 0, 3), span(1, 4, 7)), sample(span(2, 0, 7, epoch=12))]
    assert stamp_problems(good, history()) == []


@pytest.mark.parametrize(
    ("bad", "said"),
    [
        (sample(span(7, 0, 3)), "never committed"),
        (sample(span(1, 0, 3, digest="forged")), "has digest forged, committed d1"),
        (sample(span(1, 0, 3, epoch=99)), "names epoch 99, committed at 11"),
        (sample(span(1, 0, 3, current=False)), "did not describe its weights"),
        (sample(span(1, 0, 3, declared=False)), "did not describe its weights"),
        (sample(span(1, 0, 3), epoch=12), "routed at epoch 12, 'step-1' committed at 11"),
    ],
)
def test_each_stamp_that_names_other_weights_is_a_problem(bad: Sample, said: str) -> None:
    (problem,) = stamp_problems([bad], history())
    assert said in problem


def _event(
    index: int, tokens: list[int] | None = None, spans: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index, "finish_reason": None if spans is None else "length"}
    if tokens:
        choice["logprobs"] = {
            "tokens": [f"token_id:{t}" for t in tokens],
            "token_logprobs": [-0.5] * len(tokens),
        }
    if spans is not None:
        choice["weight_version_spans"] = spans
    return {"choices": [choice]}


def _wire_span(version: str, first: int, last: int) -> dict[str, Any]:
    return {
        "version": version,
        "version_declared": True,
        "first_token": first,
        "last_token": last,
        "version_current": True,
        "digest": "d",
        "epoch": 3,
    }


def test_a_stream_of_interleaved_choices_becomes_one_sample_each() -> None:
    events = [
        _event(0, [49]),
        _event(1, [97]),
        _event(1, [98]),
        _event(0, [50]),
        _event(0, spans=[_wire_span("step-1", 0, 0), _wire_span("step-2", 1, 1)]),
        _event(1, spans=[_wire_span("step-1", 0, 1)]),
    ]
    zero, one = samples_from_events(DIGITS, events, "http://w", 11)
    assert zero.token_ids == (49, 50) and zero.reward == 1.0 and zero.crossed
    assert [(s.version, s.first, s.last, s.epoch) for s in zero.spans] == [
        ("step-1", 0, 0, 3),
        ("step-2", 1, 1, 3),
    ]
    assert one.token_ids == (97, 98) and one.reward == 0.0 and not one.crossed
    assert one.logprobs == (-0.5, -0.5) and one.worker == "http://w" and one.epoch == 11


@pytest.mark.parametrize(
    "events",
    [
        [_event(0, [49]), {"error": {"message": "stream too large"}}],
        [_event(0, [49])],  # never finished
        [_event(0, [49, 50]), _event(0, spans=[_wire_span("step-1", 0, 0)])],  # a token no span covers
        [_event(0, [49]), _event(0, spans=[_wire_span("step-1", 0, 0), _wire_span("step-2", 0, 0)])],
    ],
)
def test_a_stream_that_does_not_account_for_every_token_is_refused(events: list[dict[str, Any]]) -> None:
    with pytest.raises(RolloutFailed):
        samples_from_events(DIGITS, events, "http://w", 1)


def test_the_reward_is_the_share_of_digits_in_the_answer() -> None:
    assert reward(DIGITS, list(b"12ab")) == 0.5 and reward(DIGITS, list(b"2")) == 1.0
    assert reward(DIGITS, []) == 0.0
    drawn = draw_prompts(random.Random(0), 5)
    assert len(set(drawn)) == 5 and set(drawn) <= set(POOL)


def test_group_advantages_are_normalised_and_zero_when_every_sample_scored_the_same() -> None:
    adv = group_advantages([0.0, 0.5, 1.0])
    assert abs(sum(adv)) < 1e-9 and adv[0] < 0 < adv[2]
    assert group_advantages([0.3, 0.3]) == [0.0, 0.0]


def test_an_update_makes_the_better_sample_more_likely_and_ignores_dropped_ones() -> None:
    torch.manual_seed(0)
    policy = Policy(ModelConfig.tiny(), lr=1e-2)
    prompt_ids = tuple(DIGITS.text.encode())
    good, bad = tuple(b"1234"), tuple(b"abcd")

    def logp(tokens: tuple[int, ...]) -> float:
        ids = torch.tensor([prompt_ids + tokens])
        with torch.no_grad():
            lp = torch.log_softmax(policy.model.forward_full(ids[:, :-1]).float(), -1)
        return float(lp[0, len(prompt_ids) - 1 :].gather(-1, ids[0, len(prompt_ids) :, None]).sum())

    def judged(tokens: tuple[int, ...], kept: bool) -> Judged:
        lps = tuple(logp(tokens[: i + 1]) - logp(tokens[:i]) for i in range(len(tokens)))
        s = Sample(DIGITS, prompt_ids, tokens, lps, (span(0, 0, 3),), "w", 10, reward(DIGITS, tokens))
        return Judged(s, (0,) * len(tokens), 0, kept)

    before = {n: w.clone() for n, w in policy.weights().items()}
    nothing = policy.update([[judged(good, False), judged(bad, False)]])
    assert nothing.tokens == 0 and policy.step == 0
    assert all(torch.equal(before[n], w) for n, w in policy.weights().items())

    good_before, bad_before = logp(good), logp(bad)
    figures = policy.update([[judged(good, True), judged(bad, True)]])
    assert figures.tokens == 8 and policy.step == 1
    assert figures.fresh_gap is not None and figures.fresh_gap < 1e-4  # the same weights sampled them
    assert logp(good) > good_before and logp(bad) < bad_before
