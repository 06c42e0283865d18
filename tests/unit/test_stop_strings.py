"""Stop strings: the trie matcher agrees with testing every stop string after every token (the
rule it replaced), reports the first in the request's order, and costs per token what the
longest stop string costs; a request's stop strings and stop token ids are bounded."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weightsync.core.errors import InvalidRequest
from weightsync.engines.reference.stops import StopStrings
from weightsync.engines.sampling import MAX_STOP_BYTES, MAX_STOP_TOKEN_IDS, MAX_STOPS, Sampling


def naive(out: list[int], stops: tuple[str, ...]) -> str | None:
    """Every stop string against the output's end, in order; a special token ends a match."""
    for stop in stops:
        raw = stop.encode("utf-8")
        tail = out[-len(raw) :] if len(out) >= len(raw) else None
        if tail is not None and all(t < 256 for t in tail) and bytes(tail) == raw:
            return stop
    return None


@given(
    stops=st.lists(st.text(alphabet="abc\u00e9", min_size=1, max_size=4), min_size=1, max_size=8),
    out=st.lists(st.sampled_from([*b"abc", 0xC3, 0xA9, 300]), max_size=12),
)
def test_the_trie_agrees_with_testing_every_stop_string(stops: list[str], out: list[int]) -> None:
    assert StopStrings(stops).match(out) == naive(out, tuple(stops))


def test_the_first_matching_stop_string_in_the_requests_order_is_reported() -> None:
    out = list(b"xyzab")
    assert StopStrings(["ab", "b"]).match(out) == "ab"
    assert StopStrings(["b", "ab"]).match(out) == "b"
    assert StopStrings(["zab", "b"]).match(out) == "zab"
    assert StopStrings(["q"]).match(out) is None
    assert not StopStrings([])


def test_a_special_token_breaks_a_match() -> None:
    assert StopStrings(["ab"]).match([*b"a", 300, *b"b"]) is None
    assert StopStrings(["b"]).match([*b"b", 300]) is None


class CountedOutput(list[int]):
    """An output that counts the tokens read from it."""

    reads = 0

    def __getitem__(self, index):  # type: ignore[no-untyped-def]
        self.reads += 1
        return super().__getitem__(index)


def test_matching_reads_at_most_the_longest_stop_not_their_number() -> None:
    """The walk reads at most as many tokens as the longest stop string has bytes: 200,000 stop
    strings that all end as the output does cost no more tokens read than its length (the
    rule it replaced read the output's tail once per stop string)."""
    many = StopStrings([f"{i:06d}x" for i in range(200_000)])
    out = CountedOutput(b"abc123456x")
    assert many.longest == 7
    assert many.match(out) == "123456x"
    assert out.reads <= 7
    out.reads = 0
    assert many.match(CountedOutput(b"zzzzzzzzzzz")) is None
    miss = CountedOutput(b"zzzzzzzzzzz")
    many.match(miss)
    assert miss.reads == 1


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"stop": tuple("x" * 2 for _ in range(MAX_STOPS + 1))}, "stop"),
        ({"stop": ("y" * (MAX_STOP_BYTES + 1),)}, "stop"),
        ({"stop": tuple("\u00e9" * 100 for _ in range(MAX_STOP_BYTES // 200 + 1))}, "stop"),
        ({"stop_token_ids": tuple(range(MAX_STOP_TOKEN_IDS + 1))}, "stop_token_ids"),
    ],
)
def test_too_many_stop_strings_or_ids_are_refused(fields: dict[str, tuple[object, ...]], field: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        Sampling(**fields)  # type: ignore[arg-type]
    assert err.value.code == "invalid_value" and err.value.details["field"] == field


def test_the_bounds_themselves_are_accepted() -> None:
    Sampling(
        stop=tuple(f"{i:03d}" for i in range(MAX_STOPS)), stop_token_ids=tuple(range(MAX_STOP_TOKEN_IDS))
    )
    Sampling(stop=("z" * MAX_STOP_BYTES,))
