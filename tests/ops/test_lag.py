"""Burrow's lag rules, each on a crafted window with explicit observation times, and the
probe that measures lag from a checkpoint (botocore's Stubber: exact pages, no network)."""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

from kclpy.ops.lag import (
    NO_LAG,
    AppStatus,
    Lag,
    LagProbe,
    LagTracker,
    Observation,
    ShardStatus,
    ShardWindow,
    application_status,
    checkpoint_written,
)

WINDOW = 60.0


def behind(records: int, millis: int | None = None) -> Lag:
    return Lag(records=records, records_exact=True,
               millis=records * 100 if millis is None else millis)


def obs(time: float, checkpoint: str | None, lag: Lag, *, written: bool = False,
        counter: int | None = None, owner: str | None = "w1", sub: int = 0,
        **extra: Any) -> Observation:
    return Observation(time=time, checkpoint=checkpoint, sub_sequence_number=sub, lag=lag,
                       written=written, lease_counter=counter, owner=owner, **extra)


def window(*observations: Observation, window_s: float = WINDOW) -> ShardWindow:
    shard = ShardWindow(window_s)
    for o in observations:
        shard.add(o)
    return shard


def moving(lags: Sequence[int], *, start: int = 100, step: int = 10) -> list[Observation]:
    """One observation every 20 s from t=0, checkpoint advancing by ``step`` each time."""
    return [obs(20.0 * i, str(start + step * i), behind(n, n * 10), written=i > 0)
            for i, n in enumerate(lags)]


# -- rule 1: OK when the lag was zero in the window --------------------------------------


def test_ok_when_the_lag_was_zero_somewhere_in_the_window() -> None:
    # Without the zero this window is a STOP (no write for the whole window).
    shard = window(obs(0, "100", behind(5)), obs(20, "100", NO_LAG), obs(40, "100", behind(5)),
                   obs(60, "100", behind(5)))
    result = shard.evaluate(60)
    assert result.status is ShardStatus.OK
    assert "caught up" in result.reason


def test_a_zero_lag_that_left_the_window_no_longer_counts() -> None:
    shard = window(obs(0, "100", NO_LAG), obs(20, "100", behind(5)), obs(40, "100", behind(5)),
                   obs(60, "100", behind(5)), obs(80, "100", behind(5)))
    assert shard.evaluate(80).status is ShardStatus.STOP


def test_records_behind_that_are_only_a_lower_bound_are_not_zero() -> None:
    unknown = Lag(records=0, records_exact=False, millis=5000)
    shard = window(*(obs(t, "100", unknown) for t in (0, 20, 40, 60)))
    assert shard.evaluate(60).status is ShardStatus.STOP


# -- rule 2: REWIND ----------------------------------------------------------------------


def test_rewind_when_a_checkpoint_moves_backwards() -> None:
    shard = window(obs(0, "100", behind(5)), obs(20, "200", behind(5), written=True),
                   obs(40, "150", behind(8), written=True), obs(60, "160", behind(7),
                                                               written=True))
    result = shard.evaluate(60)
    assert result.status is ShardStatus.REWIND
    assert "from 200 to 150" in result.reason


def test_rewind_to_a_lower_sub_sequence_number_of_the_same_record() -> None:
    shard = window(obs(0, "100", behind(5), sub=7), obs(20, "100", behind(5), sub=3,
                                                        written=True))
    assert shard.evaluate(20).status is ShardStatus.REWIND


def test_rewind_to_trim_horizon() -> None:
    shard = window(obs(0, "100", behind(5)), obs(20, "TRIM_HORIZON", behind(50), written=True))
    assert shard.evaluate(20).status is ShardStatus.REWIND


def test_rewind_right_at_the_window_start_is_seen_through_the_anchor() -> None:
    shard = window(obs(0, "200", behind(5)), obs(30, "150", behind(5), written=True),
                   obs(90, "150", behind(5)))
    # At t=90 the window starts at 30: the move from 200 (t=0, before the window) to 150
    # happened at its first observation.
    assert shard.evaluate(90).status is ShardStatus.REWIND


def test_rewind_that_left_the_window_is_forgotten() -> None:
    shard = window(obs(0, "200", behind(5)), obs(20, "150", behind(5), written=True),
                   obs(40, "160", behind(4), written=True), obs(60, "170", behind(3),
                                                               written=True),
                   obs(80, "180", behind(2), written=True))
    # At t=80 the window starts at t=20, the observation that saw the rewind.
    assert shard.evaluate(80).status is ShardStatus.REWIND
    shard.add(obs(100, "190", behind(1), written=True))
    assert shard.evaluate(100).status is ShardStatus.OK


# -- rule 3: STOP ------------------------------------------------------------------------


def test_stop_when_no_checkpoint_for_a_whole_window_while_behind() -> None:
    shard = window(*(obs(t, "100", behind(5 + int(t)), counter=int(t)) for t in (0, 20, 40,
                                                                                  60)))
    result = shard.evaluate(60)
    assert result.status is ShardStatus.STOP
    assert "no checkpoint for 60s" in result.reason
    assert "processor does not checkpoint" in result.reason, "the lease is renewed"
    assert result.complete == 1.0


def test_no_stop_before_a_whole_window_was_observed() -> None:
    shard = window(obs(0, "100", behind(5)), obs(20, "100", behind(6)), obs(40, "100", behind(7)))
    result = shard.evaluate(40)
    assert result.status is ShardStatus.OK
    assert result.complete == pytest.approx(40 / 60)


def test_stop_once_the_last_write_is_older_than_the_window() -> None:
    shard = window(obs(0, "90", behind(5)), obs(10, "100", behind(5), written=True),
                   obs(40, "100", behind(6)), obs(69, "100", behind(7)))
    assert shard.evaluate(69).status is not ShardStatus.STOP
    shard.add(obs(71, "100", behind(8)))
    assert shard.evaluate(71).status is ShardStatus.STOP


def test_stop_says_when_no_worker_holds_the_lease() -> None:
    shard = window(*(obs(t, "100", behind(5), owner=None, counter=3) for t in (0, 30, 60)))
    result = shard.evaluate(60)
    assert result.status is ShardStatus.STOP
    assert "no worker holds the lease" in result.reason


def test_stop_says_when_the_lease_is_not_renewed() -> None:
    shard = window(*(obs(t, "100", behind(5), owner="w9", counter=3) for t in (0, 30, 60)))
    result = shard.evaluate(60)
    assert result.status is ShardStatus.STOP
    assert "lease of w9 is not being renewed" in result.reason


# -- rule 4: STALL -----------------------------------------------------------------------


def test_stall_when_checkpoints_are_written_but_do_not_move() -> None:
    shard = window(obs(0, "100", behind(5)), obs(20, "100", behind(6), written=True),
                   obs(40, "100", behind(6), written=True), obs(60, "100", behind(7),
                                                               written=True))
    result = shard.evaluate(60)
    assert result.status is ShardStatus.STALL
    assert "not moving from 100" in result.reason


def test_no_stall_when_the_checkpoint_moved_in_the_window() -> None:
    shard = window(obs(0, "100", behind(5)), obs(20, "110", behind(6), written=True),
                   obs(40, "110", behind(4), written=True), obs(60, "110", behind(5),
                                                               written=True))
    assert shard.evaluate(60).status is ShardStatus.OK


# -- rule 5: WARN ------------------------------------------------------------------------


def test_warn_when_checkpoints_move_but_the_lag_grows_through_the_window() -> None:
    shard = window(*moving([10, 20, 20, 40]))
    result = shard.evaluate(60)
    assert result.status is ShardStatus.WARN
    assert "grew from 0.1s to 0.4s" in result.reason


def test_no_warn_when_the_lag_decreased_once() -> None:
    assert window(*moving([10, 30, 20, 40])).evaluate(60).status is ShardStatus.OK


def test_no_warn_for_a_flat_lag_unlike_burrow() -> None:
    assert window(*moving([10, 10, 10, 10])).evaluate(60).status is ShardStatus.OK


# -- what is never an alarm --------------------------------------------------------------


def test_a_finished_shard_is_ok() -> None:
    shard = window(*(obs(t, "SHARD_END", NO_LAG) for t in (0, 30, 60)))
    assert shard.evaluate(60).status is ShardStatus.OK


def test_a_child_waiting_for_its_parents_is_ok_though_it_never_checkpoints() -> None:
    shard = window(*(obs(t, "TRIM_HORIZON", behind(50), waiting_on_parents=True)
                     for t in (0, 30, 60, 90)))
    result = shard.evaluate(90)
    assert result.status is ShardStatus.OK
    assert "parent" in result.reason


@pytest.mark.parametrize("recovering, status", [(True, ShardStatus.OK),
                                                 (False, ShardStatus.STOP)])
def test_a_shard_in_lag_recovery_is_not_stopped_though_its_live_checkpoint_waits(
        recovering: bool, status: ShardStatus) -> None:
    shard = window(*(obs(t, "100", behind(5000), recovering=recovering)
                     for t in (0, 30, 60, 90, 120, 150, 180)))
    result = shard.evaluate(180)
    assert result.status is status
    assert ("lag recovery" in result.reason) is recovering


def test_an_empty_window_is_ok_and_incomplete() -> None:
    result = ShardWindow(WINDOW).evaluate(100)
    assert (result.status, result.complete, result.latest) == (ShardStatus.OK, 0.0, None)


def test_observations_older_than_the_window_are_dropped_but_one_anchor() -> None:
    shard = window(*(obs(t, "100", behind(5)) for t in range(0, 200, 10)))
    result = shard.evaluate(190)
    assert result.latest is not None and result.latest.time == 190
    assert result.status is ShardStatus.STOP


# -- the application ---------------------------------------------------------------------


@pytest.mark.parametrize(("statuses", "expected", "code"), [
    ([], AppStatus.OK, 0),
    ([ShardStatus.OK, ShardStatus.OK], AppStatus.OK, 0),
    ([ShardStatus.OK, ShardStatus.WARN], AppStatus.WARN, 1),
    ([ShardStatus.WARN, ShardStatus.STOP], AppStatus.ERROR, 2),
    ([ShardStatus.OK, ShardStatus.STALL], AppStatus.ERROR, 2),
    ([ShardStatus.REWIND], AppStatus.ERROR, 2),
])
def test_application_status_is_the_worst_shard(
        statuses: list[ShardStatus], expected: AppStatus, code: int) -> None:
    assert application_status(statuses) is expected
    assert expected.exit_code == code


# -- when a checkpoint counts as written -------------------------------------------------


def test_written_when_the_checkpoint_value_changes() -> None:
    assert checkpoint_written(obs(0, "100", NO_LAG), obs(1, "101", NO_LAG))
    assert checkpoint_written(obs(0, "100", NO_LAG), obs(1, "100", NO_LAG, sub=1))


def test_a_renewal_alone_is_not_a_checkpoint() -> None:
    assert not checkpoint_written(obs(0, "100", NO_LAG, counter=1),
                                  obs(1, "100", NO_LAG, counter=5))


def test_written_when_the_workers_own_checkpoint_count_grows() -> None:
    before = obs(0, "100", NO_LAG, checkpoint_writes=3.0)
    assert checkpoint_written(before, obs(1, "100", NO_LAG, checkpoint_writes=4.0))
    assert not checkpoint_written(before, obs(1, "100", NO_LAG, checkpoint_writes=3.0))


def test_written_when_owner_switches_are_reset() -> None:
    assert checkpoint_written(obs(0, "100", NO_LAG, owner_switches=2),
                              obs(1, "100", NO_LAG, owner_switches=0))
    assert not checkpoint_written(obs(0, "100", NO_LAG, owner_switches=0),
                                  obs(1, "100", NO_LAG, owner_switches=0))


def test_tracker_fills_in_written_and_forgets_shards() -> None:
    tracker = LagTracker(WINDOW)
    first = tracker.record("s1", obs(0, "100", behind(3)))
    second = tracker.record("s1", obs(20, "100", behind(3), written=True))
    third = tracker.record("s1", obs(40, "120", behind(3)))
    assert (first.written, second.written, third.written) == (False, False, True)
    tracker.record("s2", obs(40, "5", behind(1)))
    tracker.retain(["s2"])
    assert list(tracker.evaluate(40)) == ["s2"]


# -- the probe ---------------------------------------------------------------------------


NOW = 1_700_000_000.0


def _record(seq: str, arrived_s: float) -> dict[str, Any]:
    return {"SequenceNumber": seq, "PartitionKey": "k", "Data": b"x",
            "ApproximateArrivalTimestamp": datetime.datetime.fromtimestamp(
                arrived_s, tz=datetime.timezone.utc)}


@pytest.fixture
def stubbed() -> tuple[Any, Stubber]:
    client = boto3.client("kinesis", region_name="us-east-1", aws_access_key_id="a",
                          aws_secret_access_key="b")
    return client, Stubber(client)


def _expect_iterator(stub: Stubber, kind: str, sequence: str | None = None) -> None:
    params: dict[str, Any] = {"StreamName": "s", "ShardId": "shard-1",
                              "ShardIteratorType": kind}
    if sequence is not None:
        params["StartingSequenceNumber"] = sequence
    stub.add_response("get_shard_iterator", {"ShardIterator": "it-0"}, params)


def _expect_page(stub: Stubber, iterator: str, records: list[dict[str, Any]], behind: int,
                 next_iterator: str | None = "it-next", limit: int = 5) -> None:
    response: dict[str, Any] = {"Records": records, "MillisBehindLatest": behind}
    if next_iterator is not None:
        response["NextShardIterator"] = next_iterator
    stub.add_response("get_records", response, {"ShardIterator": iterator, "Limit": limit})


def _probe(client: Any) -> LagProbe:
    return LagProbe(client, stream_name="s", records_limit=5, wall_clock=lambda: NOW)


def test_probe_counts_records_after_the_checkpoint_exactly_at_the_tip(
        stubbed: tuple[Any, Stubber]) -> None:
    client, stub = stubbed
    _expect_iterator(stub, "AFTER_SEQUENCE_NUMBER", "100")
    _expect_page(stub, "it-0", [_record("101", NOW - 7.5), _record("102", NOW - 1)], 0)
    with stub:
        lag = _probe(client).measure("shard-1", "100", 0)
    stub.assert_no_pending_responses()
    assert lag == Lag(records=2, records_exact=True, millis=7500)


def test_probe_reports_a_lower_bound_when_the_limit_is_reached(
        stubbed: tuple[Any, Stubber]) -> None:
    client, stub = stubbed
    _expect_iterator(stub, "AFTER_SEQUENCE_NUMBER", "100")
    _expect_page(stub, "it-0", [_record(str(101 + i), NOW - 60) for i in range(5)], 0)
    with stub:
        lag = _probe(client).measure("shard-1", "100", 0)
    assert (lag.records, lag.records_exact, lag.millis) == (5, False, 60000)
    assert not lag.is_zero


def test_probe_follows_empty_pages_that_are_still_behind(
        stubbed: tuple[Any, Stubber]) -> None:
    client, stub = stubbed
    _expect_iterator(stub, "TRIM_HORIZON")
    _expect_page(stub, "it-0", [], 90_000, "it-1")
    _expect_page(stub, "it-1", [_record("7", NOW - 80)], 5_000, "it-2")
    with stub:
        lag = _probe(client).measure("shard-1", "TRIM_HORIZON", 0)
    stub.assert_no_pending_responses()
    assert (lag.records, lag.records_exact, lag.millis) == (1, False, 80000)


def test_probe_caught_up_is_zero(stubbed: tuple[Any, Stubber]) -> None:
    client, stub = stubbed
    _expect_iterator(stub, "AFTER_SEQUENCE_NUMBER", "100")
    _expect_page(stub, "it-0", [], 0)
    with stub:
        lag = _probe(client).measure("shard-1", "100", 3)
    assert lag == NO_LAG and lag.is_zero


def test_probe_without_calls_for_finished_and_latest_leases(
        stubbed: tuple[Any, Stubber]) -> None:
    client, stub = stubbed
    with stub:
        assert _probe(client).measure("shard-1", "SHARD_END", 0) == NO_LAG
        assert _probe(client).measure("shard-1", "LATEST", 0) == NO_LAG
    stub.assert_no_pending_responses()
