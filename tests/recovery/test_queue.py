"""The gap queue (kclpy/recovery/queue.py): gaps kept in order, merged, found again, and
stored in the lease's attribute."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kclpy.position import TRIM_HORIZON, Position
from kclpy.recovery import queue as gaps
from kclpy.recovery.queue import RecoveryRequest
from tests.support.recovery import gap

# -- the queue -------------------------------------------------------------------------------

def test_gaps_are_kept_in_order_of_their_start() -> None:
    queue = gaps.add((), gap("300", 3000, 2500))
    queue = gaps.add(queue, gap("100", 1000, 500))
    assert [r.start for r in queue] == ["100", "300"]


def test_a_second_outage_adds_a_gap_instead_of_replacing_the_first() -> None:
    first = gap("100", 1000, 500, done="150")
    queue = gaps.add((first,), gap("900", 5000, 4000))
    assert queue == (first, gap("900", 5000, 4000))


def test_overlapping_gaps_are_merged_keeping_the_earlier_checkpoint() -> None:
    first = gap("100", 1000, 500, done="150")
    overlapping = gaps.add((first,), gap("200", 2000, 900))
    assert [(r.start, r.done, r.end_ms) for r in overlapping] == [("100", "150", 2000)]
    apart = gaps.add((first,), gap("200", 3000, 1001))
    assert len(apart) == 2


def test_a_gap_whose_first_record_arrived_in_the_millisecond_another_ends_stays_apart() -> None:
    """Live reading started at the first gap's end (1000 ms) and processed records of that
    millisecond up to 700 before the second lag; one merged gap would start at 150 and read
    those again (a KPL aggregate's records all share one arrival time)."""
    first = gap("100", 1000, 500, done="150")
    touching = gaps.add((first,), gap("700", 3000, 1000))
    assert [(r.start, r.done, r.end_ms) for r in touching] == [
        ("100", "150", 1000), ("700", "700", 3000)]


def test_a_gap_found_again_from_the_same_checkpoint_keeps_the_progress_made() -> None:
    """A worker that died before its live reader checkpointed: the next owner finds the same
    gap, longer; the recovery checkpoint already written is not thrown away."""
    recovered_some = gap("100", 1000, 500, done="400")
    queue = gaps.add((recovered_some,), gap("100", 1800, 500))
    assert [(r.start, r.done, r.end_ms) for r in queue] == [("100", "400", 1800)]


def test_merging_sweeps_every_gap_a_new_one_bridges() -> None:
    queue = (gap("100", 1000, 500), gap("300", 3000, 2500))
    bridged = gaps.add(queue, gap("200", 2600, 900))
    assert [(r.start, r.end_ms) for r in bridged] == [("100", 3000)]


def test_the_queue_round_trips_through_its_attribute_and_empties_to_none() -> None:
    queue = (gap(TRIM_HORIZON, 1000, 500, done="150"),
             RecoveryRequest.gap("900", 3, 5000, 4000, "901").checkpointed(Position("950", 2),
                                                                           4500))
    assert gaps.loads(gaps.dumps(queue)) == queue
    assert gaps.dumps(()) is None
    assert gaps.loads(None) == ()
    with pytest.raises(ValueError, match="unreadable recovery queue"):
        gaps.loads('{"v":1,"requests":[{"start":"1"}]}')


def test_remaining_time_runs_from_the_recovery_checkpoint_to_the_gap_end() -> None:
    fresh = gap("100", 10_000, 4_000)
    assert fresh.remaining_ms() == 6_000
    assert fresh.checkpointed(Position("200"), 9_000).remaining_ms() == 1_000


def test_a_queue_nested_too_deep_to_decode_is_unreadable() -> None:
    nested = '{"v":1,"requests":' + "[" * 100_000 + "]" * 100_000 + "}"
    with pytest.raises(ValueError, match="unreadable recovery queue"):
        gaps.loads(nested)


# -- an operator's replay (kclpy checkpoint set) -------------------------------------------------


def test_a_replay_drops_gaps_it_reads_again_and_ends_the_one_it_cuts_at_its_position() -> None:
    before = gap("100", 2_000, 1_100)
    straddling = gap("300", 4_000, 3_100, done="350")
    after = gap("600", 7_000, 6_100)
    kept = gaps.replayed_from((before, straddling, after), Position("500"))
    assert [(r.start, r.done, r.last_sequence) for r in kept] == [
        ("100", "100", "500"), ("300", "350", "500")]
    assert kept[1].end_ms == 4_000


def test_a_replay_drops_a_gap_processed_through_its_position() -> None:
    """The review's case: a gap after r1 recovered through r6, the checkpoint moved to r3.
    Kept, its progress sent live reading to the gap's end and the gap on after r6: r4 to
    r6 were never read again."""
    processed = gap("1", 10_000, 2_000, done="6")
    assert gaps.replayed_from((processed,), Position("3")) == ()


def test_a_replay_keeps_an_operators_earlier_end() -> None:
    request = RecoveryRequest.gap("100", 0, 9_000, 1_000, None, last_sequence="400")
    (kept,) = gaps.replayed_from((request,), Position("500"))
    assert kept.last_sequence == "400"


def test_a_replay_from_a_time_ends_gaps_at_that_time_and_drops_those_after_it() -> None:
    early = gap("100", 5_000, 1_000)
    late = gap("300", 9_000, 6_000)
    done_past = replace(gap("50", 8_000, 500, done="90"), done_ms=6_500)
    kept = gaps.replayed_from((done_past, early, late), Position.at_timestamp(4_000))
    assert [(r.start, r.end_ms) for r in kept] == [("100", 4_000)]


def test_a_replay_from_the_horizon_drops_every_gap_and_from_the_tip_keeps_them() -> None:
    queue = (gap("100", 2_000, 1_100), gap("300", 4_000, 3_100))
    assert gaps.replayed_from(queue, Position.trim_horizon()) == ()
    assert gaps.replayed_from(queue, Position.latest()) == queue

# -- an operator's gap, which ends at a record (``kclpy recovery add --to SEQ``) -------------

def operator_gap(start: str, last: str) -> RecoveryRequest:
    """An operator's gap ending at record ``last``, every record of it arrived by 1000 ms."""
    return RecoveryRequest.gap(start, 0, 1000, 500, None, last_sequence=last)


def test_an_operator_gap_merges_a_gap_starting_at_or_before_its_last_record_only() -> None:
    """A millisecond holds many records: a later gap that begins after the operator's last
    record is another gap, even when its first record arrived before the operator gap's end
    (the arrival rule alone would merge them and replay records nobody asked for)."""
    inside = gaps.add((operator_gap("100", "500"),), gap("400", 2000, 900))
    assert [(r.start, r.end_ms, r.last_sequence) for r in inside] == [("100", 2000, None)]
    at_the_end = gaps.add((operator_gap("100", "500"),), gap("500", 2000, 900))
    assert len(at_the_end) == 1
    after = gaps.add((operator_gap("100", "500"),), gap("600", 2000, 900))
    assert [(r.start, r.last_sequence) for r in after] == [("100", "500"), ("600", None)]


def test_gaps_with_the_same_start_are_one_whatever_their_ends() -> None:
    """Two operator requests from TRIM_HORIZON, and a found gap whose first record is not
    known: the same start is the same gap, merged to the later end."""
    twice = gaps.add((operator_gap(TRIM_HORIZON, "500"),), operator_gap(TRIM_HORIZON, "700"))
    assert [(r.start, r.last_sequence) for r in twice] == [(TRIM_HORIZON, "700")]
    unknown_first = gaps.add((gap("100", 1000, 500),), gap("100", 3000, None))
    assert [(r.start, r.end_ms) for r in unknown_first] == [("100", 3000)]


def test_a_gap_merged_with_the_same_start_ends_beyond_where_either_was_seen() -> None:
    """What ``kclpy recovery cancel`` relies on: the start alone names a gap whose end moved
    with each merge, the end seen tells whether records were added since."""
    seen = operator_gap(TRIM_HORIZON, "500")
    merged = gaps.add((seen,), gap(TRIM_HORIZON, 3000, None))
    assert merged[0].start_position == seen.start_position
    assert not merged[0].ends_within(seen.end_ms, seen.last_sequence)
    assert merged[0].ends_within(3000, None) and seen.ends_within(1000, None)
    assert seen.ends_within(1000, "500") and not seen.ends_within(1000, "499")
    assert not gap("100", 1000, 500).ends_within(1000, "999"), (
        "every record arrived before 1000 ms ends after a record of that time")


def test_an_operator_gap_round_trips_with_its_last_record_and_a_found_one_without() -> None:
    queue = (operator_gap("100", "500"), gap("900", 5000, 4000))
    text = gaps.dumps(queue)
    assert gaps.loads(text) == queue
    assert text is not None and text.count("lastSequence") == 1


def test_a_gap_has_started_once_recovery_checkpointed_inside_it() -> None:
    """What ``kclpy recovery list`` shows as done, and where recovery says a trimmed gap's
    loss begins (after its checkpoint, or from its first record)."""
    fresh = gap("100", 1000, 500)
    assert not fresh.started
    assert fresh.checkpointed(Position("150"), 600).started
    assert fresh.checkpointed(Position("100", 1), 600).started


def test_a_queue_whose_numbers_are_strings_is_unreadable() -> None:
    """A hand-edited attribute with ``"endMs": "5000"`` would compare a string with numbers
    later, in the middle of a recovery; it is refused when read."""
    stored = gaps.dumps((gap("100", 5000, 4000),))
    assert stored is not None
    with pytest.raises(ValueError, match="whole number"):
        gaps.loads(stored.replace('"endMs":5000', '"endMs":"5000"'))
