"""A declaration's expiry in the worker's clock (``weightsync.fleet.clocks``): pure functions.

The property: whatever the worker's clock offset and wherever in the round trip it read its
clock, a declaration it takes up by the expiry it was sent was taken up by the deadline on
the coordinator's clock — and it is refused early by no more than that round trip.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weightsync.fleet.clocks import (
    CLOCK_MARGIN_S,
    CLOCK_SKEW_S,
    DECLARE_S,
    Expiry,
    Reading,
    expiry,
    reading,
)

NOW = 1767225600.0


@given(
    offset=st.floats(-86400.0, 86400.0),
    rtt=st.floats(0.0, 30.0),
    at=st.floats(0.0, 1.0),
    window=st.floats(0.0, 120.0),
)
def test_a_declaration_taken_up_by_its_expiry_was_taken_up_by_the_deadline_whatever_the_skew(
    offset: float, rtt: float, at: float, window: float
) -> None:
    sent = NOW - rtt
    clock = sent + at * rtt + offset  # the worker read its clock somewhere in the round trip
    read = reading({"clock": clock}, sent, NOW)
    deadline = NOW + window
    e = expiry(deadline, read, NOW)
    end = min(deadline, NOW + DECLARE_S)
    # The worker takes it up at coordinator time T only while T + offset <= e.theirs.
    latest = e.theirs - offset
    assert latest <= end + 1e-6  # (float rounding of the sums)
    assert latest >= end - rtt - 0.002  # refused early by at most the round trip (and the ms)
    assert e.until == end + CLOCK_MARGIN_S


def test_a_worker_that_reports_no_clock_is_sent_the_deadline_and_waited_out_for_the_skew() -> None:
    for reply in ({}, {"clock": None}, {"clock": "noon"}, {"clock": True}, {"clock": -1.0}, {"clock": 1e300},
                  {"clock": 10**400}, {"clock": float("nan")}, {"clock": float("inf")}):  # fmt: skip
        read = reading(reply, NOW - 0.1, NOW)
        assert read == Reading(None, NOW)
        assert expiry(NOW + 10, read, NOW) == Expiry(NOW + 10, NOW + 10 + CLOCK_SKEW_S)
    assert expiry(NOW + 10.00049, None, NOW) == Expiry(NOW + 10.0, NOW + 10.00049 + CLOCK_SKEW_S)


def test_a_declaration_expires_declare_s_after_it_is_sent_at_the_latest() -> None:
    read = Reading(-60.0, NOW)
    assert expiry(NOW + 600, read, NOW) == Expiry(NOW + DECLARE_S - 60.0, NOW + DECLARE_S + CLOCK_MARGIN_S)
    assert expiry(NOW + 5, read, NOW) == Expiry(NOW + 5 - 60.0, NOW + 5 + CLOCK_MARGIN_S)


@pytest.mark.parametrize("offset", [-0.0004, 0.0004, 12.3456789])
def test_the_expiry_sent_is_rounded_down_to_the_millisecond(offset: float) -> None:
    theirs = expiry(NOW + 1, Reading(offset, NOW), NOW).theirs
    assert theirs <= NOW + 1 + offset and theirs == round(theirs, 3)


def test_an_expiry_before_1970_is_sent_as_already_past() -> None:
    """A worker whose clock reads near 0 cannot be sent a ``not_after`` of 0 or less (the
    route refuses it): it is sent the earliest one, which it refuses as expired."""
    assert expiry(NOW + 1, Reading(-NOW - 100, NOW), NOW).theirs == 0.001
