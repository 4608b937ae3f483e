"""Kinesis' own clock as its answers show it (kclpy/retrieval/clock.py): lower and upper
bounds carried forward, the planning rule, and the skew warning - with injected clocks."""

from __future__ import annotations

import logging
from email.utils import formatdate

import pytest

from kclpy.records import Record
from kclpy.retrieval.clock import KinesisClock

K = 1_767_225_600_000


class Ticking:
    """A monotonic clock the test moves (seconds)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_date_header_bounds_kinesis_time_and_is_carried_forward() -> None:
    mono = Ticking()
    clock = KinesisClock(monotonic=mono, wall=lambda: (K + 5000) / 1000)
    assert clock.now_ms() is None and clock.plan_ms(K + 5000) == K + 5000
    clock.observe_date(formatdate(K / 1000, usegmt=True))
    assert clock.now_ms() == K
    mono.now += 2.5
    assert clock.now_ms() == K + 2500, "carried forward by the monotonic clock"
    # the local clock is 5 s ahead: a plan never goes past Kinesis' latest possible time
    assert clock.plan_ms(K + 7500) == K + 3500
    assert clock.plan_ms(K + 1000) == K + 1000, "a local clock not ahead is kept"
    assert clock.ahead_ms(K + 7500) == 4000


def test_a_page_shows_a_lower_bound_and_a_lower_one_never_lowers_it() -> None:
    mono = Ticking()
    clock = KinesisClock(monotonic=mono, wall=lambda: K / 1000)
    clock.observe_page([Record("1", "k", K - 3000, 0, b"x")], 2000)
    assert clock.now_ms() == K - 1000
    clock.observe_page([Record("2", "k", K - 5000, 0, b"x")], 0)
    assert clock.now_ms() == K - 1000
    clock.observe_page([], 0)
    assert clock.now_ms() == K - 1000, "an empty page says nothing about time"
    assert clock.shown_ms() is None, (
        "records alone never end a bounded read at the tip: on an idle shard they stay "
        "behind its bound for good")
    clock.observe_date(formatdate(K / 1000, usegmt=True))
    assert clock.shown_ms() == K


def test_a_local_clock_surely_ahead_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    clock = KinesisClock(monotonic=Ticking(), wall=lambda: (K + 5000) / 1000)
    with caplog.at_level(logging.WARNING, logger="kclpy.retrieval.clock"):
        clock.observe_date(formatdate(K / 1000, usegmt=True))
        clock.observe_date(formatdate(K / 1000, usegmt=True))
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "4000 ms or more ahead of Kinesis'" in caplog.text
    assert clock.skew_ms() == 4500, "the estimate: the middle of what Date allows"


def test_a_clock_within_the_date_precision_is_not_reported(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = KinesisClock(monotonic=Ticking(), wall=lambda: (K + 900) / 1000)
    with caplog.at_level(logging.WARNING, logger="kclpy.retrieval.clock"):
        clock.observe_date(formatdate(K / 1000, usegmt=True))
    assert caplog.records == [] and clock.ahead_ms() == 0


def test_a_latest_start_is_planned_on_kinesis_time_not_a_clock_ahead_of_it() -> None:
    """The worker resolves a ``LATEST`` lease to ``planned_now``: with the host 5 s ahead,
    the start is at most the Date header's precision past Kinesis' time, not 5 s into its
    future (records arriving in between would have been skipped)."""
    clock = KinesisClock(monotonic=Ticking(), wall=lambda: (K + 5000) / 1000)
    assert clock.planned_now() == (K + 5000) / 1000, "nothing known yet: the local clock"
    clock.observe_date(formatdate(K / 1000, usegmt=True))
    assert clock.planned_now() == (K + 1000) / 1000
