"""The recovery rate (kclpy/recovery/rate.py): the worker-wide budget of recovery reads, shared
fairly by the shards recovering, and the pacer that waits on it."""

from __future__ import annotations

import threading

import pytest

from kclpy.recovery.rate import RecoveryRate
from tests.support.determinism import Clock

# -- the rate budget -------------------------------------------------------------------------

def drain(rate: RecoveryRate, clock: Clock, shards: list[str], seconds: float,
          want: int = 10_000) -> dict[str, list[tuple[float, int]]]:
    """Every shard asks in turn, as fetch threads would, on a hand-driven clock."""
    grants: dict[str, list[tuple[float, int]]] = {shard: [] for shard in shards}
    end = clock() + seconds
    while clock() < end:
        waits = []
        for shard in shards:
            granted, wait_s = rate.reserve(shard, want)
            if granted:
                grants[shard].append((clock(), granted))
            else:
                waits.append(wait_s)
        if waits and len(waits) == len(shards):
            clock.advance(min(waits))
    return grants


def test_no_ten_second_window_gets_more_than_the_rate_plus_ten_percent() -> None:
    clock = Clock(100.0)
    rate = RecoveryRate(1000, clock=clock)
    grants = drain(rate, clock, ["a"], 60)["a"]
    for start in range(100, 150):
        window = sum(n for at, n in grants if start <= at < start + 10)
        assert 9_000 <= window <= 11_000, (start, window)


def test_recovering_shards_share_the_rate_fairly() -> None:
    clock = Clock()
    rate = RecoveryRate(600, clock=clock)
    grants = drain(rate, clock, ["a", "b", "c"], 30)
    totals = {shard: sum(n for _, n in got) for shard, got in grants.items()}
    assert sum(totals.values()) <= 600 * 30 + 300
    assert max(totals.values()) - min(totals.values()) <= 300, totals


def test_a_shard_that_leaves_does_not_hold_up_the_others() -> None:
    clock = Clock()
    rate = RecoveryRate(100, clock=clock)
    assert rate.reserve("a", 10_000)[0] == 50
    assert rate.reserve("b", 10_000)[0] == 0  # b waits behind nobody but the empty bucket
    assert rate.reserve("a", 10_000)[0] == 0  # a now waits behind b
    rate.leave("b")
    clock.advance(0.5)
    assert rate.reserve("a", 10_000)[0] == 50


@pytest.mark.parametrize("unused, granted", [(0, 0), (45, 50)])
def test_tokens_a_page_did_not_use_are_given_back(unused: int, granted: int) -> None:
    clock = Clock()
    rate = RecoveryRate(100, clock=clock)
    assert rate.reserve("a", 10_000)[0] == 50
    rate.give_back(unused)
    clock.advance(0.05)
    assert rate.reserve("a", 10_000)[0] == granted


def test_a_pacer_stops_waiting_once_stopped() -> None:
    rate = RecoveryRate(1, clock=Clock())
    pacer = rate.pacer("a")
    stop = threading.Event()
    assert pacer.take(5, stop) == 1
    stop.set()
    assert pacer.take(5, stop) == 0
