"""What a generation request asks of the sampler, and what it reports per token.

:class:`Sampling` is the engine-facing form of every sampling field the generation routes
take (OpenAI's and vLLM's, SGLang's ``sampling_params``): a frozen value, checked when built,
that each engine either honours completely or refuses (``not_supported``) before generating.
:class:`TokenLogprob` is one generated (or prompt) token's log-probability and, when asked,
the most likely alternatives at that position.

Log-probabilities are those of the model's raw distribution at that position
(``log_softmax`` of the logits of the forward pass that chose the token), before repetition
penalty, temperature, min-p, top-k and top-p: what vLLM reports by default
(``logprobs_mode="raw_logprobs"``), and what a trainer recomputes for its importance ratios.
"""

from __future__ import annotations

import math

import attrs

from weightsync.core.errors import InvalidRequest

MAX_STOPS = 128
"""The most stop strings one request may give (OpenAI allows 4; vLLM sets no bound)."""
MAX_STOP_BYTES = 16384
"""The most bytes (UTF-8) its stop strings may hold together."""
MAX_STOP_TOKEN_IDS = 1024
"""The most stop token ids one request may give."""


SALT_MAX = 128
"""vLLM's limits on a request's ``cache_salt`` (``vllm.entrypoints.generate.base.protocol``)."""
SALT_FORBIDDEN = frozenset("@/\\\x00")


def valid_salt(salt: object) -> bool:
    """Whether vLLM accepts ``salt`` as a request's ``cache_salt``."""
    return isinstance(salt, str) and 0 < len(salt) <= SALT_MAX and not SALT_FORBIDDEN & set(salt)


def check_stops(field: str, stops: tuple[str, ...]) -> None:
    """Raises ``InvalidRequest`` (``invalid_value``) past :data:`MAX_STOPS` or
    :data:`MAX_STOP_BYTES`: one request's stop strings are matched in the step every request
    shares."""
    _check(field, len(stops) <= MAX_STOPS, f"holds {len(stops)} stop strings; at most {MAX_STOPS}")
    total = sum(len(s.encode("utf-8", "surrogatepass")) for s in stops)
    _check(field, total <= MAX_STOP_BYTES, f"holds {total} bytes of stop strings; at most {MAX_STOP_BYTES}")


def _check(field: str, ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequest(f"{field} {message}", code="invalid_value", field=field)


@attrs.frozen
class Sampling:
    """How to sample one sequence.  Raises ``InvalidRequest`` (``invalid_value``) for a value
    out of range.  ``top_k`` 0 or -1 and ``top_p`` 1 switch those filters off; ``logprobs``
    ``None`` reports none, 0 the sampled token's only, ``k`` also the ``k`` most likely."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    cache_salt: str | None = None
    """Not sampling: the request's prefix-cache salt (vLLM's ``cache_salt``; Dynamo's frontend
    passes one on): cached prompt blocks are reused only by requests of the same salt (and,
    always, of the same weights)."""

    def __attrs_post_init__(self) -> None:
        _check("max_tokens", self.max_tokens >= 1, "must be >= 1")
        _check("temperature", 0 <= self.temperature < math.inf, "must be a number >= 0")
        _check("top_p", 0 < self.top_p <= 1, "must be in (0, 1]")
        _check("top_k", self.top_k >= -1, "must be -1, 0 (no limit) or a positive count")
        _check("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]")
        _check("repetition_penalty", 0 < self.repetition_penalty < math.inf, "must be a number > 0")
        _check("stop", all(self.stop), "must not hold an empty string")
        check_stops("stop", self.stop)
        _check("stop_token_ids", all(t >= 0 for t in self.stop_token_ids), "must be token ids >= 0")
        _check(
            "stop_token_ids",
            len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
            f"holds {len(self.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS}",
        )
        _check(
            "cache_salt",
            self.cache_salt is None or valid_salt(self.cache_salt),
            f"must be 1 to {SALT_MAX} characters, none of {sorted(SALT_FORBIDDEN)}",
        )
        for name in ("logprobs", "prompt_logprobs"):  # the bound is the server's (serve --max-logprobs)
            value = getattr(self, name)
            _check(name, value is None or value >= 0, "must be >= 0")

    @property
    def greedy(self) -> bool:
        """Whether the token is the most likely one (temperature below vLLM's 1e-5)."""
        return self.temperature < GREEDY_BELOW


GREEDY_BELOW = 1e-5


@attrs.frozen
class TokenLogprob:
    """Token ``token``'s log-probability and ``rank`` (1: the most likely), and the ``top``
    alternatives (most likely first, ``(token, logprob)``; empty unless asked for).
    ``decoded``: how the engine's own detokenizer spells the token and the alternatives
    (``(token, text)``), when it has one (vLLM's ``Logprob.decoded_token``)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None
    decoded: tuple[tuple[int, str], ...] = ()
