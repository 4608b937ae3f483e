"""The lease fence: every write only the holder may make - an UpdateItem, a TransactWriteItems
with the caller's own items, a write to another store - rejected once the lease moved on, with
the lease dropped and the lost listeners told. In-process moto, one section over moto's server."""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import boto3
import pytest
from botocore.exceptions import ClientError
from moto import mock_aws

from kclpy.checkpoint import Checkpointer
from kclpy.consumer import ShardConsumer
from kclpy.errors import (
    KinesisClientLibDependencyException,
    LeaseBusy,
    LeaseLostError,
    ShutdownException,
    ThrottlingException,
    TransactionRejected,
)
from kclpy.leases.fence import LeaseFence
from kclpy.leases.held import HeldSet
from kclpy.leases.lease import Lease
from kclpy.leases.serializer import UpdateBuilder, s
from kclpy.leases.table import LeaseTable, checkpoint_changes
from kclpy.local import LocalEndpoint
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
from tests.support.determinism import Clock
from tests.support.faultproxy import FaultProxy
from tests.support.scripted import SETTINGS, Host, Leases, Readers, Result, ScriptedFetcher, rec
from tests.support.streams import dynamodb_client, unique_name

if TYPE_CHECKING:
    from mypy_boto3_dynamodb.type_defs import TransactWriteItemTypeDef

REGION = "us-east-1"
FAILOVER = 10.0
STATE = "app-state"


class Told:
    def __init__(self) -> None:
        self.keys: list[str] = []

    def __call__(self, key: str) -> None:
        self.keys.append(key)


class ScriptedClient:
    """A real client whose next calls of an operation can be made to raise first, to run
    something first (``before``), or to be made and then answered with a 500 (``lost``:
    the answer lost on its way back, whatever the call did)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.failures: dict[str, list[Exception]] = {}
        self.before: dict[str, list[Callable[[], object]]] = {}
        self.lost: dict[str, int] = {}
        self.calls: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._client, name)
        if not callable(real):
            return real

        def call(**kwargs: Any) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            hooks = self.before.get(name)
            if hooks:
                hooks.pop(0)()
            pending = self.failures.get(name)
            if pending:
                raise pending.pop(0)
            if self.lost.get(name):
                self.lost[name] -= 1
                with contextlib.suppress(ClientError):
                    real(**kwargs)
                raise ClientError({"Error": {"Code": "InternalServerError", "Message": "lost"}},
                                  name)
            return real(**kwargs)

        return call


def throttled(operation: str = "UpdateItem") -> ClientError:
    code = "ProvisionedThroughputExceededException"
    return ClientError({"Error": {"Code": code, "Message": code}}, operation)


def transaction_throttled() -> ClientError:
    return ClientError(
        {"Error": {"Code": "TransactionCanceledException", "Message": "throttled"},
         "CancellationReasons": [{"Code": "ThrottlingError"}, {"Code": "None"}]},
        "TransactWriteItems")


class Worker:
    """One worker's held set and fence, with the taking done by hand."""

    def __init__(self, table: LeaseTable, worker_id: str, clock: Clock) -> None:
        self.table = table
        self.clock = clock
        self.held = HeldSet(worker_id, renewer_interval_s=FAILOVER / 2, metrics=Metrics())
        self.fence = LeaseFence(table, self.held, failover_time_s=FAILOVER, clock=clock)
        self.lost = Told()
        self.asked = Told()
        self.held.add_lost_listener(self.lost)
        self.held.add_handoff_listener(self.asked)

    def take(self, key: str) -> str:
        current = self.table.get(key)
        assert current is not None
        fresh = self.table.take(current, self.held.worker_id)
        fresh.concurrency_token = uuid.uuid4().hex
        self.held.install(fresh, self.clock())
        return fresh.concurrency_token


@pytest.fixture
def client() -> Iterator[ScriptedClient]:
    with mock_aws():
        yield ScriptedClient(boto3.client("dynamodb", region_name=REGION))


def make_table(client: Any, name: str = "app") -> LeaseTable:
    table = LeaseTable(client, name, max_attempts=3, sleep=lambda _: None)
    table.create_if_missing()
    assert table.create(Lease("s1"))
    return table


def make_state_table(client: Any, name: str = STATE) -> None:
    client.create_table(
        TableName=name, KeySchema=[{"AttributeName": "k", "KeyType": "HASH"}],
        AttributeDefinitions=[{"AttributeName": "k", "AttributeType": "S"}],
        BillingMode="PAY_PER_REQUEST")


def put_state(key: str, value: str, table: str = STATE) -> TransactWriteItemTypeDef:
    return {"Put": {"TableName": table, "Item": {"k": s(key), "v": s(value)}}}


def state(client: Any, key: str, table: str = STATE) -> str | None:
    item = client.get_item(TableName=table, Key={"k": s(key)}, ConsistentRead=True).get("Item")
    return None if item is None else str(item["v"]["S"])


@pytest.fixture
def table(client: ScriptedClient) -> LeaseTable:
    return make_table(client)


@pytest.fixture
def clock() -> Clock:
    return Clock()


def stored(table: LeaseTable) -> Lease:
    lease = table.get("s1")
    assert lease is not None
    return lease


# -- UpdateItem ------------------------------------------------------------------------------

def test_a_zombies_write_is_rejected_and_reported_lost(
    table: LeaseTable, client: ScriptedClient, clock: Clock
) -> None:
    zombie, thief = Worker(table, "A", clock), Worker(table, "B", clock)
    token = zombie.take("s1")
    thief_token = thief.take("s1")
    thief.fence.update_checkpoint("s1", thief_token, Position("900"))
    reads = client.calls.get("get_item", 0)
    with pytest.raises(ShutdownException, match="owner now B"):
        zombie.fence.update_checkpoint("s1", token, Position("100"))
    assert client.calls.get("get_item", 0) == reads, "the refusal carried the item: no read"
    assert zombie.lost.keys == ["s1"]
    assert zombie.held.get("s1") is None
    assert (stored(table).checkpoint.sequence_number, stored(table).lease_owner) == ("900", "B")


def test_a_write_to_a_deleted_lease_is_rejected_and_reported_lost(
    table: LeaseTable, clock: Clock
) -> None:
    """The item is gone (an operator, a stream created again): the refusal carries no item,
    and the holder drops the lease as owned by nobody."""
    a = Worker(table, "A", clock)
    token = a.take("s1")
    assert table.delete(stored(table))
    with pytest.raises(ShutdownException, match="owner now nobody"):
        a.fence.update_checkpoint("s1", token, Position("100"))
    assert a.lost.keys == ["s1"] and table.get("s1") is None


def test_a_checkpoint_puts_the_next_renewal_off_and_a_transaction_does_not(
    table: LeaseTable, client: ScriptedClient, clock: Clock
) -> None:
    """An UpdateItem's answer carries the item, so it renews the lease as well as a renewal
    would; a transaction's carries nothing, so the renewal stays due when it was (the
    renewal is how the holder sees what others added to the item)."""
    make_state_table(client)
    a = Worker(table, "A", clock)
    token = a.take("s1")
    entry = a.held.entry("s1")
    assert entry is not None
    clock.advance(1.0)
    a.fence.update_checkpoint("s1", token, Position("100"))
    assert (entry.renewed_at, entry.renew_due) == (1.0, 1.0 + FAILOVER / 2)
    clock.advance(1.0)
    a.fence.transact_checkpoint("s1", token, Position("200"), [put_state("k", "v")])
    assert (entry.renewed_at, entry.renew_due) == (2.0, 1.0 + FAILOVER / 2)
    assert a.asked.keys == [], "nobody asked for the lease: no handoff announced"


def test_an_unanswered_write_recognised_after_the_lease_was_given_up_lets_the_lease_go(
    table: LeaseTable, client: ScriptedClient, clock: Clock
) -> None:
    """A renewal lands and gets no answer; the next checkpoint is refused by the counter it
    moved and recognises it - but the worker gave the lease up while the checkpoint was on
    its way (its processor was told). The landed renewal made the lease this worker's again:
    it is released at once, and the checkpoint is neither repeated nor reported written."""
    a = Worker(table, "A", clock)
    token = a.take("s1")
    before = stored(table).lease_counter
    client.lost["update_item"] = 1  # a 500 is not retried by the table: the caller sees it
    with pytest.raises(KinesisClientLibDependencyException):
        a.fence.write("s1", None, table.renew, what="renewal")
    assert stored(table).lease_counter == before + 1, "the renewal landed"
    client.before["update_item"] = [lambda: a.held.expire(clock() + FAILOVER + 1, FAILOVER)]
    with pytest.raises(ShutdownException):
        a.fence.update_checkpoint("s1", token, Position("100"))
    assert a.held.get("s1") is None
    item = stored(table)
    assert (item.lease_owner, item.checkpoint) == (None, Position.trim_horizon())


def test_a_suspended_holder_does_not_even_try_after_the_failover_time(
    table: LeaseTable, client: ScriptedClient, clock: Clock
) -> None:
    a = Worker(table, "A", clock)
    token = a.take("s1")
    before = client.calls.get("update_item", 0)
    clock.advance(FAILOVER + 0.1)
    with pytest.raises(ShutdownException):
        a.fence.update_checkpoint("s1", token, Position("100"))
    assert client.calls.get("update_item", 0) == before, "nothing was sent"
    assert a.lost.keys == ["s1"]


def test_holds_says_whether_the_tenures_checkpoint_would_get_through(
    table: LeaseTable, clock: Clock
) -> None:
    a = Worker(table, "A", clock)
    token = a.take("s1")
    assert a.fence.holds("s1", token)
    assert not a.fence.holds("s1", "an earlier tenure")
    assert not a.fence.holds("s2", token)
    clock.advance(FAILOVER + 0.1)
    assert not a.fence.holds("s1", token)
    assert a.held.entry("s1") is not None and a.lost.keys == [], "asking gives nothing up"
    with pytest.raises(ShutdownException):
        a.fence.update_checkpoint("s1", token, Position("100"))


class Delivered(IRecordProcessor):
    """Checkpoints every batch; records what it was handed and how it ended."""

    def __init__(self) -> None:
        self.log: list[object] = []

    def initialize(self, initialize_input: InitializeInput) -> None:
        self.log.append("initialize")

    def process_records(self, process_records_input: ProcessRecordsInput) -> None:
        self.log.append([r.sequence_number for r in process_records_input.records])
        process_records_input.checkpointer.checkpoint()

    def lease_lost(self, lease_lost_input: LeaseLostInput) -> None:
        self.log.append("lease_lost")

    def shard_ended(self, shard_ended_input: ShardEndedInput) -> None:
        self.log.append("shard_ended")

    def shutdown_requested(self, shutdown_requested_input: ShutdownRequestedInput) -> None:
        self.log.append("shutdown_requested")


def test_a_consumer_whose_lease_expired_while_it_fetched_hands_the_batch_to_nobody(
    table: LeaseTable, clock: Clock
) -> None:
    """CI (tests/system/test_fleet.py's SIGTERM handover, load 20 on 2 cores): a worker
    starved past the failover time fetched a batch, and delivered it although its fence
    already refused every checkpoint of that tenure; the next holder delivered it again.
    The consumer asks the fence before each batch, so the batch goes to the next holder only."""
    a = Worker(table, "A", clock)
    token = a.take("s1")
    lease = a.held.get("s1")
    assert lease is not None

    class Starved(ScriptedFetcher):
        """The process is starved past the failover time while record 2 is fetched."""

        def get(self, timeout: float | None = None) -> Result | None:
            result = super().get(timeout)
            if result is not None and [r.sequence_number for r in result.records] == ["2"]:
                clock.advance(FAILOVER + 0.1)
            return result

    processor = Delivered()
    pages = [Result([rec(1)]), Result([rec(2)]), Result([rec(3)])]
    consumer = ShardConsumer(
        lease, concurrency_token=token, processor_factory=lambda: processor,
        fence=a.fence, readers=Readers(lambda start: Starved(pages, (start.checkpoint, 0))),
        host=Host(Leases()), settings=SETTINGS, metrics=Metrics())
    consumer.start()
    assert consumer.join(10)
    assert processor.log == ["initialize", ["1"], "lease_lost"]
    assert stored(table).checkpoint == Position("1")


def test_a_release_written_late_leaves_the_tenure_that_took_the_lease_again(
    table: LeaseTable, clock: Clock
) -> None:
    """``release_soon`` gives a lease up at once and writes the release in the background; if
    the lease is taken again first (by the same worker, a new tenure), that stale release is
    refused by the counter - and must not drop the new tenure, whose processor would then
    run on with every checkpoint refused and its records delivered again by the next
    holder."""
    a = Worker(table, "A", clock)
    a.take("s1")
    given_up = a.fence.give_up("s1")
    assert given_up is not None
    again = a.take("s1")
    a.fence.write_release(given_up)
    entry = a.held.entry("s1")
    assert entry is not None and entry.lease.concurrency_token == again
    a.fence.update_checkpoint("s1", again, Position("5"))
    assert (stored(table).lease_owner, stored(table).checkpoint) == ("A", Position("5"))
    assert a.lost.keys == []


def test_an_earlier_tenures_token_is_refused_without_a_request(
    table: LeaseTable, client: ScriptedClient, clock: Clock
) -> None:
    a = Worker(table, "A", clock)
    old = a.take("s1")
    a.fence.release("s1")
    new = a.take("s1")
    before = client.calls.get("update_item", 0)
    with pytest.raises(ShutdownException):
        a.fence.update_checkpoint("s1", old, Position("5"))
    assert client.calls.get("update_item", 0) == before
    a.fence.update_checkpoint("s1", new, Position("5"))
    assert stored(table).checkpoint.sequence_number == "5"


def test_writes_racing_renewals_always_condition_on_the_freshest_counter(
    table: LeaseTable, clock: Clock
) -> None:
    a = Worker(table, "A", clock)
    token = a.take("s1")
    rounds = 30
    errors: list[BaseException] = []

    def renew() -> None:
        try:
            for _ in range(rounds):
                a.fence.write("s1", None, table.renew, what="renewal")
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    renewer = threading.Thread(target=renew)
    renewer.start()
    for i in range(rounds):
        a.fence.update("s1", token, UpdateBuilder().set("appProgress", s(str(i))), what="test")
    renewer.join()
    assert errors == [] and a.lost.keys == []
    assert stored(table).lease_counter == 1 + 2 * rounds


def test_a_throttled_write_is_retried_and_keeps_the_fence(
    table: LeaseTable, client: ScriptedClient, clock: Clock
) -> None:
    a, b = Worker(table, "A", clock), Worker(table, "B", clock)
    token = a.take("s1")
    client.failures["update_item"] = [throttled(), throttled()]
    a.fence.update_checkpoint("s1", token, Position("10"))  # the third attempt goes through
    assert stored(table).checkpoint.sequence_number == "10" and a.lost.keys == []
    # throttled on every attempt: an error the processor may retry, the lease still held
    client.failures["update_item"] = [throttled()] * 3
    with pytest.raises(ThrottlingException):
        a.fence.update_checkpoint("s1", token, Position("11"))
    assert a.held.get("s1") is not None and a.lost.keys == []
    # ... and the retry after a steal is still fenced: the fence never forgot the counter
    b.take("s1")
    client.failures["update_item"] = [throttled()]
    with pytest.raises(ShutdownException):
        a.fence.update_checkpoint("s1", token, Position("12"))
    assert stored(table).checkpoint.sequence_number == "10"


def test_a_write_that_discovers_a_handoff_request_is_repeated_as_the_handing_off_holder(
    table: LeaseTable, clock: Clock
) -> None:
    a = Worker(table, "A", clock)
    token = a.take("s1")
    table.set_checkpoint_owner(stored(table), "B")
    a.fence.update_checkpoint("s1", token, Position("77"))
    assert a.asked.keys == ["s1"] and a.lost.keys == []
    assert a.held.handing_off("s1")
    lease = stored(table)
    assert lease.checkpoint == Position("77")
    assert (lease.lease_owner, lease.checkpoint_owner) == ("B", "A")
    a.fence.release("s1")
    assert (stored(table).lease_owner, stored(table).checkpoint_owner) == ("B", None)


class AnswerLost:
    """Stands in for the lease table's client: the next UpdateItem is applied, then
    ``meanwhile()`` runs (another worker's write), then the SDK's retry of the same request
    is refused by the condition the first attempt changed - with the item as it is then, as
    ``ReturnValuesOnConditionCheckFailure`` returns it."""

    def __init__(self, client: Any, meanwhile: Callable[[], object]) -> None:
        self._client = client
        self._meanwhile: Callable[[], object] | None = meanwhile

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def update_item(self, **kwargs: Any) -> Any:
        meanwhile, self._meanwhile = self._meanwhile, None
        if meanwhile is None:
            return self._client.update_item(**kwargs)
        self._client.update_item(**kwargs)
        meanwhile()
        item = self._client.get_item(TableName=kwargs["TableName"], Key=kwargs["Key"],
                                     ConsistentRead=True)["Item"]
        response: Any = {"Error": {"Code": "ConditionalCheckFailedException",
                                   "Message": "The conditional request failed"},
                         "Item": item}
        raise ClientError(response, "UpdateItem")


def test_a_request_written_between_a_landed_checkpoint_and_its_refused_retry_is_taken_up(
    table: LeaseTable, client: ScriptedClient, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A's checkpoint lands, B asks for the lease (no counter bump), then the SDK's retry of
    the checkpoint is refused: the checkpoint succeeded, and A hands the lease off."""
    a = Worker(table, "A", clock)
    token = a.take("s1")
    raw = client._client
    other = LeaseTable(raw, "app", sleep=lambda _: None)
    monkeypatch.setattr(table, "client", AnswerLost(
        raw, lambda: other.set_checkpoint_owner(stored(other), "B")))
    a.fence.update_checkpoint("s1", token, Position("77"))
    assert a.lost.keys == [] and a.asked.keys == ["s1"]
    assert a.held.handing_off("s1")
    a.fence.update_checkpoint("s1", token, Position("78"))
    assert a.asked.keys == ["s1"], "a request already taken up is announced once"
    lease = stored(table)
    assert lease.checkpoint == Position("78")
    assert (lease.lease_owner, lease.checkpoint_owner) == ("B", "A")
    a.fence.release("s1")
    assert (stored(table).lease_owner, stored(table).checkpoint_owner) == ("B", None)


# -- TransactWriteItems ----------------------------------------------------------------------

def test_a_transaction_commits_state_and_checkpoint_together(
    table: LeaseTable, client: ScriptedClient, clock: Clock
) -> None:
    make_state_table(client)
    a = Worker(table, "A", clock)
    token = a.take("s1")
    fresh = a.fence.transact(
        "s1", token, checkpoint_changes(Position("500", 2)), [put_state("x", "1")], what="commit",
        apply=lambda lease: lease.copy(checkpoint=Position("500", 2)))
    assert state(client, "x") == "1"
    lease = stored(table)
    assert lease.checkpoint == Position("500", 2)
    assert fresh == lease
    assert a.held.get("s1") == lease


def test_a_zombies_transaction_is_rejected_state_included(
    table: LeaseTable, client: ScriptedClient, clock: Clock
) -> None:
    make_state_table(client)
    zombie, thief = Worker(table, "A", clock), Worker(table, "B", clock)
    token = zombie.take("s1")
    thief.take("s1")
    with pytest.raises(ShutdownException):
        zombie.fence.transact("s1", token, checkpoint_changes(Position("500")),
                              [put_state("x", "zombie")], what="commit")
    assert state(client, "x") is None, "the state write was rejected with the checkpoint"
    assert zombie.lost.keys == ["s1"]
    assert stored(table).checkpoint == Position.trim_horizon()


def test_a_transaction_refused_by_its_own_items_keeps_the_lease(
    table: LeaseTable, client: ScriptedClient, clock: Clock
) -> None:
    make_state_table(client)
    a = Worker(table, "A", clock)
    token = a.take("s1")
    conditional = put_state("x", "2")
    conditional["Put"]["ConditionExpression"] = "attribute_exists(k)"
    with pytest.raises(TransactionRejected) as raised:
        a.fence.transact("s1", token, checkpoint_changes(Position("600")), [conditional],
                         what="commit")
    assert raised.value.reasons[1]["Code"] == "ConditionalCheckFailed"
    assert a.lost.keys == [] and a.held.get("s1") is not None
    assert stored(table).checkpoint == Position.trim_horizon() and state(client, "x") is None
    # the lease's counter did not move, so the next write still goes through
    a.fence.update_checkpoint("s1", token, Position("601"))


def test_a_throttled_transaction_is_retried(
    table: LeaseTable, client: ScriptedClient, clock: Clock
) -> None:
    make_state_table(client)
    a = Worker(table, "A", clock)
    token = a.take("s1")
    client.failures["transact_write_items"] = [transaction_throttled()]
    a.fence.transact("s1", token, checkpoint_changes(Position("700")), [put_state("y", "1")],
                     what="commit")
    assert state(client, "y") == "1" and stored(table).checkpoint.sequence_number == "700"
    assert client.calls["transact_write_items"] == 2


# -- another store ----------------------------------------------------------------------------

def test_a_guarded_write_gets_the_tenure_and_reports_a_newer_one_as_lost(
    table: LeaseTable, clock: Clock
) -> None:
    a = Worker(table, "A", clock)
    token = a.take("s1")
    first = stored(table).lease_counter
    a.fence.write("s1", None, table.renew, what="renewal")
    with a.fence.guard("s1", token, what="commit") as guard:
        assert guard.tenure == first, "renewals do not start a new tenure"
        assert guard.lease.lease_counter == first + 1
    with pytest.raises(ShutdownException), a.fence.guard("s1", token, what="commit"):
        raise LeaseLostError("the store holds tenure 99")
    assert a.lost.keys == ["s1"] and a.held.get("s1") is None
    with pytest.raises(ShutdownException), a.fence.guard("s1", token, what="commit"):
        pytest.fail("a lost lease must not run the block")


def test_a_guard_told_not_to_wait_refuses_a_lease_another_write_holds_and_takes_nothing(
    table: LeaseTable, clock: Clock
) -> None:
    """The micro-batcher's commit fence holds several leases; it asks the others without
    waiting, so a slow renewal of one never holds back the rest (simulator seed 665)."""
    a = Worker(table, "A", clock)
    token = a.take("s1")
    lock = a.held.lock_for("s1")
    # the lock held as by a renewal waiting for its answer
    with lock, pytest.raises(LeaseBusy), a.fence.guard("s1", token, what="commit", wait=False):
        pytest.fail("the block ran while another write held the lease")
    assert not lock.locked()
    with a.fence.guard("s1", token, what="commit", wait=False) as guard:
        assert lock.locked() and guard.lease.lease_key == "s1"
    assert not lock.locked() and a.lost.keys == []


def test_every_new_tenure_starts_above_every_counter_of_the_one_before(
    table: LeaseTable, clock: Clock
) -> None:
    a, b = Worker(table, "A", clock), Worker(table, "B", clock)
    a_token = a.take("s1")
    for _ in range(3):
        a.fence.write("s1", a_token, table.renew, what="renewal")
    a_last = stored(table).lease_counter
    b_token = b.take("s1")
    with b.fence.guard("s1", b_token, what="commit") as guard:
        assert guard.tenure > a_last


def test_a_deleted_leases_holder_cannot_write_into_the_lease_created_again(
    table: LeaseTable, clock: Clock
) -> None:
    """The lease created again and taken by the same worker id (a restarted process) reaches
    the same counter as the deleted one had: only the incarnation tells the items apart."""
    assert table.create(Lease("s2", incarnation="0:2000:first"))
    stale = Worker(table, "A", clock)
    stale_token = stale.take("s2")
    gone = table.get("s2")
    assert gone is not None and table.delete(gone)
    assert table.create(Lease("s2", incarnation="0:1000:second"))  # a clock behind
    fresh = Worker(table, "A", clock)
    fresh_token = fresh.take("s2")
    assert table.get("s2") == gone, "same owner and counter"
    with pytest.raises(ShutdownException):
        stale.fence.update_checkpoint("s2", stale_token, Position("100"))
    fresh.fence.update_checkpoint("s2", fresh_token, Position("200"))
    lease = table.get("s2")
    assert lease is not None
    assert (lease.checkpoint, lease.incarnation) == (Position("200"), "0:1000:second")


# -- over HTTP -------------------------------------------------------------------------------

@pytest.mark.integration
def test_over_http_a_zombie_transaction_is_rejected(moto_server: LocalEndpoint) -> None:
    client = boto3.client("dynamodb", endpoint_url=moto_server.url, region_name=REGION)
    suffix = uuid.uuid4().hex[:8]
    table = make_table(client, f"app-{suffix}")
    make_state_table(client, f"state-{suffix}")
    clock = Clock()
    zombie, thief = Worker(table, "A", clock), Worker(table, "B", clock)
    token = zombie.take("s1")
    zombie.fence.transact("s1", token, checkpoint_changes(Position("10")),
                          [put_state("x", "a", f"state-{suffix}")], what="commit")
    thief_token = thief.take("s1")
    with pytest.raises(ShutdownException):
        zombie.fence.transact("s1", token, checkpoint_changes(Position("20")),
                              [put_state("x", "zombie", f"state-{suffix}")], what="commit")
    thief.fence.transact("s1", thief_token, checkpoint_changes(Position("30")),
                         [put_state("x", "b", f"state-{suffix}")], what="commit")
    assert state(client, "x", f"state-{suffix}") == "b"
    assert stored(table).checkpoint.sequence_number == "30"
    assert zombie.lost.keys == ["s1"]



# -- a write whose answer was lost -----------------------------------------------------------

@pytest.fixture
def lossy(embedded_endpoint: LocalEndpoint) -> Iterator[tuple[FaultProxy, LeaseTable]]:
    """A lease table reached through a fault proxy: a test can make DynamoDB apply a write
    and the answer never arrive (botocore then re-sends the same request, three attempts)."""
    with FaultProxy(embedded_endpoint.url, seed=5) as proxy:
        table = make_table(dynamodb_client(proxy.url), unique_name("app"))
        yield proxy, table


@pytest.mark.integration
def test_a_renewal_whose_first_attempt_landed_keeps_the_lease(
    lossy: tuple[FaultProxy, LeaseTable],
) -> None:
    """The renewal is applied, its answer lost, and botocore's retry of the same request is
    refused by the condition the first attempt changed: the item is exactly what the
    renewal made it, so the worker keeps its lease instead of dropping it ("owner now A")
    and leaving the shard to nobody for a failover time."""
    proxy, table = lossy
    clock = Clock()
    a = Worker(table, "A", clock)
    a.take("s1")
    before = stored(table).lease_counter
    proxy.once("UpdateItem", "lose_response")
    a.fence.write("s1", None, table.renew, what="renewal")
    assert proxy.faults("lose_response") == 1 and proxy.requests("UpdateItem") == 3, (
        "the take, the renewal's lost attempt and its refused retry")
    assert a.lost.keys == []
    held = a.held.get("s1")
    assert held is not None and held.lease_counter == before + 1 == stored(table).lease_counter
    a.fence.write("s1", None, table.renew, what="renewal")
    assert stored(table).lease_counter == before + 2, "the next write holds the right counter"


@pytest.mark.integration
def test_a_checkpoint_whose_first_attempt_landed_succeeds(
    lossy: tuple[FaultProxy, LeaseTable],
) -> None:
    proxy, table = lossy
    clock = Clock()
    a = Worker(table, "A", clock)
    token = a.take("s1")
    proxy.once("UpdateItem", "lose_response")
    a.fence.update_checkpoint("s1", token, Position("1000", 2))
    assert proxy.faults("lose_response") == 1
    assert a.lost.keys == []
    assert stored(table).checkpoint == Position("1000", 2)
    a.fence.update_checkpoint("s1", token, Position("2000"))
    assert stored(table).checkpoint == Position("2000")


@pytest.mark.integration
def test_an_earlier_unanswered_renewal_is_recognised_and_never_taken_for_another_write(
    lossy: tuple[FaultProxy, LeaseTable],
) -> None:
    """A renewal lands but no answer ever comes (every attempt's answer lost: the caller
    gets an error). The next write, a checkpoint, is refused by the counter that renewal
    moved: the item has the same owner and the counter one higher - what the checkpoint
    would have made of it but for the checkpoint itself. The fence recognises the renewal
    by its write id, not by owner and counter, and writes the checkpoint on top of it."""
    proxy, table = lossy
    clock = Clock()
    a = Worker(table, "A", clock)
    token = a.take("s1")
    before = stored(table).lease_counter
    for _ in range(3):
        proxy.once("UpdateItem", "lose_response")
    with pytest.raises(KinesisClientLibDependencyException):
        a.fence.write("s1", None, table.renew, what="renewal")
    assert stored(table).lease_counter == before + 1, "the renewal landed"
    clock.advance(1.0)
    a.fence.update_checkpoint("s1", token, Position("1000"))
    assert a.lost.keys == []
    item = stored(table)
    assert item.checkpoint == Position("1000"), "the checkpoint itself was written"
    assert item.lease_counter == before + 2
    held = a.held.entry("s1")
    assert held is not None and held.lease.lease_counter == before + 2
    # Another worker's write is never taken for ours: A's next renewal lands unanswered
    # again, then B takes the lease. A's own write is in the item's history, no longer its
    # state (the counter moved on past it), so A's next write is refused and A lets go.
    for _ in range(3):
        proxy.once("UpdateItem", "lose_response")
    with pytest.raises(KinesisClientLibDependencyException):
        a.fence.write("s1", None, table.renew, what="renewal")
    b = Worker(table, "B", clock)
    b.take("s1")
    with pytest.raises(ShutdownException):
        a.fence.update_checkpoint("s1", token, Position("2000"))
    assert a.lost.keys == ["s1"]
    assert (stored(table).lease_owner, stored(table).checkpoint) == ("B", Position("1000"))


@pytest.mark.integration
def test_a_transaction_whose_first_attempt_landed_commits_once(
    lossy: tuple[FaultProxy, LeaseTable],
) -> None:
    """A checkpoint committed with a state item, applied and its answer lost: the retry is
    refused (or, on AWS, answered from its ``ClientRequestToken``), and the commit counts as
    made - the lease kept, the state written once."""
    proxy, table = lossy
    client: Any = table.client
    state_table = unique_name("state")
    make_state_table(client, state_table)
    clock = Clock()
    a = Worker(table, "A", clock)
    token = a.take("s1")
    proxy.once("TransactWriteItems", "lose_response")
    a.fence.transact("s1", token, checkpoint_changes(Position("10")),
                     [put_state("x", "a", state_table)], what="commit")
    assert proxy.faults("lose_response") == 1
    assert a.lost.keys == []
    assert stored(table).checkpoint == Position("10")
    assert state(client, "x", state_table) == "a"
    a.fence.update_checkpoint("s1", token, Position("20"))
    assert stored(table).checkpoint == Position("20")


def add_one(key: str, table: str) -> TransactWriteItemTypeDef:
    """An unconditioned item that counts how often it was applied (a user's ``emit``)."""
    return {"Update": {"TableName": table, "Key": {"k": s(key)},
                       "UpdateExpression": "ADD #n :one",
                       "ExpressionAttributeNames": {"#n": "n"},
                       "ExpressionAttributeValues": {":one": {"N": "1"}}}}


@pytest.mark.integration
def test_a_transaction_is_never_repeated_over_an_earlier_unanswered_one_that_landed(
    lossy: tuple[FaultProxy, LeaseTable],
) -> None:
    """A commit lands and every attempt's answer is lost; the next commit, built without
    knowing, is refused by the counter the first one moved. Repeated from that counter its
    items would apply a second time (an unconditioned one) or be refused as a conflict
    with this worker's own writes: it is not repeated. Nothing is written, the lease is
    kept at the landed commit's counter, and ``TransactionRejected`` sends the committer to
    read back what landed."""
    proxy, table = lossy
    client: Any = table.client
    state_table = unique_name("state")
    make_state_table(client, state_table)
    clock = Clock()
    a = Worker(table, "A", clock)
    token = a.take("s1")
    before = stored(table).lease_counter
    for _ in range(3):
        proxy.once("TransactWriteItems", "lose_response")
    with pytest.raises(KinesisClientLibDependencyException):
        a.fence.transact_checkpoint("s1", token, Position("10"), [add_one("x", state_table)])
    assert stored(table).checkpoint == Position("10"), "the first commit landed"
    with pytest.raises(TransactionRejected, match="earlier transaction"):
        a.fence.transact_checkpoint("s1", token, Position("10"), [add_one("x", state_table)])
    item = client.get_item(TableName=state_table, Key={"k": s("x")}, ConsistentRead=True)
    assert item["Item"]["n"] == {"N": "1"}, "applied once"
    assert a.lost.keys == []
    held = a.held.entry("s1")
    assert held is not None and held.lease.lease_counter == before + 1
    assert a.fence.durable_checkpoint("s1", token) == Position("10")
    a.fence.transact_checkpoint("s1", token, Position("20"), [add_one("x", state_table)])
    assert stored(table).checkpoint == Position("20")


def test_a_checkpoint_never_moves_the_lease_back_over_an_earlier_one_that_landed_unanswered(
    table: LeaseTable, client: ScriptedClient, clock: Clock
) -> None:
    """A checkpoint at 10 lands but every answer is lost; the processor is replaced in the
    same tenure and its successor, made from the checkpoint read before 10 was known,
    checkpoints 7. The fence finds the earlier write landed and repeats this one on the
    item it left: the lease must stay at 10, or the next holder delivers 8-10 again, at or
    before a checkpoint that was durable. (An independent review found the repeat moving it
    back; exactly-once commits were fixed for it first.)"""
    a = Worker(table, "A", clock)
    token = a.take("s1")
    a.fence.update_checkpoint("s1", token, Position("5"))
    client.lost["update_item"] = 1
    with pytest.raises(KinesisClientLibDependencyException):
        a.fence.update_checkpoint("s1", token, Position("10"))
    assert stored(table).checkpoint == Position("10")
    a.fence.update_checkpoint("s1", token, Position("7"))
    assert stored(table).checkpoint == Position("10")
    assert a.held.get("s1") is not None, "still held: nothing was lost"
    a.fence.update_checkpoint("s1", token, Position("11"))
    assert stored(table).checkpoint == Position("11")


def test_a_record_checkpoint_never_moves_the_lease_back_over_a_shard_end_that_landed_unanswered(
    table: LeaseTable, client: ScriptedClient, clock: Clock
) -> None:
    """The SHARD_END of ``shard_ended`` lands but its answer is lost, so the checkpointer
    still holds the last record as its own last checkpoint; a checkpoint at that record
    (``shard_ended`` called again, or a batcher thread committing late) is then repeated
    on the item the lost write left. SHARD_END sorts after every record, yet the guard
    against moving back looked at record checkpoints only: the lease went from SHARD_END
    back to the record, and the shard's children - which may have started on SHARD_END -
    would see their parent's records delivered again after theirs."""
    a = Worker(table, "A", clock)
    token = a.take("s1")
    checkpointer = Checkpointer("s1", a.fence, token, Position("5"))
    checkpointer.mark_delivered(rec(9))
    checkpointer.mark_shard_end()
    client.lost["update_item"] = 1
    with pytest.raises(KinesisClientLibDependencyException):
        checkpointer.checkpoint()
    assert stored(table).checkpoint == Position.shard_end()
    checkpointer.checkpoint(rec(9))
    assert stored(table).checkpoint == Position.shard_end()
    assert a.held.get("s1") is not None, "still held: nothing was lost"
