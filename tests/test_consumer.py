"""The shard consumer's state machine, driven with a scripted fetcher and a recording processor."""

from __future__ import annotations

import collections
import json
import random
import threading
from collections.abc import Callable, Sequence
from datetime import datetime, timezone

import pytest
from botocore.exceptions import ClientError

from kclpy.checkpoint import Checkpointer
from kclpy.cloudwatch import SUMMARY, CloudWatchBackend
from kclpy.consumer import ConsumerSettings, ConsumerState, FatalProcessorError, ShardConsumer
from kclpy.errors import (
    CheckpointError,
    ProcessorRestartRequired,
    ShutdownException,
    ThrottlingException,
)
from kclpy.leases.lease import Lease
from kclpy.leases.serializer import UpdateBuilder
from kclpy.metrics import Metrics
from kclpy.position import Position
from kclpy.processor import (
    InitializeInput,
    IRecordProcessor,
    LeaseLostInput,
    ProcessRecordsInput,
    ShardEndedInput,
    ShutdownRequestedInput,
)
from kclpy.records import Record
from kclpy.retrieval.page import ChildShard
from kclpy.retrieval.pipeline import FetchError
from tests.support.datums import DatumSink
from tests.support.scripted import (
    SETTINGS,
    Host,
    Leases,
    Readers,
    Result,
    ScriptedFetcher,
    Writer,
    rec,
)
from tests.support.waiting import wait_for


class Recorder(IRecordProcessor):
    def __init__(self, log: list[object], *, fail_times: int = 0,
                 exc: type[Exception] = RuntimeError, checkpoint_on_end: bool = True,
                 checkpoint_on_shutdown: bool = True) -> None:
        self.log = log
        self.fail_times = fail_times
        self.exc = exc
        self.checkpoint_on_end = checkpoint_on_end
        self.checkpoint_on_shutdown = checkpoint_on_shutdown

    def initialize(self, i: InitializeInput) -> None:
        self.log.append(("init", i.sequence_number, i.sub_sequence_number))

    def process_records(self, p: ProcessRecordsInput) -> None:
        if self.fail_times > 0:
            self.fail_times -= 1
            self.log.append(("fail", [r.sequence_number for r in p.records]))
            raise self.exc("boom")
        self.log.append(("batch", [(r.sequence_number, r.sub_sequence_number) for r in p.records]))
        p.checkpointer.checkpoint()

    def lease_lost(self, i: LeaseLostInput) -> None:
        self.log.append(("lease_lost",))

    def shard_ended(self, i: ShardEndedInput) -> None:
        self.log.append(("shard_ended",))
        if self.checkpoint_on_end:
            i.checkpointer.checkpoint()
        else:
            self.checkpoint_on_end = True  # checkpoints on the second call

    def shutdown_requested(self, i: ShutdownRequestedInput) -> None:
        self.log.append(("shutdown_requested",))
        if self.checkpoint_on_shutdown:
            i.checkpointer.checkpoint()


def run_consumer(pages: list[Result], processors: list[Recorder], *, lease: Lease | None = None,
                 leases: Leases | None = None, settings: ConsumerSettings = SETTINGS,
                 on_end: list[object] | None = None, wait: bool = True,
                 metrics: Metrics | None = None,
                 fetcher_type: type[ScriptedFetcher] = ScriptedFetcher,
                 holds: Callable[[], bool] = lambda: True,
                 ) -> tuple[ShardConsumer, Writer, list[ScriptedFetcher]]:
    writer = Writer(holding=holds)
    fetchers: list[ScriptedFetcher] = []
    made = iter(processors)

    def fetcher_factory(start: Position) -> ScriptedFetcher:
        fetcher = fetcher_type(pages, (start.checkpoint, start.sub_sequence_number))
        fetchers.append(fetcher)
        return fetcher

    def shard_end(shard_id: str, children: Sequence[ChildShard]) -> None:
        if on_end is not None:
            on_end.append((shard_id, list(children)))

    consumer = ShardConsumer(
        lease or Lease("shard-1", lease_owner="w", checkpoint=Position.trim_horizon()),
        concurrency_token="t", processor_factory=lambda: next(made), fence=writer,
        readers=Readers(fetcher_factory), host=Host(leases or Leases(), shard_end),
        settings=settings, metrics=metrics or Metrics(), rng=random.Random(1))
    consumers.append(consumer)
    consumer.start()
    if wait:
        assert consumer.join(10)
    return consumer, writer, fetchers


#: every consumer run_consumer made, latest last (a fetcher reaches its consumer here)
consumers: list[ShardConsumer] = []

CHILD = ChildShard("shard-2", ("shard-1",), "0", "10")


def test_records_in_order_then_shard_end() -> None:
    log: list[object] = []
    ends: list[object] = []
    pages = [Result([rec(1), rec(2)]), Result([rec(3, 0), rec(3, 1)]),
             Result([], shard_end=True, child_shards=[CHILD])]
    consumer, writer, _ = run_consumer(pages, [Recorder(log)], on_end=ends)
    assert log == [("init", "TRIM_HORIZON", 0), ("batch", [("1", 0), ("2", 0)]),
                   ("batch", [("3", 0), ("3", 1)]), ("shard_ended",)]
    assert writer.writes == [("2", 0), ("3", 1), ("SHARD_END", 0)]
    assert ends == [("shard-1", [CHILD])]
    assert consumer.shard_ended and consumer.state is ConsumerState.DONE


def test_shard_ended_is_called_again_until_shard_end_is_checkpointed() -> None:
    log: list[object] = []
    pages = [Result([rec(1)]), Result([], shard_end=True)]
    consumer, writer, _ = run_consumer(pages, [Recorder(log, checkpoint_on_end=False)])
    assert log.count(("shard_ended",)) == 2
    assert writer.writes[-1] == ("SHARD_END", 0)


def test_a_shard_ended_that_never_checkpoints_is_called_until_the_lease_is_lost() -> None:
    """Calling ``shard_ended`` again is retried like a failure, and a lost lease ends it with
    ``lease_lost``, counted neither as an ended shard nor as a processor error."""
    log: list[object] = []

    class NeverEnds(Recorder):
        def shard_ended(self, i: ShardEndedInput) -> None:
            self.log.append(("shard_ended",))
            if self.log.count(("shard_ended",)) == 3:
                consumers[-1].notify_lease_lost()

    metrics = Metrics()
    pages = [Result([rec(1)]), Result([], shard_end=True)]
    consumer, writer, _ = run_consumer(pages, [NeverEnds(log)], metrics=metrics)
    assert log[-4:] == [("shard_ended",)] * 3 + [("lease_lost",)]
    assert not consumer.shard_ended and ("SHARD_END", 0) not in writer.writes
    assert metrics.registry.get_sample_value(
        "kclpy_processor_errors_total", {"shard_id": "shard-1", "callback": "shard_ended"}
    ) is None


def test_processor_error_retries_the_same_batch() -> None:
    log: list[object] = []
    pages = [Result([rec(1), rec(2)]), Result([], shard_end=True)]
    consumer, writer, _ = run_consumer(pages, [Recorder(log, fail_times=2)])
    assert log[1:4] == [("fail", ["1", "2"]), ("fail", ["1", "2"]),
                        ("batch", [("1", 0), ("2", 0)])]
    assert writer.writes[0] == ("2", 0)


def test_a_failed_attempt_is_a_java_process_task_that_succeeded() -> None:
    """The Java KCL catches processRecords' exception and reports its ProcessTask as a
    success; kclpy retries the batch, and each attempt is such a task. The records count
    once, when the processor took them."""
    sink = DatumSink()
    metrics = Metrics(backends=[CloudWatchBackend(sink, "w", SUMMARY)])
    log: list[object] = []
    pages = [Result([rec(1), rec(2)], millis_behind_latest=7), Result([], shard_end=True)]
    run_consumer(pages, [Recorder(log, fail_times=2)], metrics=metrics)
    assert log[1:4] == [("fail", ["1", "2"]), ("fail", ["1", "2"]),
                        ("batch", [("1", 0), ("2", 0)])]
    assert sink.values("ProcessTask", "Success") == [1, 1, 1]
    assert len(sink.values("ProcessTask", "RecordProcessor.processRecords.Time")) == 3
    assert sink.values("ProcessTask", "RecordsProcessed") == [2]
    assert sink.values("ProcessTask", "MillisBehindLatest") == [7]
    # the failures are kclpy's own figure
    assert metrics.registry.get_sample_value(
        "kclpy_processor_errors_total",
        {"shard_id": "shard-1", "callback": "process_records"}) == 2


def test_a_retried_batch_counts_its_failed_attempts_until_one_succeeds() -> None:
    """The shard's failure record, as /status shows it, counts the attempts at one batch:
    each call sees the failures before it, and a success clears it."""
    seen: list[object] = []

    class Watching(Recorder):
        def process_records(self, p: ProcessRecordsInput) -> None:
            failure = consumers[-1].failure
            seen.append(None if failure is None else failure["attempts"])
            super().process_records(p)

    pages = [Result([rec(1)]), Result([rec(2)]), Result([], shard_end=True)]
    consumer, writer, _ = run_consumer(pages, [Watching([], fail_times=3)])
    assert seen == [None, 1, 2, 3, None]
    assert consumer.failure is None and writer.writes[:2] == [("1", 0), ("2", 0)]


def test_skip_policy_moves_on() -> None:
    log: list[object] = []
    settings = ConsumerSettings(**{**SETTINGS.__dict__, "processor_error_policy": "skip"})
    pages = [Result([rec(1)]), Result([rec(2)]), Result([], shard_end=True)]
    consumer, writer, _ = run_consumer(pages, [Recorder(log, fail_times=1)], settings=settings)
    assert log[1:3] == [("fail", ["1"]), ("batch", [("2", 0)])]


def test_shutdown_policy_stops_with_a_fatal_error() -> None:
    settings = ConsumerSettings(**{**SETTINGS.__dict__, "processor_error_policy": "shutdown"})
    consumer, writer, _ = run_consumer([Result([rec(1)])], [Recorder([], fail_times=1)],
                                       settings=settings)
    assert isinstance(consumer.error, FatalProcessorError)
    assert writer.writes == []


class ParkWriter(Writer):
    """The fence, recording the park marks written; refusing them as a lost lease when
    ``lost``."""

    def __init__(self, *, lost: bool = False) -> None:
        super().__init__()
        self.lost = lost
        self.marks: list[dict[str, object]] = []

    def update(self, lease_key: str, token: str | None, changes: UpdateBuilder, *,
               what: str) -> Lease:
        if self.lost:
            raise ShutdownException(f"lease {lease_key} lost")
        (value,) = changes.request()["ExpressionAttributeValues"].values()
        self.marks.append(json.loads(str(value["S"])))
        return Lease(lease_key)


@pytest.mark.parametrize("lost", [False, True])
def test_the_park_policy_parks_after_the_attempts_and_says_so_only_when_the_mark_landed(
        lost: bool) -> None:
    """The worker tells a parked shard (left alone until resumed) from one it lets go to be
    taken again by ``parked``: a park whose mark was refused because the lease was lost
    meanwhile must not read as parked, as the next holder carries on with the shard."""
    log: list[object] = []
    settings = ConsumerSettings(**{**SETTINGS.__dict__, "processor_error_policy": "park",
                                   "processor_error_attempts": 2})
    fence = ParkWriter(lost=lost)
    consumer = ShardConsumer(
        Lease("shard-1", lease_owner="w"), concurrency_token="t",
        processor_factory=lambda: Recorder(log, fail_times=5), fence=fence,
        readers=Readers(lambda start: ScriptedFetcher([Result([rec(1)])], (
            start.checkpoint, start.sub_sequence_number))),
        host=Host(Leases()), settings=settings, metrics=Metrics(), rng=random.Random(1))
    consumer.start()
    assert consumer.join(10)
    assert log[1:4] == [("fail", ["1"]), ("fail", ["1"]), ("lease_lost",)]
    assert (consumer.parked, consumer.ended_why) == (
        (False, "told the lease was lost") if lost else (True, "parked"))
    assert [(m["by"], m["attempts"], m["error"]) for m in fence.marks] == (
        [] if lost else [("worker", 2, "RuntimeError: boom")])


def test_the_processor_gets_lease_lost_when_the_consumer_fails() -> None:
    """The fetch thread stopped on an error: the processor is told, once, before the
    consumer ends, so nothing it holds (a MultiLang child) is left behind."""
    log: list[object] = []

    class Broken(ScriptedFetcher):
        def get(self, timeout: float | None = None) -> Result | None:
            raise RuntimeError("fetching stopped")

    consumer = ShardConsumer(
        Lease("shard-1", lease_owner="w"), concurrency_token="t",
        processor_factory=lambda: Recorder(log), fence=Writer(),
        readers=Readers(lambda _start: Broken([], ("TRIM_HORIZON", 0))), host=Host(Leases()),
        settings=SETTINGS, metrics=Metrics())
    consumer.start()
    assert consumer.join(10)
    assert isinstance(consumer.error, RuntimeError)
    assert log == [("init", "TRIM_HORIZON", 0), ("lease_lost",)]


class NotFound(ScriptedFetcher):
    """Delivers its pages, then fails as a fetch thread stopped by Kinesis answering that
    the shard does not exist (or, with ``code``, another non-retryable error)."""

    code = "ResourceNotFoundException"

    def get(self, timeout: float | None = None) -> Result | None:
        if not self.queue.empty():
            return super().get(timeout)
        cause = ClientError({"Error": {"Code": self.code, "Message": "no shard-1"}},
                            "GetShardIterator")
        raise FetchError("shard-1", cause)


def run_not_found(fetcher: type[ScriptedFetcher],
                  left_stream: Callable[[str], frozenset[str] | None],
                  log: list[object], metrics: Metrics,
                  ends: list[object] | None = None) -> tuple[ShardConsumer, Writer]:
    writer = Writer()
    ended = ends if ends is not None else []
    consumer = ShardConsumer(
        Lease("shard-1", lease_owner="w", checkpoint=Position.trim_horizon()),
        concurrency_token="t", processor_factory=lambda: Recorder(log), fence=writer,
        readers=Readers(lambda start: fetcher([Result([rec(1)])], (start.checkpoint, 0))),
        host=Host(Leases(), lambda key, _children: ended.append(key),
                  left_stream=left_stream),
        settings=SETTINGS, metrics=metrics)
    consumer.start()
    assert consumer.join(10)
    return consumer, writer


def test_a_shard_that_left_the_stream_unfinished_is_ended_at_shard_end_by_its_holder(
        caplog: pytest.LogCaptureFixture) -> None:
    """Kinesis no longer finds the shard, and the listings confirm it left the stream (its
    records past the retention): the processor is ended as at a shard end and checkpoints
    SHARD_END through the fence, so the children start at once instead of at the next
    shard sync; the loss is reported once, as the shard sync reports it. On the code before
    this, the consumer failed and the processor got lease_lost: the lease stayed unfinished
    until a shard sync deleted it."""
    log: list[object] = []
    metrics = Metrics()
    asked: list[str] = []
    ends: list[object] = []

    def left_stream(lease_key: str) -> frozenset[str] | None:
        asked.append(lease_key)
        return frozenset({"shard-2", "shard-3"})

    with caplog.at_level("ERROR", logger="kclpy"):
        consumer, writer = run_not_found(NotFound, left_stream, log, metrics, ends)
    assert asked == ["shard-1"]
    # no shard sync for children: it would delete the unfinished lease under its holder
    assert ends == []
    assert consumer.error is None and consumer.shard_ended
    assert log == [("init", "TRIM_HORIZON", 0), ("batch", [("1", 0)]), ("shard_ended",)]
    assert writer.writes == [("1", 0), ("SHARD_END", 0)]
    assert metrics.registry.get_sample_value(
        "kclpy_data_lost_to_retention_total", {"shard_id": "shard-1"}) == 1
    (error,) = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert "shard-1 left the stream unfinished" in error and "after checkpoint 1/0)" in error
    assert "(shard-2, shard-3)" in error


def test_a_shard_found_gone_by_the_retention_probe_is_ended_by_the_live_read() -> None:
    """A checkpointed shard is first probed for its oldest record (has the retention trimmed
    past the checkpoint?); when the probe is answered not found, the live read is left to
    tell, and the shard confirmed gone is ended with its processor. On the code before this
    the probe's error failed the consumer before its processor was initialized."""
    log: list[object] = []
    metrics = Metrics()

    class Gone(Readers):
        def oldest_record(self) -> Record | None:
            raise ClientError({"Error": {"Code": "ResourceNotFoundException",
                                         "Message": "no shard-1"}}, "GetShardIterator")

    writer = Writer()
    consumer = ShardConsumer(
        Lease("shard-1", lease_owner="w", checkpoint=Position("7")),
        concurrency_token="t", processor_factory=lambda: Recorder(log), fence=writer,
        readers=Gone(lambda start: NotFound([], (start.checkpoint, 0))),
        host=Host(Leases(), left_stream=lambda _key: frozenset({"shard-2"})),
        settings=SETTINGS, metrics=metrics)
    consumer.start()
    assert consumer.join(10)
    assert consumer.error is None and consumer.shard_ended
    assert log == [("init", "7", 0), ("shard_ended",)]
    assert writer.writes == [("SHARD_END", 0)]
    assert metrics.registry.get_sample_value(
        "kclpy_data_lost_to_retention_total", {"shard_id": "shard-1"}) == 1


class Throttled(NotFound):
    code = "ProvisionedThroughputExceededException"


@pytest.mark.parametrize(("fetcher", "confirmed"), [
    (NotFound, None),        # not found, but the listings do not show the shard gone
    (Throttled, frozenset({"shard-2"})),  # any other failure is never taken for it
])
def test_a_shard_not_confirmed_gone_is_never_ended(
        fetcher: type[ScriptedFetcher], confirmed: frozenset[str] | None) -> None:
    """Only Kinesis's not-found answer, confirmed by the listings, ends a shard early; any
    other failure, or a not-found the listings do not bear out (a stream deleted or created
    again), fails the consumer as before: the lease is released, nothing is reported."""
    log: list[object] = []
    metrics = Metrics()
    consumer, writer = run_not_found(fetcher, lambda _key: confirmed, log, metrics)
    assert isinstance(consumer.error, FetchError) and not consumer.shard_ended
    assert log == [("init", "TRIM_HORIZON", 0), ("batch", [("1", 0)]), ("lease_lost",)]
    assert writer.writes == [("1", 0)]
    assert metrics.registry.get_sample_value(
        "kclpy_data_lost_to_retention_total", {"shard_id": "shard-1"}) is None


def test_the_shutdown_policy_ends_the_processor_with_lease_lost() -> None:
    log: list[object] = []
    settings = ConsumerSettings(**{**SETTINGS.__dict__, "processor_error_policy": "shutdown"})
    consumer, _, _ = run_consumer([Result([rec(1)])], [Recorder(log, fail_times=1)],
                                  settings=settings)
    assert isinstance(consumer.error, FatalProcessorError)
    assert log[-1] == ("lease_lost",) and log.count(("lease_lost",)) == 1


def test_restart_required_resumes_from_the_last_checkpoint() -> None:
    log: list[object] = []
    pages = [Result([rec(1)]), Result([rec(2), rec(3)]), Result([], shard_end=True)]
    second = Recorder(log)

    class Crashing(Recorder):
        def process_records(self, p: ProcessRecordsInput) -> None:
            if p.records[0].sequence_number == "2":
                raise ProcessorRestartRequired("child died")
            super().process_records(p)

    crashing = Crashing(log)
    consumer, writer, fetchers = run_consumer(pages, [crashing, second])
    assert log[:2] == [("init", "TRIM_HORIZON", 0), ("batch", [("1", 0)])]
    assert ("init", "1", 0) in log  # re-initialized from the checkpoint after record 1
    assert log[-2:] == [("batch", [("2", 0), ("3", 0)]), ("shard_ended",)]
    assert len(fetchers) == 2 and fetchers[0].stopped


def restart_keeping_the_checkpointer(*, in_initialize: bool = False,
                                     after_4: str | None = None) -> tuple[list[str], Writer]:
    """A processor that keeps its checkpointer (as a background thread would) and dies on
    the batch (2, 3); its successor checkpoints through the kept one: without arguments in
    ``initialize`` (``in_initialize``), at ``after_4`` once it checkpointed record 4.
    Returns the errors those calls raised (by name) and the writer."""
    log: list[object] = []
    pages = [Result([rec(1)]), Result([rec(2), rec(3)]), Result([rec(4)]),
             Result([], shard_end=True)]
    kept: list[Checkpointer] = []
    refused: list[str] = []

    def stale(sequence_number: str | None = None) -> None:
        try:
            kept[-1].checkpoint(sequence_number)
        except CheckpointError as exc:
            refused.append(exc.name)

    class Crashing(Recorder):
        def process_records(self, p: ProcessRecordsInput) -> None:
            kept.append(p.checkpointer)
            if p.records[0].sequence_number == "2":
                raise ProcessorRestartRequired("child died")
            super().process_records(p)

    class Successor(Recorder):
        def initialize(self, i: InitializeInput) -> None:
            super().initialize(i)
            if in_initialize:
                stale()

        def process_records(self, p: ProcessRecordsInput) -> None:
            super().process_records(p)
            if p.records[-1].sequence_number == "4" and after_4 is not None:
                stale(after_4)

    _, writer, _ = run_consumer(pages, [Crashing(log), Successor(log)])
    return refused, writer


def test_a_checkpointer_from_before_a_restart_cannot_move_the_checkpoint_back() -> None:
    """A replaced processor's checkpointer knows only its own last checkpoint (1), not its
    successor's (4): a write through it is refused with the Java ShutdownException (this
    processor instance was shut down) instead of moving the checkpoint back to 2."""
    refused, writer = restart_keeping_the_checkpointer(after_4="2")
    assert writer.writes == [("1", 0), ("3", 0), ("4", 0), ("SHARD_END", 0)]
    assert refused == ["ShutdownException"]


def test_a_checkpointer_from_before_a_restart_cannot_cover_the_failed_batch() -> None:
    """The replaced processor's checkpointer was handed the batch (2, 3) that failed: its
    no-argument checkpoint would cover records nobody processed yet (lost if the worker then
    crashed). Refused; the successor processes the batch and checkpoints it."""
    refused, writer = restart_keeping_the_checkpointer(in_initialize=True)
    assert writer.writes == [("1", 0), ("3", 0), ("4", 0), ("SHARD_END", 0)]
    assert refused == ["ShutdownException"]


def test_lease_lost_calls_lease_lost_and_stops() -> None:
    log: list[object] = []
    consumer, writer, fetchers = run_consumer([Result([rec(1)])], [Recorder(log)], wait=False)
    wait_for(lambda: ("batch", [("1", 0)]) in log, 10, "the first batch delivered")
    consumer.notify_lease_lost()
    assert consumer.join(5)
    assert log[-1] == ("lease_lost",)
    assert fetchers[0].stopped


class LostWhileFetchingTwo(ScriptedFetcher):
    """Hands record 2 out only after the consumer was told its lease is lost, as the
    worker's lost listener tells it when a renewal, or ``held_leases()``, gives the lease up
    while the fetch is under way (CI: a batch fetched under load, delivered 26 ms after
    "gave up lease ...: not renewed for 2.1s")."""

    def get(self, timeout: float | None = None) -> Result | None:
        result = super().get(timeout)
        if result is not None and [r.sequence_number for r in result.records] == ["2"]:
            consumers[-1].notify_lease_lost()
        return result


def test_a_batch_fetched_as_the_lease_is_lost_is_never_handed_to_the_processor() -> None:
    """Its checkpoint would be refused, so the next holder would deliver it again: the
    processor must not see it at all, only lease_lost."""
    log: list[object] = []
    pages = [Result([rec(1)]), Result([rec(2)]), Result([rec(3)])]
    consumer, writer, fetchers = run_consumer(pages, [Recorder(log)],
                                              fetcher_type=LostWhileFetchingTwo)
    assert log == [("init", "TRIM_HORIZON", 0), ("batch", [("1", 0)]), ("lease_lost",)]
    assert writer.writes == [("1", 0)]
    assert fetchers[0].stopped


def test_a_lease_its_fence_no_longer_holds_gets_no_more_batches() -> None:
    """Given up by nobody yet - not renewed within the failover time while the process was
    starved - the lease is already one whose checkpoints the fence refuses: the consumer
    asks ``holds`` before each batch and ends with lease_lost instead."""
    log: list[object] = []
    handed: list[str] = []

    class Counting(ScriptedFetcher):
        def get(self, timeout: float | None = None) -> Result | None:
            result = super().get(timeout)
            if result is not None:
                handed.extend(r.sequence_number for r in result.records)
            return result

    pages = [Result([rec(1)]), Result([rec(2)]), Result([rec(3)])]
    consumer, writer, _ = run_consumer(pages, [Recorder(log)], fetcher_type=Counting,
                                       holds=lambda: "2" not in handed)
    assert log == [("init", "TRIM_HORIZON", 0), ("batch", [("1", 0)]), ("lease_lost",)]
    assert writer.writes == [("1", 0)]
    assert consumer.ended_why == "told the lease was lost"


def test_a_lease_given_up_before_the_processor_started_gets_no_processor() -> None:
    """A worker starved past the failover time while a consumer was starting (CI's
    MultiLang chaos: SIGSTOPped right after adopting a lease) gives the lease up, and the
    next holder may have checkpointed further since: a processor initialized now would
    start from the stale checkpoint this consumer was made with. It gets none - the
    consumer ends with the lease lost before ``initialize``."""
    log: list[object] = []
    consumer, writer, _ = run_consumer([Result([rec(1)])], [Recorder(log)], holds=lambda: False)
    assert log == []
    assert writer.writes == []
    assert consumer.ended_why == "told the lease was lost"


def test_shutdown_request_lets_the_processor_checkpoint() -> None:
    log: list[object] = []

    class NoCheckpointInBatch(Recorder):
        def process_records(self, p: ProcessRecordsInput) -> None:
            self.log.append(("batch", [r.sequence_number for r in p.records]))

    processor = NoCheckpointInBatch(log)
    consumer, writer, _ = run_consumer([Result([rec(1), rec(2)])], [processor], wait=False)
    wait_for(lambda: any(entry[0] == "batch" for entry in log if isinstance(entry, tuple)),
             10, "a batch delivered")
    consumer.request_shutdown()
    assert consumer.join(5)
    assert log[-1] == ("shutdown_requested",)
    assert writer.writes == [("2", 0)]


def test_failed_batch_is_not_checkpointed_by_shutdown_requested() -> None:
    log: list[object] = []
    slow = ConsumerSettings(**{**SETTINGS.__dict__, "task_backoff_s": 5.0,
                               "max_task_backoff_s": 5.0})

    class FailsOnTwo(Recorder):
        def process_records(self, p: ProcessRecordsInput) -> None:
            if p.records[0].sequence_number == "2":
                self.log.append(("fail", ["2"]))
                raise RuntimeError("boom")
            super().process_records(p)

    consumer, writer, _ = run_consumer([Result([rec(1)]), Result([rec(2)])],
                                       [FailsOnTwo(log)], settings=slow, wait=False)
    wait_for(lambda: ("fail", ["2"]) in log, 10, "the failing batch delivered")
    consumer.request_shutdown()
    assert consumer.join(5)
    assert log[-1] == ("shutdown_requested",)
    # shutdown_requested called checkpoint(): it must not cover the batch that failed
    assert writer.writes == [("1", 0)]


def test_a_lease_lost_while_a_shutdown_request_waits_ends_with_lease_lost() -> None:
    """A stream dropped from the tracker asks its consumer to shut down. When the lease
    expires on the worker before the consumer gets to that request (a CPU-starved machine:
    renewals late past the failover time), another worker may hold the lease already, so the
    processor is told ``lease_lost`` and given no checkpointer - the Java KCL's
    ``ShutdownReason`` ranks LEASE_LOST above REQUESTED the same way."""
    log: list[object] = []
    in_batch, go_on = threading.Event(), threading.Event()

    class HeldInBatch(Recorder):
        def process_records(self, p: ProcessRecordsInput) -> None:
            self.log.append(("batch", [r.sequence_number for r in p.records]))
            in_batch.set()
            go_on.wait(10)

    consumer, writer, _ = run_consumer([Result([rec(1)])], [HeldInBatch(log)], wait=False)
    assert in_batch.wait(10)
    consumer.request_shutdown()
    consumer.notify_lease_lost()
    go_on.set()
    assert consumer.join(5)
    assert log == [("init", "TRIM_HORIZON", 0), ("batch", ["1"]), ("lease_lost",)]
    assert writer.writes == []
    assert consumer.ended_why == "told the lease was lost"


class ReadCounting(Leases):
    """Leases that count the reads of each key."""

    def __init__(self, leases: dict[str, Lease]) -> None:
        super().__init__(leases)
        self.reads: collections.Counter[str] = collections.Counter()
        self.read = threading.Condition()

    def get_lease(self, lease_key: str) -> Lease | None:
        with self.read:
            self.reads[lease_key] += 1
            self.read.notify_all()
        return super().get_lease(lease_key)

    def wait_reads(self, lease_key: str, count: int) -> bool:
        with self.read:
            return self.read.wait_for(lambda: self.reads[lease_key] >= count, timeout=10)


def test_waits_for_parents_until_shard_end() -> None:
    log: list[object] = []
    parent = Lease("shard-0", checkpoint=Position("123"))
    leases = ReadCounting({"shard-0": parent})
    lease = Lease("shard-1", parent_shard_ids=frozenset({"shard-0", "gone"}))
    consumer, _, _ = run_consumer([Result([rec(1)]), Result([], shard_end=True)],
                                  [Recorder(log)], lease=lease, leases=leases, wait=False)
    # a second read of the parent proves the first one was judged "wait"
    assert leases.wait_reads("shard-0", 2)
    assert consumer.state is ConsumerState.WAITING_ON_PARENTS and log == []
    leases.leases["shard-0"] = parent.copy(checkpoint=Position.shard_end())
    assert consumer.join(5)
    assert log[0] == ("init", "TRIM_HORIZON", 0)


def test_lease_already_at_shard_end_needs_no_processor() -> None:
    log: list[object] = []
    consumer, writer, fetchers = run_consumer(
        [], [Recorder(log)], lease=Lease("shard-1", checkpoint=Position.shard_end()))
    assert log == [] and fetchers == [] and consumer.shard_ended


def test_initialize_failure_is_retried() -> None:
    log: list[object] = []

    class FailsOnce(Recorder):
        calls = 0

        def initialize(self, i: InitializeInput) -> None:
            FailsOnce.calls += 1
            if FailsOnce.calls == 1:
                raise RuntimeError("init boom")
            super().initialize(i)

    consumer, writer, _ = run_consumer([Result([rec(1)]), Result([], shard_end=True)],
                                       [FailsOnce(log), FailsOnce(log)])
    assert log[0] == ("init", "TRIM_HORIZON", 0)
    assert writer.writes == [("1", 0), ("SHARD_END", 0)]


def test_an_initialize_failure_is_counted_and_a_failing_factory_is_not_retried() -> None:
    log: list[object] = []

    class FailsOnce(Recorder):
        calls = 0

        def initialize(self, i: InitializeInput) -> None:
            FailsOnce.calls += 1
            if FailsOnce.calls == 1:
                raise RuntimeError("init boom")
            super().initialize(i)

    metrics = Metrics()
    run_consumer([Result([], shard_end=True)], [FailsOnce(log), FailsOnce(log)],
                 metrics=metrics)
    assert metrics.registry.get_sample_value(
        "kclpy_processor_errors_total", {"shard_id": "shard-1", "callback": "initialize"}) == 1

    made: list[str] = []

    def no_processor() -> Recorder:
        made.append("tried")
        raise RuntimeError("no processor")

    consumer = ShardConsumer(
        Lease("shard-1", lease_owner="w", checkpoint=Position.trim_horizon()),
        concurrency_token="t", processor_factory=no_processor, fence=Writer(),
        readers=Readers(lambda start: ScriptedFetcher([], (start.checkpoint, 0))),
        host=Host(Leases()), settings=SETTINGS, metrics=Metrics(), rng=random.Random(1))
    consumer.start()
    assert consumer.join(10)
    assert made == ["tried"] and isinstance(consumer.error, RuntimeError)


class StartKeeper(Writer):
    """The fence, recording the resolved starts its ``update`` wrote."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[tuple[str, int]] = []

    def update(self, lease_key: str, token: str | None, changes: UpdateBuilder, *,
               what: str) -> Lease:
        request = changes.request()
        assert list(request["ExpressionAttributeNames"].values()) == ["kclpyStartAt"]
        self.kept.append((lease_key, int(request["ExpressionAttributeValues"][":v0"]["N"])))
        return Lease(lease_key)


def latest_consumer(lease: Lease, processors: list[Recorder], keeper: StartKeeper,
                    starts: list[datetime | None], pages: list[Result]) -> ShardConsumer:
    made = iter(processors)

    def fetcher_factory(start: Position) -> ScriptedFetcher:
        starts.append(start.moment)
        return ScriptedFetcher(pages, (start.checkpoint, start.sub_sequence_number))

    return ShardConsumer(
        lease, concurrency_token="t", processor_factory=lambda: next(made), fence=keeper,
        readers=Readers(fetcher_factory, clock=lambda: 1_700_000_000.123),
        host=Host(Leases()), settings=SETTINGS, metrics=Metrics(), rng=random.Random(1))


def test_latest_is_resolved_once_kept_in_the_lease_and_reused_by_a_restart() -> None:
    log: list[object] = []

    class Crashing(Recorder):
        def process_records(self, p: ProcessRecordsInput) -> None:
            raise ProcessorRestartRequired("child died on its first batch")

    keeper = StartKeeper()
    starts: list[datetime | None] = []
    pages = [Result([rec(1)]), Result([], shard_end=True)]
    consumer = latest_consumer(Lease("shard-1", lease_owner="w", checkpoint=Position.latest()),
                               [Crashing(log), Recorder(log)], keeper, starts, pages)
    consumer.start()
    assert consumer.join(10)
    assert keeper.kept == [("shard-1", 1_700_000_000_123)], "written once, before reading"
    resolved = datetime.fromtimestamp(1_700_000_000.123, tz=timezone.utc)
    assert starts == [resolved, resolved], "the restarted processor reads from the same point"
    assert ("batch", [("1", 0)]) in log


class FailingKeeper(StartKeeper):
    """A fence whose first writes of the start fail with ``failures`` in turn."""

    def __init__(self, *failures: Exception) -> None:
        super().__init__()
        self.failures = list(failures)

    def update(self, lease_key: str, token: str | None, changes: UpdateBuilder, *,
               what: str) -> Lease:
        if self.failures:
            raise self.failures.pop(0)
        return super().update(lease_key, token, changes, what=what)


def test_keeping_the_start_retries_a_throttle_and_stops_at_a_lost_lease() -> None:
    keeper = FailingKeeper(ThrottlingException("slow down"))
    starts: list[datetime | None] = []
    lease = Lease("shard-1", lease_owner="w", checkpoint=Position.latest())
    consumer = latest_consumer(lease, [Recorder([])], keeper, starts,
                               [Result([], shard_end=True)])
    consumer.start()
    assert consumer.join(10)
    assert keeper.kept == [("shard-1", 1_700_000_000_123)] and len(starts) == 1

    keeper = FailingKeeper(ShutdownException("lease taken"), ThrottlingException("unused"))
    starts = []
    log: list[object] = []
    consumer = latest_consumer(Lease("shard-1", lease_owner="w", checkpoint=Position.latest()),
                               [Recorder(log)], keeper, starts, [Result([], shard_end=True)])
    consumer.start()
    assert consumer.join(10)
    assert len(keeper.failures) == 1, "a lost lease is not retried"
    assert keeper.kept == [] and starts == [] and log == []


def test_a_start_kept_in_the_lease_is_used_as_it_is() -> None:
    keeper = StartKeeper()
    starts: list[datetime | None] = []
    lease = Lease("shard-1", lease_owner="w", checkpoint=Position.latest(),
                  start_at_ms=1_600_000_000_000)
    consumer = latest_consumer(lease, [Recorder([])], keeper, starts,
                               [Result([], shard_end=True)])
    consumer.start()
    assert consumer.join(10)
    assert keeper.kept == []
    assert starts == [datetime.fromtimestamp(1_600_000_000, tz=timezone.utc)]
