"""Operator requests to a held shard's recovery queue (``kclpy recovery add`` / ``cancel``):
the holder takes them in without the lease changing hands, and none is lost or applied
twice whatever write it races - the holder's own queue writes, a move of the lease, a
transaction of exactly-once state. Against kclpy.local's DynamoDB server, whose conditional
writes are atomic; the worker end to end over real HTTP is in tests/ops/test_control.py."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, cast

import pytest
from botocore.exceptions import ReadTimeoutError

from kclpy.errors import KinesisClientLibDependencyException
from kclpy.leases import serializer as ser
from kclpy.leases.lease import Lease
from kclpy.leases.serializer import UpdateBuilder
from kclpy.leases.table import LeaseTable
from kclpy.local import LocalEndpoint
from kclpy.ops import control
from kclpy.position import Position
from kclpy.records import Record, Records
from kclpy.recovery import queue as gaps
from kclpy.recovery import requests as asked
from kclpy.recovery.queue import RecoveryRequest
from kclpy.recovery.shard import ShardRecovery
from kclpy.retrieval.page import Page
from kclpy.retrieval.pipeline import ShardPipeline
from kclpy.retrieval.polling import Pacer
from tests.support.cli import run_cli
from tests.support.determinism import Clock
from tests.support.recovery import Holder, recovery_for
from tests.support.streams import dynamodb_client, unique_name

KEY = "s1"


def gap_after(start: int, *, done: int | None = None) -> RecoveryRequest:
    """A gap whose arrival times keep it apart from every other gap of these tests."""
    request = RecoveryRequest.gap(str(start), 0, start * 10 + 5, start * 10, None)
    return request if done is None else request.checkpointed(Position(str(done)),
                                                             start * 10 + 1)


def add(start: int) -> asked.QueueRequest:
    return asked.adding(gap_after(start), round(time.time() * 1000))


def cancel(*starts: int) -> asked.QueueRequest:
    """A cancel of the gaps after ``starts`` as ``add`` queued them."""
    return asked.cancelling((gap_after(s) for s in starts), round(time.time() * 1000))


class IdleReader:
    """A gap reader that has nothing to hand out yet; notes whether it was stopped. As a
    retention probe it finds the shard's oldest record at sequence number 1 (nothing of a
    gap trimmed)."""

    caught_up = False
    finished = False

    def __init__(self) -> None:
        self.stopped = False

    def fetch_once(self) -> Page[Records]:
        return Page(Records([[Record("1", "pk", None, 0, b"")]]), None)

    def start(self) -> None:
        return None

    def stop(self) -> None:
        self.stopped = True

    def get(self, timeout: float | None = None) -> Page[Records] | None:
        return None


class Readers:
    def __init__(self) -> None:
        self.opened: list[tuple[Position, IdleReader]] = []

    def __call__(self, start: Position, until_ms: int | None, pacer: Pacer | None,
                 max_records: int | None) -> ShardPipeline:
        reader = IdleReader()
        self.opened.append((start, reader))
        return cast(ShardPipeline, reader)


@pytest.fixture
def table(moto_server: LocalEndpoint) -> LeaseTable:
    table = LeaseTable(dynamodb_client(moto_server.url), unique_name("requests"))
    table.create_if_missing()
    assert table.create(Lease(KEY, checkpoint=Position("5000")))
    return table


def item(table: LeaseTable) -> Lease:
    lease = table.get(KEY)
    assert lease is not None
    return lease


def starts(queue: tuple[RecoveryRequest, ...]) -> list[str]:
    return [r.start for r in queue]


def active(recovery: ShardRecovery) -> bool:
    """Read again after each step (mypy would keep an asserted property narrowed)."""
    return recovery.active


def stopped(reader: IdleReader) -> bool:
    return reader.stopped


def renew(holder: Holder) -> None:
    holder.fence.write(KEY, None, holder.table.renew, what="renewal")


def holding(table: LeaseTable, worker: str = "A") -> tuple[Holder, str, ShardRecovery, Readers]:
    holder = Holder(table, worker, Clock())
    token = holder.take(KEY)
    readers = Readers()
    lease = holder.held.get(KEY)
    assert lease is not None
    return holder, token, recovery_for(holder, token, lease.recovery,
                                       reader_factory=readers), readers


# -- the requests themselves -----------------------------------------------------------------


def test_requests_apply_in_the_order_made_and_round_trip_through_their_element() -> None:
    first = asked.adding(gap_after(100), 1_000)
    dropped = asked.cancelling([gap_after(100)], 2_000)
    second = asked.adding(gap_after(300), 3_000)
    texts = [second.to_text(), first.to_text(), dropped.to_text(), "{not json"]
    readable, unreadable = asked.read(texts)
    assert [r for _, r in readable] == [first, dropped, second]
    assert unreadable == ["{not json"]
    assert starts(asked.apply((), [r for _, r in readable])) == ["300"]
    with pytest.raises(ValueError, match="neither an add nor a cancel"):
        asked.QueueRequest.from_text('{"v":1,"id":"x","at":1}')


GROWN = RecoveryRequest.gap("100", 0, 2_000, 1_000, None)


@pytest.mark.parametrize("since", [
    GROWN,  # the lag found again from the same checkpoint, later
    RecoveryRequest.gap("102", 0, 2_000, 1_002, None),  # a lag that starts inside it
], ids=["found-again", "overlapping"])
def test_a_cancel_never_drops_what_merged_into_its_gap_after_the_operator_saw_it(
        since: RecoveryRequest) -> None:
    """The operator saw the gap after 100 end at 1005 ms; a gap found since merged into it
    (``queue.add``: same start, the end moved to 2000). The cancel named the start alone and
    dropped the records of 1005..2000 ms nobody showed the operator; it names the end seen
    too, and is refused: the gap stays whole, and the note says why."""
    seen = gap_after(100)
    grown = gaps.add((seen,), since)
    assert starts(grown) == ["100"] and grown[0].end_ms == 2_000
    queue, refused = asked.applied(grown, [asked.cancelling([seen], 2_000)])
    assert queue == grown
    assert len(refused) == 1 and "has grown since it was seen" in refused[0]
    assert "before 1970-01-01T00:00:02.000+00:00 now" in refused[0]


def test_a_cancel_drops_its_gap_as_seen_checkpointed_since_or_cut_shorter() -> None:
    """What the gap holds is its start and end: recovery's progress inside it, or an end
    moved back by ``kclpy checkpoint set``, leave nothing the operator did not see."""
    seen = gap_after(100)
    request = asked.cancelling([seen], 2_000)
    for now in (seen, gap_after(100, done=103), replace(seen, end_ms=1_003),
                replace(seen, last_sequence="103")):
        assert asked.applied((now, gap_after(300)), [request]) == ((gap_after(300),), [])


def test_a_cancel_of_a_gap_ending_at_a_record_never_drops_a_later_record() -> None:
    """An operator's gap ends at a record (``--to``); another ``recovery add`` from the same
    record on, through a later one, merges into it."""
    seen = RecoveryRequest.gap("100", 0, 1_005, 1_000, None, last_sequence="150")
    grown = gaps.add((seen,), replace(seen, last_sequence="180"))
    assert grown[0].last_sequence == "180"
    queue, refused = asked.applied(grown, [asked.cancelling([seen], 2_000)])
    assert queue == grown and "(it ends through 180 now)" in refused[0]


def test_a_cancel_an_older_kclpy_wrote_is_read_and_keeps_its_gap() -> None:
    """Its element names the start alone: what its operator saw is unknown, so it is refused
    like a grown gap (read again, never lost). This version's cancel keeps the start pairs'
    key free, so an older kclpy cannot read it as a cancel by the start alone."""
    older = '{"at":2000,"cancel":[["100",0]],"id":"x","v":1}'
    (element, request), = asked.read([older])[0]
    assert element == older and request.cancel == (asked.Seen("100", 0),)
    queue, refused = asked.applied((gap_after(100),), [request])
    assert queue == (gap_after(100),)
    assert len(refused) == 1 and "written by an older kclpy names no end" in refused[0]
    assert "cancel" not in json.loads(cancel(100).to_text())


def test_a_finished_shard_with_a_request_waiting_is_not_finished() -> None:
    closed = Lease("p", checkpoint=Position.shard_end())
    assert closed.is_finished
    assert not closed.copy(recovery_requests=frozenset({add(100).to_text()})).is_finished


# -- a held lease ----------------------------------------------------------------------------


def listed(capsys: pytest.CaptureFixture[str], table: LeaseTable, url: str) -> list[str]:
    """``kclpy recovery list``: the STATE of each gap."""
    code, out, err = run_cli(capsys, "recovery", "list", "--application-name",
                             table.table_name, "--region", "us-east-1",
                             "--kinesis-endpoint", url, "--dynamodb-endpoint", url)
    assert code == 0, err
    return [line.split()[-1] for line in out.splitlines()[1:-1]]


def test_an_add_stays_with_the_holder_who_reads_it_within_one_renewal(
        table: LeaseTable, moto_server: LocalEndpoint,
        capsys: pytest.CaptureFixture[str]) -> None:
    holder, _, recovery, readers = holding(table)
    taken = item(table)
    assert control._request(table, taken, add(100))[0] == "A"
    after = item(table)
    assert (after.lease_owner, after.lease_counter) == ("A", taken.lease_counter), (
        "the request leaves the lease and its counter alone")
    assert after.recovery is None and len(after.recovery_requests) == 1
    assert listed(capsys, table, moto_server.url) == ["requested"]
    assert active(recovery) is False, "the holder has not renewed since"
    renew(holder)
    assert active(recovery)
    assert recovery.poll() is None  # takes the request in and opens the gap's reader
    stored = item(table)
    assert (stored.lease_owner, stored.lease_counter) == ("A", taken.lease_counter + 2)
    assert starts(gaps.loads(stored.recovery)) == ["100"] and not stored.recovery_requests
    assert [start.sequence_number for start, _ in readers.opened] == ["100"]
    assert [g["reading"] for g in recovery.status()] == [True]
    assert listed(capsys, table, moto_server.url) == ["queued"]


def test_an_add_racing_the_holders_own_queue_write_is_kept_for_its_next_write(
        table: LeaseTable) -> None:
    holder, _, recovery, _ = holding(table)
    with recovery._lock:
        recovery._store(lambda _: (gap_after(100),))
    control._request(table, item(table), add(300))  # lands after the holder's last answer
    # the holder's write, from what it has seen
    recovery.checkpoint(Position("100", 0), Position("150"))
    lease = item(table)
    assert [(r.start, r.done) for r in gaps.loads(lease.recovery)] == [("100", "150")]
    assert len(lease.recovery_requests) == 1, "not in that write's DELETE: still waiting"
    assert recovery.active  # that write's answer showed the request
    recovery.poll()
    lease = item(table)
    assert [(r.start, r.done) for r in gaps.loads(lease.recovery)] == [("100", "150"),
                                                                        ("300", "300")]
    assert not lease.recovery_requests and lease.lease_owner == "A"


def test_adds_and_cancels_racing_the_holders_writes_are_each_applied_once(
        table: LeaseTable) -> None:
    """The operator's requests and the holder's checkpoints and renewals, interleaved by
    the server as they come: at the end every add is queued once, every cancel applied,
    the holder's progress kept, and the lease never left the holder."""
    holder, _, recovery, _ = holding(table)
    with recovery._lock:
        recovery._store(lambda _: (gap_after(10),))
    stop = threading.Event()
    errors: list[BaseException] = []

    def hold() -> None:
        done = 10
        try:
            while not stop.is_set():
                done += 1
                recovery.checkpoint(Position("10", 0), Position(str(done)))
                renew(holder)
                recovery.poll()
        except BaseException as exc:  # reported below, with the thread's own traceback
            errors.append(exc)

    worker = threading.Thread(target=hold)
    worker.start()
    try:
        for start in range(100, 1100, 100):
            control._request(table, item(table), add(start))
        control._request(table, item(table), cancel(200, 500))
    finally:
        stop.set()
        worker.join()
    assert not errors, errors
    renew(holder)
    recovery.poll()
    lease = item(table)
    queue = gaps.loads(lease.recovery)
    expected = ["10", *(str(s) for s in range(100, 1100, 100) if s not in (200, 500))]
    assert starts(queue) == expected
    assert int(queue[0].done) > 10, "the holder's progress was never overwritten"
    assert not lease.recovery_requests and lease.lease_owner == "A"


def test_a_cancel_stops_the_holders_reading_of_the_gap(table: LeaseTable) -> None:
    holder, _, recovery, readers = holding(table)
    control._request(table, item(table), add(100))
    renew(holder)
    recovery.poll()
    [(_, reader)] = readers.opened
    holder_before = item(table)
    assert control._request(table, holder_before, cancel(100))[0] == "A"
    assert stopped(reader) is False
    renew(holder)
    assert recovery.poll() is None
    assert stopped(reader) and recovery.status() == [] and not recovery.active
    lease = item(table)
    assert lease.recovery is None and not lease.recovery_requests
    assert lease.lease_owner == "A"


def test_a_cancel_the_holder_takes_in_after_its_gap_grew_keeps_the_gap(
        table: LeaseTable, caplog: pytest.LogCaptureFixture) -> None:
    """The operator's request names the gap as it was; before the holder's next renewal
    shows the request, the holder finds the lag again from the same checkpoint and its
    queue write merges the longer gap into the queued one. The fold refuses the cancel:
    the whole gap stays queued and read, the request leaves the set, the log says why."""
    holder, _, recovery, readers = holding(table)
    control._request(table, item(table), add(100))
    renew(holder)
    recovery.poll()
    [(_, reader)] = readers.opened
    seen = gaps.loads(item(table).recovery)
    assert control._request(table, item(table), asked.cancelling(seen, 2_000))[0] == "A"
    with recovery._lock:
        recovery._store(lambda queue: gaps.add(queue, GROWN))
    renew(holder)
    with caplog.at_level(logging.WARNING, logger="kclpy.recovery.shard"):
        recovery.poll()
    lease = item(table)
    assert [(r.start, r.end_ms) for r in gaps.loads(lease.recovery)] == [("100", 2_000)]
    assert not lease.recovery_requests and lease.lease_owner == "A"
    assert stopped(reader) is False and recovery.active
    assert "recovery cancel not applied: the gap after 100 before " in caplog.text
    assert "has grown since it was seen" in caplog.text


def test_recovery_cancel_drops_only_the_gap_as_listed(
        table: LeaseTable, moto_server: LocalEndpoint,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``kclpy recovery cancel --gap N --ends END``, N and END as ``recovery list`` showed
    them: a gap that grew since is refused (exit 1, nothing written), one as listed is
    dropped and the command names what it dropped. ``--gap`` without ``--ends`` is a usage
    error: the number alone names whatever the gap has become."""
    holder, _, recovery, _ = holding(table)
    control._request(table, item(table), add(100))
    renew(holder)
    recovery.poll()
    cli = ["--application-name", table.table_name, "--shard-id", KEY, "--region", "us-east-1",
           "--kinesis-endpoint", moto_server.url, "--dynamodb-endpoint", moto_server.url]
    code, out, err = run_cli(capsys, "recovery", "list", *cli)
    assert code == 0, err
    ends = "before 1970-01-01T00:00:01.005+00:00"
    assert ends in out.splitlines()[1]
    with recovery._lock:
        recovery._store(lambda queue: gaps.add(queue, GROWN))
    code, _, err = run_cli(capsys, "recovery", "cancel", *cli, "--gap", "1")
    assert (code, "error: argument --ends: required with --gap" in err) == (2, True), err
    code, out, err = run_cli(capsys, "recovery", "cancel", *cli, "--gap", "1", "--ends",
                             "1970-01-01T00:00:01.005+00:00")
    assert code == 1, (out, err)
    assert ("ends before 1970-01-01T00:00:02.000+00:00 now, not " + ends) in err
    lease = item(table)
    assert not lease.recovery_requests, "nothing written"
    assert [r.end_ms for r in gaps.loads(lease.recovery)] == [2_000]
    code, out, err = run_cli(capsys, "recovery", "cancel", *cli, "--gap", "1", "--ends",
                             "before 1970-01-01T00:00:02")
    assert code == 0, err
    assert "(after 100 before 1970-01-01T00:00:02.000+00:00); 0 left" in out
    renew(holder)
    recovery.poll()
    assert item(table).recovery is None and not item(table).recovery_requests


# -- a queue write whose answer was lost -----------------------------------------------------


def answer_lost(monkeypatch: pytest.MonkeyPatch, table: LeaseTable) -> None:
    """The table's next UpdateItem lands and its answer is lost (the connection dropped on
    the way back); later ones are answered."""
    real = table.client.update_item
    lost = [True]

    def update_item(**kwargs: Any) -> Any:
        answer = real(**kwargs)
        if lost.pop() if lost else False:
            raise ReadTimeoutError(endpoint_url="dynamodb")
        return answer

    monkeypatch.setattr(table.client, "update_item", update_item)


def holding_gaps(table: LeaseTable) -> tuple[Holder, ShardRecovery]:
    """A holder whose recovery queued the gaps after 100 and 900 at an operator's request,
    reading the first."""
    holder, _, recovery, _ = holding(table)
    control._request(table, item(table), add(100))
    control._request(table, item(table), add(900))
    renew(holder)
    recovery.poll()
    assert queued(table) == [("100", "100"), ("900", "900")]
    return holder, recovery


def queued(table: LeaseTable) -> list[tuple[str, str]]:
    return [(r.start, r.done) for r in gaps.loads(item(table).recovery)]


@pytest.mark.parametrize("finished", [False, True], ids=["checkpointed", "finished"])
def test_a_gap_checkpoint_whose_answer_was_lost_survives_the_fold_of_an_operator_request(
        finished: bool, table: LeaseTable, monkeypatch: pytest.MonkeyPatch) -> None:
    """A gap's checkpoint (or the one that finished the gap) lands and its answer is lost;
    an operator then cancels another gap, and the holder folds that in. The fold writes the
    queue the item holds: before, it wrote the holder's own copy, which never saw the
    landed write, and moved the gap's checkpoint back (150 -> 100) or queued the finished
    gap again."""
    holder, recovery = holding_gaps(table)
    if finished:
        recovery._final = Position("150")  # the gap being read ended there
    answer_lost(monkeypatch, table)
    with pytest.raises(KinesisClientLibDependencyException):
        recovery.checkpoint(Position("100", 0), Position("150"))
    landed = [("900", "900")] if finished else [("100", "150"), ("900", "900")]
    assert queued(table) == landed
    control._request(table, item(table), cancel(900))
    renew(holder)  # its answer shows the request, and the item the lost write left
    recovery.poll()
    assert queued(table) == landed[:-1]
    assert not item(table).recovery_requests and item(table).lease_owner == "A"


def test_a_gap_checkpoint_whose_answer_was_lost_survives_the_next_checkpoint_of_another_gap(
        table: LeaseTable, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same without a renewal between: the next queue write is refused by the counter
    the lost one moved, and the fence makes it again on the item that write left. It
    moves the other gap's checkpoint and keeps the landed one (before: 150 -> 100)."""
    _, recovery = holding_gaps(table)
    answer_lost(monkeypatch, table)
    with pytest.raises(KinesisClientLibDependencyException):
        recovery.checkpoint(Position("100", 0), Position("150"))
    recovery.checkpoint(Position("900", 0), Position("950"))
    assert queued(table) == [("100", "150"), ("900", "950")]
    recovery.checkpoint(Position("100", 0), Position("120"))
    assert queued(table) == [("100", "150"), ("900", "950")], "never moved back"


# -- a lease on the move, or nobody's --------------------------------------------------------


class MovingTable(LeaseTable):
    """Runs ``between`` once, right after the operator's read of the lease and before its
    write: the lease moves in that window."""

    def __init__(self, table: LeaseTable, between: Callable[[], None]) -> None:
        super().__init__(table.client, table.table_name)
        self._between: Callable[[], None] | None = between

    def get(self, lease_key: str) -> Lease | None:
        lease = super().get(lease_key)
        between, self._between = self._between, None
        if between is not None:
            between()
        return lease


def test_an_add_meeting_a_release_is_written_to_the_queue_instead(table: LeaseTable) -> None:
    holder, _, _, _ = holding(table)
    moving = MovingTable(table, lambda: holder.fence.release(KEY))
    holder_named, queue, _ = control._request(moving, item(table), add(100))
    assert holder_named is None and starts(queue) == ["100"]
    lease = item(table)
    assert lease.lease_owner is None and not lease.recovery_requests
    assert starts(gaps.loads(lease.recovery)) == ["100"]


def test_an_add_left_with_a_holder_that_loses_the_lease_goes_to_the_next_one(
        table: LeaseTable) -> None:
    first, _, old, _ = holding(table, "A")
    control._request(table, item(table), add(100))
    renew(first)  # A sees the request ...
    second, _, new, readers = holding(table, "B")  # ... but B takes the lease first
    assert old.poll() is None, "A's write of it is refused: nothing changes"
    assert first.held.get(KEY) is None
    lease = item(table)
    assert lease.recovery is None and len(lease.recovery_requests) == 1
    new.poll()
    lease = item(table)
    assert lease.lease_owner == "B" and not lease.recovery_requests
    assert starts(gaps.loads(lease.recovery)) == ["100"]
    assert len(readers.opened) == 1


def test_an_add_during_a_graceful_handoff_is_taken_in_once_by_the_handing_off_holder(
        table: LeaseTable) -> None:
    """Java KCL 3.x handoff: ``leaseOwner`` already names B while A, the holder, finishes
    (``checkpointOwner``). The request is made of B's lease, A takes it in, B inherits it."""
    first, _, old, _ = holding(table, "A")
    first.held.add_handoff_listener(lambda key: None)  # A winds down, as a worker does
    table.set_checkpoint_owner(item(table), "B")
    assert control._request(table, item(table), add(100))[0] == "B"
    renew(first)  # refused as A, repeated as the handing-off holder: sees the request
    assert first.held.handing_off(KEY)
    old.poll()
    lease = item(table)
    assert (lease.lease_owner, lease.checkpoint_owner) == ("B", "A")
    assert starts(gaps.loads(lease.recovery)) == ["100"] and not lease.recovery_requests
    first.fence.release(KEY)
    adopted = table.adopt(item(table))  # B's tenure starts with the queue, nothing pending
    assert adopted.lease_owner == "B"
    assert starts(gaps.loads(adopted.recovery)) == ["100"] and not adopted.recovery_requests


def test_an_add_to_a_lease_nobody_holds_writes_its_queue_with_what_a_holder_left(
        table: LeaseTable) -> None:
    left = add(100)
    table.call("UpdateItem", table.client.update_item, TableName=table.table_name,
               Key=ser.key_of(KEY),
               **UpdateBuilder().add(ser.RECOVERY_REQUESTS, ser.ss([left.to_text()])).request())
    before = item(table)
    assert control._request(table, before, add(300))[0] is None
    lease = item(table)
    assert lease.lease_counter == before.lease_counter + 1 and lease.lease_owner is None
    assert starts(gaps.loads(lease.recovery)) == ["100", "300"]
    assert not lease.recovery_requests


# -- exactly-once state: a gap commits with its state in one transaction ----------------------


@pytest.fixture
def state_table(table: LeaseTable) -> str:
    name = f"{table.table_name}-state"
    table.client.create_table(
        TableName=name, BillingMode="PAY_PER_REQUEST",
        KeySchema=[{"AttributeName": "k", "KeyType": "HASH"}],
        AttributeDefinitions=[{"AttributeName": "k", "AttributeType": "S"}])
    return name


def put(state_table: str, key: str) -> Any:
    return {"Put": {"TableName": state_table, "Item": {"k": {"S": key}}}}


def test_a_gap_committed_with_its_state_takes_requests_in_within_the_transaction(
        table: LeaseTable, state_table: str) -> None:
    holder, _, recovery, _ = holding(table)
    with recovery._lock:
        recovery._store(lambda _: (gap_after(100),))
    control._request(table, item(table), add(300))
    renew(holder)
    entry = holder.held.entry(KEY)
    assert entry is not None
    due = entry.renew_due
    holder.clock.advance(1)
    recovery.checkpoint(Position("100", 0), Position("150"), [put(state_table, "a")])
    lease = item(table)
    assert [(r.start, r.done) for r in gaps.loads(lease.recovery)] == [("100", "150"),
                                                                        ("300", "300")]
    assert not lease.recovery_requests
    assert "Item" in table.client.get_item(TableName=state_table, Key={"k": {"S": "a"}})
    assert (entry.renewed_at, entry.renew_due) == (1, due), (
        "a transaction's answer has no item: the renewal that shows new requests stays due")
    # A request made after the transaction, and a commit of a gap cancelled meanwhile: the
    # state still commits, the request waits for the holder.
    control._request(table, item(table), cancel(100))
    renew(holder)
    recovery.poll()
    recovery.checkpoint(Position("100", 0), Position("160"), [put(state_table, "b")])
    assert "Item" in table.client.get_item(TableName=state_table, Key={"k": {"S": "b"}})
    lease = item(table)
    assert starts(gaps.loads(lease.recovery)) == ["300"] and lease.lease_owner == "A"


def test_a_request_nested_too_deep_to_decode_is_unreadable_not_an_escape() -> None:
    """JSON nested deeper than the decoder's recursion limit raises RecursionError, which
    no ValueError handler catches; such an element is unreadable like a typo (left in the
    item and logged by the holder), and the readable ones still apply."""
    nested = '{"add":' + "[" * 100_000 + "]" * 100_000 + "}"
    with pytest.raises(RecursionError):
        json.loads(nested)
    first = asked.adding(gap_after(100), 1_000)
    readable, unreadable = asked.read([nested, first.to_text()])
    assert [r for _, r in readable] == [first] and unreadable == [nested]


@pytest.mark.parametrize("text", ['{"id":"x","at":1e309,"cancel":[["1",0]]}',
                                  '{"id":"x","at":1,"cancel":[["1",-1e309]]}'])
def test_a_request_with_an_infinite_number_is_unreadable_not_an_escape(text: str) -> None:
    """JSON reads 1e309 as an infinite float and int() of it raises OverflowError, which no
    ValueError handler catches: it would escape the holder's queue write (and ``kclpy-ctl``'s
    listing). Such an element is unreadable like a typo, and the readable ones still apply."""
    first = asked.adding(gap_after(100), 1_000)
    readable, unreadable = asked.read([text, first.to_text()])
    assert [r for _, r in readable] == [first] and unreadable == [text]
