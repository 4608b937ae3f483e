"""The read pipeline every retrieval mode shares (``kclpy.retrieval.pipeline``): de-aggregation
and KPL filtering, the resume point, the thread, the bounded queue, stop, errors and the
retrieval gate - fed by a polling source over a scripted shard, and by a source written
here, to show any ``PageSource`` will do."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator, Sequence
from datetime import datetime, timezone
from typing import Any

import pytest

from kclpy.metrics import Metrics
from kclpy.position import Position
from kclpy.records import Record
from kclpy.retrieval.page import Page
from kclpy.retrieval.pipeline import FetchError, ShardPipeline
from kclpy.retrieval.source import (
    AT_SEQUENCE_NUMBER,
    Reading,
    ShardAddress,
    Stopped,
)
from tests.support.fakeshard import (
    SHARD,
    FakeShard,
    Sleeps,
    aggregate,
    drain,
    error,
    make,
    payloads,
    plain,
    polling,
    positions,
    route_get_records,
    sample,
    seq,
)


@pytest.fixture(autouse=True)
def fake_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    route_get_records(monkeypatch)


# -- reading, resuming, de-aggregating ---------------------------------------------------


def test_reads_plain_and_aggregated_records_in_order() -> None:
    shard = FakeShard([plain(0), aggregate(1, 3), plain(2), aggregate(3, 2)], page_size=2)
    results = drain(make(shard))
    assert payloads(results) == [
        b"plain-0",
        b"agg-1-0",
        b"agg-1-1",
        b"agg-1-2",
        b"plain-2",
        b"agg-3-0",
        b"agg-3-1",
    ]
    assert positions([r for res in results for r in res.records]) == [
        (int(seq(0)), 0),
        (int(seq(1)), 0),
        (int(seq(1)), 1),
        (int(seq(1)), 2),
        (int(seq(2)), 0),
        (int(seq(3)), 0),
        (int(seq(3)), 1),
    ]


def test_resume_inside_an_aggregate_skips_the_sub_records_already_done() -> None:
    shard = FakeShard([plain(0), aggregate(1, 5), plain(2)], page_size=10)
    fetcher = make(shard, Position(seq(1), 2))
    results = drain(fetcher)
    assert shard.shard_iterator_calls[0]["ShardIteratorType"] == AT_SEQUENCE_NUMBER
    assert shard.shard_iterator_calls[0]["StartingSequenceNumber"] == seq(1)
    assert payloads(results) == [b"agg-1-3", b"agg-1-4", b"plain-2"]


def test_resume_at_a_plain_record_does_not_deliver_it_again() -> None:
    shard = FakeShard([plain(0), plain(1), plain(2)])
    results = drain(make(shard, Position(seq(1), 0)))
    assert payloads(results) == [b"plain-2"]


def test_resume_at_the_last_sub_record_of_an_aggregate_moves_past_it() -> None:
    shard = FakeShard([aggregate(0, 3), plain(1)], page_size=1)
    results = drain(make(shard, Position(seq(0), 2)))
    assert payloads(results) == [b"plain-1"]


def test_a_checkpoint_whose_record_is_gone_is_reported_and_the_rest_delivered() -> None:
    trimmed: list[tuple[str, str]] = []
    shard = FakeShard([plain(5), aggregate(6, 2)])
    results = drain(make(shard, Position(seq(2)),
                         on_trimmed=lambda at, first: trimmed.append((at, first))))
    assert trimmed == [(seq(2), seq(5))]
    assert payloads(results) == [b"plain-5", b"agg-6-0", b"agg-6-1"]

    there = FakeShard([plain(2), plain(3)])
    results = drain(make(there, Position(seq(2)),
                         on_trimmed=lambda at, first: trimmed.append((at, first))))
    assert len(trimmed) == 1 and payloads(results) == [b"plain-3"]

    def refuse(at: str, first: str) -> None:
        raise LookupError(f"{at} gone, {first} first")

    with pytest.raises(LookupError, match=seq(5)):
        make(shard, Position(seq(2)),
             on_trimmed=refuse).fetch_once()


def test_without_de_aggregation_an_aggregate_is_handed_over_whole_after_the_checkpoint(
) -> None:
    shard = FakeShard([plain(0), aggregate(1, 3), plain(2)])
    results = drain(make(shard, Position(seq(0)),
                         deaggregate=False))
    assert [r.sequence_number for r in results[0].records] == [seq(1), seq(2)]
    assert results[0].records[0].binary_data == aggregate(1, 3).binary_data


def test_aggregates_outside_the_hash_range_are_filtered_counted_and_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    # With the Java KCL's filter asked for: the KPL re-sends the user records of an aggregate
    # that landed on the wrong shard, so an aggregate with any sub-record outside the
    # shard's range is dropped whole - and said so at WARNING, with the shard and count.
    low, high = 0, 2**127 - 1
    inside, outside = str(2**100), str(2**127 + 5)
    shard = FakeShard([aggregate(0, 3, [inside, outside, inside]), aggregate(1, 2, [inside] * 2)])
    metrics = Metrics()
    with caplog.at_level(logging.WARNING, logger="kclpy.retrieval.pipeline"):
        results = drain(make(shard, metrics=metrics, hash_range=(low, high),
                             filter_outside_hash_range=True))
    assert payloads(results) == [b"agg-1-0", b"agg-1-1"]
    assert sample(metrics, "kclpy_records_filtered_total", shard_id=SHARD) == 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"shard {SHARD}: 3 user record(s)" in m for m in warnings), warnings


def test_by_default_aggregates_outside_the_hash_range_are_delivered_whole() -> None:
    inside, outside = str(2**100), str(2**127 + 5)
    shard = FakeShard([aggregate(0, 3, [inside, outside, inside])])
    metrics = Metrics()
    results = drain(make(shard, metrics=metrics, hash_range=(0, 2**127 - 1)))
    assert payloads(results) == [b"agg-0-0", b"agg-0-1", b"agg-0-2"]
    assert sample(metrics, "kclpy_records_filtered_total", shard_id=SHARD) == 0


def test_a_page_filtered_to_nothing_is_not_delivered_and_not_idled_on() -> None:
    outside = str(2**127 + 5)
    shard = FakeShard([aggregate(0, 2, [outside] * 2), plain(1)], page_size=1)
    shard.millis_behind = 0
    sleeps = Sleeps()
    fetcher = make(shard, sleeps=sleeps, hash_range=(0, 2**127 - 1),
                   filter_outside_hash_range=True)
    assert fetcher.fetch_once() is None
    assert sleeps.delays == []


def test_a_corrupt_aggregate_is_delivered_raw_and_counted() -> None:
    good = aggregate(0, 2)
    data = bytearray(good.binary_data)
    data[-1] ^= 0xFF  # break the MD5 trailer
    corrupt = Record(
        sequence_number=seq(0),
        partition_key="pk",
        timestamp_millis=0,
        data=bytes(data),
    )
    metrics = Metrics()
    results = drain(make(FakeShard([corrupt, plain(1)]), metrics=metrics))
    assert payloads(results) == [bytes(data), b"plain-1"]
    assert sample(metrics, "kclpy_deaggregation_errors_total", shard_id=SHARD,
                  reason="malformed") == 1


# -- the thread, the queue, stop and errors ----------------------------------------------


@pytest.fixture
def running() -> Iterator[list[ShardPipeline]]:
    fetchers: list[ShardPipeline] = []
    yield fetchers
    for f in fetchers:
        f.stop(timeout=5)


def test_thread_delivers_everything_then_shard_end(running: list[ShardPipeline]) -> None:
    shard = FakeShard([plain(i) for i in range(10)], page_size=3, closed=True)
    fetcher = make(shard, queue_size=2)
    running.append(fetcher)
    fetcher.start()
    results = []
    while True:
        result = fetcher.get(timeout=10)
        assert result is not None
        results.append(result)
        if result.shard_end:
            break
    assert payloads(results) == [f"plain-{i}".encode() for i in range(10)]
    # after the end, get() answers at once instead of waiting
    assert fetcher.get() is None
    assert fetcher.get() is None
    assert fetcher.error is None


class RefusingQueue(queue.Queue[object]):
    """The pipeline's queue, noting how many GetRecords calls the shard had seen each time a
    put found it full: once a put of the page read by call n was refused, the fetch thread is
    provably waiting for room, and reads nothing more until a get makes some."""

    def __init__(self, maxsize: int, shard: FakeShard) -> None:
        super().__init__(maxsize)
        self.shard = shard
        self.refused = threading.Condition()
        self.refused_at: list[int] = []

    def put(self, item: object, block: bool = True, timeout: float | None = None) -> None:
        try:
            super().put(item, block, timeout)
        except queue.Full:
            with self.refused:
                self.refused_at.append(len(self.shard.get_records_calls))
                self.refused.notify_all()
            raise

    def wait_refused_after(self, calls: int) -> bool:
        with self.refused:
            return self.refused.wait_for(lambda: calls in self.refused_at, timeout=10)


def test_full_queue_blocks_the_fetcher(running: list[ShardPipeline]) -> None:
    shard = FakeShard([plain(i) for i in range(50)], page_size=1)
    metrics = Metrics()
    fetcher = make(shard, queue_size=2, metrics=metrics)
    refusing = RefusingQueue(2, shard)
    fetcher._queue = refusing
    running.append(fetcher)
    fetcher.start()
    # queue_size results queued, plus one held by the thread waiting for room
    assert refusing.wait_refused_after(3)
    assert len(shard.get_records_calls) == 3
    assert sample(metrics, "kclpy_prefetch_queue_depth", shard_id=SHARD) == 2

    first = fetcher.get(timeout=5)
    assert first is not None and payloads([first]) == [b"plain-0"]
    assert refusing.wait_refused_after(4)
    assert len(shard.get_records_calls) == 4


def test_stop_is_prompt_while_blocked_on_a_full_queue() -> None:
    shard = FakeShard([plain(i) for i in range(50)], page_size=1)
    fetcher = make(shard, queue_size=1)
    fetcher.start()
    assert shard.wait_for_calls(2)
    fetcher.stop(timeout=5)
    assert fetcher._thread is not None and not fetcher._thread.is_alive()
    assert fetcher.error is None


def test_stop_interrupts_the_idle_sleep_and_wakes_a_blocked_get() -> None:
    shard = FakeShard([])
    fetcher = polling(shard, Position.latest(), ShardAddress(SHARD, stream_name="s"),
                      idle_time_s=3600)
    fetcher.start()
    got: list[object] = []
    consumer = threading.Thread(target=lambda: got.append(fetcher.get()))
    consumer.start()
    assert shard.wait_for_calls(1)
    fetcher.stop(timeout=5)
    assert fetcher._thread is not None and not fetcher._thread.is_alive()
    consumer.join(timeout=5)
    assert not consumer.is_alive()
    assert got == [None]
    assert len(shard.get_records_calls) == 1


def test_fatal_error_surfaces_after_the_results_fetched_before_it(
    running: list[ShardPipeline],
) -> None:
    shard = FakeShard([plain(0), plain(1)], page_size=1)
    not_found = error("ResourceNotFoundException")
    fetcher = make(shard)
    running.append(fetcher)
    original = shard.page

    def fail_third(iterator: str, limit: int) -> Page[Sequence[Record]]:
        if len(shard.get_records_calls) == 2:
            shard.errors["GetRecords"] = [not_found]
        return original(iterator, limit)

    shard.page = fail_third  # type: ignore[method-assign]
    fetcher.start()
    assert payloads([r for r in (fetcher.get(5), fetcher.get(5)) if r]) == [
        b"plain-0",
        b"plain-1",
    ]
    with pytest.raises(FetchError) as raised:
        fetcher.get(timeout=5)
    assert raised.value.__cause__ is not_found
    assert raised.value.lease_key == SHARD
    assert fetcher.error is not_found
    assert fetcher.finished
    # every later call says the same, at once
    with pytest.raises(FetchError):
        fetcher.get()


def test_fatal_error_on_get_shard_iterator_surfaces(running: list[ShardPipeline]) -> None:
    shard = FakeShard([plain(0)])
    shard.errors["GetShardIterator"] = [
        error("ResourceNotFoundException", operation="GetShardIterator")
    ]
    fetcher = make(shard)
    running.append(fetcher)
    fetcher.start()
    with pytest.raises(FetchError):
        fetcher.get(timeout=5)
    assert shard.get_records_calls == []


def test_start_twice_is_refused(running: list[ShardPipeline]) -> None:
    fetcher = make(FakeShard([]))
    running.append(fetcher)
    fetcher.start()
    with pytest.raises(RuntimeError):
        fetcher.start()


# -- the lease coordinator's retrieval gate ---------------------------------------------


class Gate(threading.Event):
    """The retrieval gate, noting which threads found it shut."""

    def __init__(self) -> None:
        super().__init__()
        self.shut_for: set[int] = set()
        self.noted = threading.Condition()

    def wait(self, timeout: float | None = None) -> bool:
        opened = super().wait(timeout)
        if not opened:
            with self.noted:
                self.shut_for.add(threading.get_ident())
                self.noted.notify_all()
        return opened

    def wait_refused_by(self, thread: threading.Thread | None) -> bool:
        assert thread is not None
        with self.noted:
            return self.noted.wait_for(lambda: thread.ident in self.shut_for, timeout=10)


def test_a_closed_gate_holds_fetching_and_handing_out_until_it_opens() -> None:
    shard = FakeShard([plain(i) for i in range(4)], page_size=2, closed=True)
    gate = Gate()
    fetcher = make(shard, gate=gate)
    fetcher.start()
    try:
        assert fetcher.get(timeout=0) is None
        # once the fetch thread found the gate shut, it reads nothing until it opens
        assert gate.wait_refused_by(fetcher._thread)
        assert (shard.shard_iterator_calls, shard.get_records_calls) == ([], [])
        gate.set()
        first = fetcher.get(timeout=10)
        assert first is not None and payloads([first]) == [b"plain-0", b"plain-1"]
        with shard.called:
            shard.called.wait_for(lambda: len(shard.get_records_calls) == 2, timeout=10)
        gate.clear()
        # The second page is fetched and queued, but not handed out while the gate is shut.
        assert fetcher.get(timeout=0) is None
        gate.set()
        second = fetcher.get(timeout=10)
        assert second is not None and payloads([second]) == [b"plain-2", b"plain-3"]
        assert second.shard_end
    finally:
        fetcher.stop()


def test_a_fetcher_stops_while_its_gate_is_shut() -> None:
    gate = threading.Event()
    fetcher = make(FakeShard([plain(0)]), gate=gate)
    fetcher.start()
    fetcher.stop(timeout=10)
    assert fetcher.get(timeout=None) is None


# -- any page source ---------------------------------------------------------------------


class ScriptedSource:
    """A retrieval mode written in a test: the pages it was given, one per read, and what
    the pipeline lent it at each read."""

    idle_s = 0.0

    def __init__(self, pages: list[Page[Sequence[Record]]]) -> None:
        self.address = ShardAddress(SHARD, stream_name="s")
        self._pages = pages
        self.resumed_after: list[str | None] = []
        self.closed = 0

    def read(self, reading: Reading) -> Page[Sequence[Record]]:
        self.resumed_after.append(reading.last_sequence_number)
        if not self._pages:
            reading.pause(0.01)
            raise Stopped
        return self._pages.pop(0)

    def close(self) -> None:
        self.closed += 1

    def status(self) -> dict[str, Any]:
        return {"mode": "scripted"}


def test_any_page_source_gets_the_resume_point_de_aggregation_and_the_queue() -> None:
    """A source that satisfies ``PageSource`` is all a new retrieval mode needs: the
    pipeline drops what is at or before the checkpoint (inside an aggregate too), notes the
    last record of each page for the source to resume after, never idles after an empty
    page when the source says it need not, and closes the source once at the end."""
    pages: list[Page[Sequence[Record]]] = [
        Page([aggregate(0, 3)], 5000, False, [], False),
        Page([], 0, False, [], True),
        Page([plain(1), plain(2)], 0, True, [], True),
    ]
    source = ScriptedSource(pages)
    sleeps = Sleeps()
    pipeline = ShardPipeline(source, Position(seq(0), 1),
                             sleep=sleeps)
    assert pipeline.retrieval == {"mode": "scripted"}
    results = [pipeline.fetch_once() for _ in range(3)]
    assert payloads([r for r in results if r is not None]) == [b"agg-0-2", b"plain-1",
                                                               b"plain-2"]
    assert results[1] is None and sleeps.delays == []
    assert source.resumed_after == [None, seq(0), seq(0)]
    assert results[2] is not None and results[2].shard_end and pipeline.finished
    pipeline.start()
    assert pipeline.get(timeout=5) is None
    pipeline.stop(timeout=5)
    assert source.closed == 1


def test_records_before_an_at_timestamp_start_are_dropped_for_any_source() -> None:
    """An endpoint may round an AT_TIMESTAMP start (kinesis-mock: to the second): what
    arrived before it is dropped by the pipeline, whichever source read it."""
    start = datetime.fromtimestamp((1_700_000_000_000 + 2) / 1000, tz=timezone.utc)
    source = ScriptedSource([Page([plain(0), plain(1), plain(2), plain(3)], 0, False, [], True)])
    result = ShardPipeline(source, Position.at_time(start),
                           sleep=Sleeps()).fetch_once()
    assert result is not None and payloads([result]) == [b"plain-2", b"plain-3"]
